"""One module per command area; each exposes register(app)."""

from __future__ import annotations

import importlib

import typer

# Areas in the order `kvctl --help` lists them.
AREAS = ("rig", "model", "cluster", "attach", "verify", "store", "validate", "scenario", "bench", "router", "image",
         "render")


def register_all(app: typer.Typer) -> None:
    for area in AREAS:
        importlib.import_module(f"kvctl.commands.{area}").register(app)
