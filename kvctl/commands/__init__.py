"""One module per command area; each exposes register(app)."""

from __future__ import annotations

import importlib

import typer

# Areas in the order `kvctl --help` lists them.
AREAS = ("rig", "model", "cluster", "verify", "store", "validate", "scenario", "bench", "image")


def register_all(app: typer.Typer) -> None:
    for area in AREAS:
        try:
            module = importlib.import_module(f"kvctl.commands.{area}")
        except ModuleNotFoundError as e:
            if e.name == f"kvctl.commands.{area}":
                continue  # area not built yet
            raise
        module.register(app)
