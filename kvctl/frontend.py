"""Running a typer app as a front end: its options parsed by click, errors mapped to exit codes.

Every front end (`kvctl`, and `python -m kvctl.router`, which runs the one
command `kvctl router serve`) goes through `run`, so
each reports an error the same way: rich on stderr (`error:`, `where:`, `fix:`),
also one JSON object on stdout under `--json`, a traceback under `--debug`, and
the error's exit code. `--json` and `--debug` are read from the parsed options
(their callbacks fill the run's RunFlags), never from argv: a prompt whose
text is `--json` is a value. Light on purpose: it imports no command.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import typer

from kvctl.errors import ExitCode, KvctlError
from kvctl.options import DEBUG_HELP, RunFlags, remember_debug
from kvctl.views.output import Output

DEBUG_OPT = typer.Option(False, "--debug", help=DEBUG_HELP, is_eager=True, expose_value=False,
                         callback=remember_debug)


def _debug_option() -> Any:
    """DEBUG_OPT as a click parameter, hidden (the root's help names it once)."""
    probe = typer.Typer()

    @probe.command()
    def _probe(debug: bool = DEBUG_OPT) -> None: ...

    param = next(p for p in typer.main.get_command(probe).params if p.name == "debug")
    hidden = copy.copy(param)
    hidden.hidden = True
    return hidden


def with_debug(command: Any) -> Any:
    """`command` and every command under it with a --debug option (`kvctl launch 1p1d --debug`)."""
    debug = _debug_option()

    def add(cmd: Any) -> None:
        if not any(p.name == "debug" for p in cmd.params):
            cmd.params.append(debug)
        for sub in getattr(cmd, "commands", {}).values():
            add(sub)

    add(command)
    return command


def cli_flag(field: str) -> str:
    """The CLI spelling of a library field: `max_tokens` -> `--max-tokens`.

    Every option is named after the field it sets, so one rule serves all
    commands; scenario files map fields to their own paths (kvctl.scenario).
    """
    return "--" + field.replace("_", "-")


def run(app: typer.Typer, args: list[str], prog_name: str) -> int:
    """Run `app` on `args`; the ExitCode (or a command's own exit code). Re-raises under --debug."""
    flags = RunFlags()
    out = Output()
    try:
        # Without standalone mode, click returns a command's typer.Exit code instead of raising.
        result = with_debug(typer.main.get_command(app)).main(args=args, prog_name=prog_name,
                                                               standalone_mode=False, obj=flags)
        code = result if isinstance(result, int) else ExitCode.OK
        if code == ExitCode.INTERRUPTED:  # a command that cleaned up after Ctrl-C itself
            out.stderr.print("[yellow]interrupted[/yellow]")
    except KvctlError as e:
        out.json_mode = flags.json
        out.error(e.locate(cli_flag))
        if flags.debug:
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
    return int(code)


def single_command_app(command: Any) -> typer.Typer:
    """A typer app whose one command is `command` (a `python -m` entry point for a kvctl command)."""
    app = typer.Typer(pretty_exceptions_enable=False, add_completion=False)
    app.command()(command)
    return app
