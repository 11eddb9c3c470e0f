"""`kvctl rig`: install, locate and inspect the CPU rig (vLLM 0.9.2 CPU + this project)."""

from __future__ import annotations

import typer

from kvctl.options import JSON_OPT
from kvctl.provision import rig
from kvctl.views.output import Output
from kvctl.views.rig import InstallReporter, render_installed, render_rig_status

rig_app = typer.Typer(
    help="The CPU rig: a venv with vLLM 0.9.2 (CPU, V0) and this project, under "
         "$KVCTL_HOME/rigs. Env: KVCTL_RIG_PYTHON uses a pre-built rig's interpreter; "
         "KVCTL_RIG_SPEC names a JSON file of pin overrides.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(rig_app, name="rig")


@rig_app.command("install")
def install(json_out: bool = JSON_OPT) -> None:
    """Build the rig, or finish it: steps already done are skipped (a complete rig: instant)."""
    out = Output(json_mode=json_out)
    with InstallReporter(out.stderr) as reporter:
        info = rig.install(progress=reporter)
    render_installed(out, info)


@rig_app.command("python")
def python() -> None:
    """Print the rig's interpreter path (for scripts: `$(kvctl rig python) -m ...`)."""
    typer.echo(str(rig.rig_python()))


@rig_app.command("status")
def status(json_out: bool = JSON_OPT) -> None:
    """Show where the rig is, which steps are done, its size and its key inputs."""
    out = Output(json_mode=json_out)
    render_rig_status(out, rig.rig_status())
