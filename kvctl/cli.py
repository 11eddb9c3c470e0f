"""The kvctl command line: builds the typer app and maps errors to exit codes.

Commands live in `kvctl.commands.<area>` (one module per area, each with a
`register(app)`); they parse options, call one library function and hand the
result to a renderer in `kvctl.views.output`. Errors are caught only here.

How an error is reported (kvctl.frontend.run) follows the options the parser
saw: `--json` (an error is also one JSON object on stdout) and `--debug` (a
traceback), an option of the root and of every command. An option's value
that reads `--json` (a prompt) is a value, not the option.
"""

from __future__ import annotations

import sys

import typer

from kvctl.commands import register_all
from kvctl.frontend import DEBUG_OPT, cli_flag, run

__all__ = ["app", "cli_flag", "main"]

app = typer.Typer(
    name="kvctl",
    help="Launch, verify, inspect and tear down P/D-disaggregated vLLM clusters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
register_all(app)


@app.callback()
def _root(debug: bool = DEBUG_OPT) -> None:
    """Launch, verify, inspect and tear down P/D-disaggregated vLLM clusters.

    Add --debug to any command to see tracebacks.
    """


@app.command()
def version() -> None:
    """Print kvctl's version."""
    from kvctl import __version__

    typer.echo(__version__)


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point. Returns (and exits with, when run from argv) an ExitCode."""
    code = run(app, list(sys.argv[1:] if argv is None else argv), "kvctl")
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
