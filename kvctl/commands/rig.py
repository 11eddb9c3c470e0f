"""`kvctl rig`: install, locate and inspect the CPU rig (read-only torch + vLLM) and the
overlay that brings this kvctl's connectors to it."""

from __future__ import annotations

from pathlib import Path

import typer

from kvctl.errors import BadInput
from kvctl.options import JSON_OPT
from kvctl.provision import extras, overlay, rig
from kvctl.views.output import Output
from kvctl.views.rig import (InstallReporter, render_installed, render_layered_venv, render_overlay,
                             render_rig_status)

rig_app = typer.Typer(
    help="The CPU rig: a read-only venv with torch and vLLM under $KVCTL_HOME/rigs, one per "
         "engine and set of pins, shared by every kvctl installation (checkouts, wheels, "
         "pipx). Engine v0 (the default): vLLM 0.9.2 CPU, the V0 connectors; v1: vLLM 0.32.0 "
         "CPU on torch 2.13.0. Each kvctl brings its own connectors to the servers through "
         "an overlay ($KVCTL_HOME/overlays) on their PYTHONPATH. Env: KVCTL_RIG_PYTHON (v0), "
         "KVCTL_RIG_V1_PYTHON (v1) use a pre-built rig's interpreter; KVCTL_RIG_SPEC names a JSON "
         "file of pin overrides for the engine it names (default v0). Extras (--extra): what a "
         "third-party connector needs beside the rig (nixl: NIXL + UCX for NixlConnector), each in "
         "a venv layered on the rig under $KVCTL_HOME/extras, put on the PYTHONPATH of the servers "
         "whose config names that connector.",
    no_args_is_help=True,
)

ENGINE_OPT = typer.Option(
    None, "--engine", help=f"Which rig: {' or '.join(rig.ENGINES)} (default {rig.DEFAULT_ENGINE}: "
                           "vLLM 0.9.2, V0 connectors; v1: vLLM 0.32.0).")


EXTRA_OPT = typer.Option(
    [], "--extra", metavar="NAME",
    help=f"Also install this extra on the rig (repeatable): {', '.join(f'{e.name} ({e.summary}, engine {e.engine})' for e in extras.EXTRAS.values())}.")


def register(app: typer.Typer) -> None:
    app.add_typer(rig_app, name="rig")


@rig_app.command("install")
def install(engine: str | None = ENGINE_OPT, extra: list[str] = EXTRA_OPT,
            json_out: bool = JSON_OPT) -> None:
    """Build the rig, or finish it: steps already done are skipped (a complete rig: instant).
    Then each --extra on it, the same way."""
    out = Output(json_mode=json_out)
    spec = rig.default_spec(engine)
    wanted = [extras.get_extra(name) for name in dict.fromkeys(extra)]
    extras.check_engines(wanted, spec)
    with InstallReporter(out.stderr) as reporter:
        info = rig.install(progress=reporter, spec=spec)
        done = [extras.install_extra(e, spec, progress=reporter) for e in wanted]
    render_installed(out, info, done)


@rig_app.command("python")
def python(engine: str | None = ENGINE_OPT) -> None:
    """Print the rig's interpreter path; exits 2 with the reason when the rig is not installed.

    The rig holds torch and vLLM only: run kvctl's code with it through `kvctl rig venv`
    (tests) or the overlay `kvctl rig overlay` builds and prints (PYTHONPATH).
    """
    typer.echo(str(rig.rig_python(rig.default_spec(engine))))


@rig_app.command("status")
def status(engine: str | None = ENGINE_OPT, json_out: bool = JSON_OPT) -> None:
    """Show the rig (steps, size, inputs), its engine's extras and the overlay this kvctl would use."""
    out = Output(json_mode=json_out)
    spec = rig.default_spec(engine)
    render_rig_status(out, rig.rig_status(spec) | {
        "extras": [extras.extra_status(e, spec) for e in extras.extras_for_engine(spec.engine)],
        "overlay": overlay.overlay_status()})


@rig_app.command("overlay")
def overlay_cmd(engine: str | None = typer.Option(
        None, "--engine", help="Also name this engine's rig interpreter to run it with (JSON `python`; "
                               f"{' or '.join(rig.ENGINES)})."),
        json_out: bool = JSON_OPT) -> None:
    """Build this kvctl's overlay if it is missing and print its site directory.

    Put the site first on PYTHONPATH to run this kvctl's connectors in your own vLLM:
    `export PYTHONPATH="$(kvctl rig overlay)${PYTHONPATH:+:$PYTHONPATH}"`.
    """
    out = Output(json_mode=json_out)
    spec = rig.default_spec(engine) if engine is not None else None  # an unknown engine: exit 2
    built = overlay.ensure_overlay()
    python = None
    if spec is not None:
        try:
            python = str(rig.rig_python(spec))
        except BadInput:
            python = None  # that rig is not installed: the overlay serves any vLLM all the same
    render_overlay(out, built, overlay.overlay_status(), engine, python)


@rig_app.command("venv")
def venv(path: Path = typer.Argument(..., help="The venv's directory (made, or brought up to date)."),
         engine: str | None = ENGINE_OPT, json_out: bool = JSON_OPT) -> None:
    """Make PATH a venv layered on the rig (prints its python).

    It sees the rig's packages and installs only into itself (`PATH/bin/python -m pip
    install ...`, pinned to the rig's versions), so the rig stays as built. `make test`
    keeps one per checkout (.venv/rig) for kvctl and pytest.
    """
    out = Output(json_mode=json_out)
    render_layered_venv(out, rig.layered_venv(path, rig.default_spec(engine)))
