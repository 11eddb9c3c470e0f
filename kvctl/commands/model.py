"""`kvctl model`: write the deterministic random-weight Llama models (no model hub)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvctl.options import JSON_OPT
from kvctl.provision import tiny_model
from kvctl.views.model import render_model
from kvctl.views.output import Output

model_app = typer.Typer(
    help="Write a random-weight Llama (HF format, offline BPE tokenizer with a chat "
         "template). Same preset and seed: byte-identical files.",
    no_args_is_help=True,
)

OUT_OPT = typer.Option(..., "--out", help="Folder to write (new, empty, or an earlier kvctl model).")
SEED_OPT = typer.Option(0, "--seed", min=0, help="Weight seed.")


def register(app: typer.Typer) -> None:
    app.add_typer(model_app, name="model")


@model_app.command("tiny")
def tiny(out: Path = OUT_OPT, seed: int = SEED_OPT, json_out: bool = JSON_OPT) -> None:
    """The test model: 2 layers, hidden 128, float32 (~3 MB, instant)."""
    _write(out, "tiny", seed, json_out)


@model_app.command("bench")
def bench(out: Path = OUT_OPT, seed: int = SEED_OPT, json_out: bool = JSON_OPT) -> None:
    """The benchmark model: 24 layers, hidden 1024, float32 (~1.15 GB, a few seconds)."""
    _write(out, "bench", seed, json_out)


def _write(out_dir: Path, preset: str, seed: int, json_out: bool) -> None:
    out = Output(json_mode=json_out)
    render_model(out, tiny_model.write_model(out_dir, preset, seed), preset, seed)
