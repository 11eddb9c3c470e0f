"""`kvctl rig`: install, locate and inspect the CPU rig (vLLM 0.9.2 CPU + this project)."""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table

from kvctl.options import JSON_OPT
from kvctl.provision import rig
from kvctl.views.output import Output
from kvctl.views.rig import InstallReporter

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
    if json_out:
        out.emit_json(info.to_json())
        return
    ran = [s for s in info.steps if s.status == "ran"]
    verb = f"built ({len(ran)} steps ran)" if ran else "already complete"
    out.info(f"[bold green]rig {verb}[/bold green] in {info.total_s:.1f} s: "
             f"{escape(str(info.path))}")
    out.stdout.print(str(info.python), highlight=False)


@rig_app.command("python")
def python() -> None:
    """Print the rig's interpreter path (for scripts: `$(kvctl rig python) -m ...`)."""
    typer.echo(str(rig.rig_python()))


@rig_app.command("status")
def status(json_out: bool = JSON_OPT) -> None:
    """Show where the rig is, which steps are done, its size and its key inputs."""
    out = Output(json_mode=json_out)
    st = rig.rig_status()
    if json_out:
        out.emit_json(st)
        return
    table = Table(title=f"rig {st['path']}", title_justify="left")
    for col in ("step", "state", "seconds", "note"):
        table.add_column(col)
    colors = {"done": "green", "stale": "yellow", "missing": "red"}
    for s in st["steps"]:
        table.add_row(s["name"], f"[{colors[s['state']]}]{s['state']}[/]",
                      "" if s["seconds"] is None else f"{s['seconds']:.1f}",
                      escape(s["note"] or ""))
    out.stdout.print(table)
    state = "[green]installed[/green]" if st["installed"] else "[red]not installed[/red]"
    out.stdout.print(f"{state}, {st['size_bytes'] / 1e9:.2f} GB, python {st['python']}")
    if st["python_override"]:
        out.stdout.print(f"KVCTL_RIG_PYTHON overrides it: {st['python_override']}")


