"""`kvctl image build cpu|gpu [--engine v0|v1]`: build (or find) the images the docker runtime runs."""

from __future__ import annotations

import typer

from kvctl.options import json_option
from kvctl.provision import images
from kvctl.views.image import BuildReporter, render_image
from kvctl.views.output import Output

image_app = typer.Typer(
    help="Container images for `--runtime docker`, tagged by a hash of their inputs "
         "(a build with unchanged inputs is instant). Uses the engine DOCKER_HOST names.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(image_app, name="image")


@image_app.command("build")
def build(
    kind: str = typer.Argument(
        ..., help="cpu (the engine's CPU rig + its extras + this kvctl) or gpu (official vLLM "
                  "image + LMCache + this kvctl)."),
    engine: str = typer.Option(
        "v0", "--engine",
        help=f"vLLM engine of the image: v0 (default; cpu: vLLM 0.9.2, tagged {images.cpu_repos('v0')[1]}; "
             f"gpu FROM {images.DEFAULT_GPU_BASES['v0']}, tagged {images.gpu_repo('v0')}) or v1 (cpu: vLLM "
             f"0.32 with the NIXL and LMCache extras, tagged {images.cpu_repos('v1')[1]}; gpu FROM "
             f"{images.DEFAULT_GPU_BASES['v1']}, tagged {images.gpu_repo('v1')})."),
    base_image: str | None = typer.Option(
        None, "--base-image", help="gpu only: the image to build FROM (default: the engine's official "
                                   "vLLM image, see --engine)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show every build output line."),
    json_: bool = json_option("Print the result as one JSON object."),
) -> None:
    """Build the cpu or gpu image for this kvctl; prints its tag (use it with --image).

    cpu: a rig layer (vLLM, keyed by the rig's pins: minutes, once), for v1 a layer with its
    extras (NIXL, LMCache; keyed by their pins), and a thin layer with this kvctl's connectors
    (seconds). Needs the docker extra: pip install 'kvctl\\[docker]'."""
    out = Output(json_mode=json_)
    result = images.build_image(kind, base_image=base_image, progress=BuildReporter(out, verbose), engine=engine)
    render_image(out, result)
