"""`kvctl image build cpu|gpu`: build (or find) the images the docker runtime runs."""

from __future__ import annotations

import typer
from rich.markup import escape

from kvctl.provision import images
from kvctl.provision.images import ImageEvent
from kvctl.views.output import Output

image_app = typer.Typer(
    help="Container images for `--runtime docker`, tagged by a hash of their inputs "
         "(a build with unchanged inputs is instant). Uses the engine DOCKER_HOST names.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(image_app, name="image")


class _BuildReporter:
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


@image_app.command("build")
def build(
    kind: str = typer.Argument(
        ..., help="cpu (vLLM 0.9.2 CPU rig) or gpu (official vLLM 0.9.2 image + LMCache)."),
    base_image: str | None = typer.Option(
        None, "--base-image", help=f"gpu only: the image to build FROM (default {images.DEFAULT_GPU_BASE})."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show every build output line."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
) -> None:
    """Build the cpu or gpu image for this checkout; prints its tag (use it with --image)."""
    out = Output(json_mode=json_)
    result = images.build_image(kind, base_image=base_image, progress=_BuildReporter(out, verbose))
    if json_:
        out.emit_json(result.to_json())
        return
    how = "found (inputs unchanged)" if result.cached else f"built in {result.seconds:.0f} s"
    out.info(f"{kind} image {how}: {result.size_bytes / 1e9:.2f} GB, FROM {result.base_image}")
    out.stdout.print(result.tag, highlight=False)
