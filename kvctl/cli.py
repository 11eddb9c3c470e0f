"""The kvctl command line: builds the typer app and maps errors to exit codes.

Commands live in `kvctl.commands.<area>` (one module per area, each with a
`register(app)`); they parse options, call one library function and hand the
result to a renderer in `kvctl.views.output`. Errors are caught only here.
"""

from __future__ import annotations

import sys

import typer

from kvctl.commands import register_all
from kvctl.errors import ExitCode, KvctlError
from kvctl.views.output import Output

app = typer.Typer(
    name="kvctl",
    help="Launch, verify, inspect and tear down P/D-disaggregated vLLM clusters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
register_all(app)


@app.callback()
def _root() -> None:
    """Launch, verify, inspect and tear down P/D-disaggregated vLLM clusters.

    Add --debug to any command to see tracebacks.
    """


@app.command()
def version() -> None:
    """Print kvctl's version."""
    from kvctl import __version__

    typer.echo(__version__)


def cli_flag(field: str) -> str:
    """The CLI spelling of a library field: `max_tokens` -> `--max-tokens`.

    Every option is named after the field it sets, so one rule serves all
    commands; scenario files map fields to their own paths (kvctl.scenario).
    """
    return "--" + field.replace("_", "-")


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point. Returns (and exits with) an ExitCode."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    args = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--debug"]
    out = Output.for_args(args)
    try:
        # Without standalone mode, click returns a command's typer.Exit code instead of raising.
        result = app(args=args, prog_name="kvctl", standalone_mode=False)
        code = result if isinstance(result, int) else ExitCode.OK
        if code == ExitCode.INTERRUPTED:  # a command that cleaned up after Ctrl-C itself
            out.stderr.print("[yellow]interrupted[/yellow]")
    except KvctlError as e:
        out.error(e.locate(cli_flag))
        if debug:
            raise
        code = e.exit_code
    except (KeyboardInterrupt, typer.Abort):
        out.stderr.print("[yellow]interrupted[/yellow]")
        code = ExitCode.INTERRUPTED
    except typer.Exit as e:  # raised by commands to report a check result
        code = ExitCode(e.exit_code) if e.exit_code in iter(ExitCode) else e.exit_code
    except typer.TyperException as e:  # usage errors: unknown option, bad value
        show = getattr(e, "show", None)
        if show:
            show(file=sys.stderr)
        else:
            out.stderr.print(f"error: {e.format_message()}", markup=False)
        code = ExitCode.BAD_INPUT
    if argv is None:
        sys.exit(int(code))
    return int(code)


if __name__ == "__main__":
    main()
