"""Model views: the model written (or found) by `kvctl model`."""

from __future__ import annotations

from rich.markup import escape

from kvctl.provision.tiny_model import ModelInfo
from kvctl.views.output import Output


def render_model(out: Output, info: ModelInfo, preset: str, seed: int) -> None:
    """What was written (stderr) and the model's folder (stdout), or the JSON."""
    if out.json_mode:
        out.emit_json(info.to_json())
        return
    verb = "wrote" if info.created else "already there:"
    out.info(f"{verb} {preset} model (seed {seed}, {info.dtype}): "
             f"{info.num_params:,} params, {info.total_bytes / 1e6:.1f} MB")
    out.stdout.print(escape(str(info.path)), highlight=False)
