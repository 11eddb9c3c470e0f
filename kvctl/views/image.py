"""Image views: build progress as plain lines, and the built (or found) image."""

from __future__ import annotations

from rich.markup import escape

from kvctl.provision.images import ImageEvent, ImageResult
from kvctl.views.output import Output


class BuildReporter:
    """Build steps as plain lines on stderr (other output goes to the build log)."""

    def __init__(self, out: Output, verbose: bool):
        self.out = out
        self.verbose = verbose

    def __call__(self, ev: ImageEvent) -> None:
        if ev.state == "log":
            self.out.info(f"[dim]{escape(ev.image)}: full log {escape(ev.note)}[/dim]")
        elif ev.state == "start":
            self.out.info(f"[bold]{escape(ev.image)}[/bold]: {escape(ev.note)}")
        elif ev.state == "step" or (ev.state == "output" and self.verbose):
            self.out.info(f"  {escape(ev.note)}")
        elif ev.state == "cached":
            self.out.info(f"{escape(ev.image)}: {escape(ev.note)}")
        elif ev.state == "done":
            self.out.info(f"[green]{escape(ev.image)}[/green]: built ({escape(ev.note)})")


def render_image(out: Output, result: ImageResult) -> None:
    """`kvctl image build`: how it was made (stderr) and its tag (stdout), or the JSON."""
    if out.json_mode:
        out.emit_json(result.to_json())
        return
    how = "found (inputs unchanged)" if result.cached else f"built in {result.seconds:.0f} s"
    out.info(f"{result.kind} image {how}: {result.size_bytes / 1e9:.2f} GB, FROM {result.base_image}")
    out.stdout.print(result.tag, highlight=False)
