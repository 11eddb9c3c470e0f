"""Typer options that several commands share (commands never import each other)."""

from __future__ import annotations

import typer

JSON_HELP = "Print one JSON object on stdout."
JSON_OPT = typer.Option(False, "--json", help=JSON_HELP)


def json_option(help: str = JSON_HELP) -> bool:
    """A --json option with its own help text (e.g. naming the top-level keys)."""
    return typer.Option(False, "--json", help=help)
