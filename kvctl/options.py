"""Typer options that several commands share (commands never import each other).

`--json` and `--debug` also tell the front end (kvctl.cli) how to report an
error: their callbacks record them in the run's `RunFlags` (the click
context's `obj`), so only a real option counts, never an option's value (a
prompt whose text is `--json`).
"""

from __future__ import annotations

from dataclasses import dataclass

import typer

JSON_HELP = "Print one JSON object on stdout."
DEBUG_HELP = "Show tracebacks."


@dataclass
class RunFlags:
    """What the command line asked of the front end itself (kvctl.cli passes one in as `obj`)."""

    json: bool = False  # errors as one JSON object on stdout too
    debug: bool = False  # re-raise errors: a traceback


def run_flags(ctx: typer.Context) -> RunFlags | None:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, RunFlags) else None


def _remember_json(ctx: typer.Context, value: bool) -> bool:
    flags = run_flags(ctx)
    if value and flags is not None:
        flags.json = True
    return value


def remember_debug(ctx: typer.Context, value: bool) -> bool:
    flags = run_flags(ctx)
    if value and flags is not None:
        flags.debug = True
    return value


def json_option(help: str = JSON_HELP) -> bool:
    """A --json option with its own help text (e.g. naming the top-level keys).

    Eager: recorded before the other options are checked, so their errors come as JSON too.
    """
    return typer.Option(False, "--json", help=help, is_eager=True, callback=_remember_json)


JSON_OPT = json_option()
