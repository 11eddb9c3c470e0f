"""`kvctl rig`: install, locate and inspect the CPU rig (vLLM 0.9.2 CPU + this project)."""

from __future__ import annotations

import os
import time

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvctl.provision import rig
from kvctl.errors import BadInput
from kvctl.options import JSON_OPT
from kvctl.views.output import Output

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
    with _InstallReporter(out.stderr) as reporter:
        info = rig.install(progress=reporter)
    if json_out:
        out.emit_json(info.to_json())
        return
    ran = [s for s in info.steps if s.status == "ran"]
    verb = f"built ({len(ran)} steps ran)" if ran else "already complete"
    out.info(f"[bold green]rig {verb}[/bold green] in {info.total_s:.1f} s: "
             f"{escape(str(info.path))}")
    out.stdout.print(str(info.python), highlight=False)


def ensure_rig(out: Output) -> None:
    """Install the CPU rig first when it is missing (a local launch needs it).

    A KVCTL_RIG_PYTHON that points nowhere is the user's to fix: BadInput.
    """
    try:
        rig.rig_python()
    except BadInput:
        if os.environ.get("KVCTL_RIG_PYTHON"):
            raise
        out.info("the CPU rig is not installed: running `kvctl rig install` first "
                 "(once; about 4 minutes and 7 GB)")
        with _InstallReporter(out.stderr) as reporter:
            rig.install(progress=reporter)


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


class _InstallReporter:
    """Turns rig.install's StepEvents into a live view (a terminal) or plain lines (logs)."""

    def __init__(self, console: Console):
        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                 TimeElapsedColumn(), console=console)
        self.task: TaskID | None = None
        self.current = ""  # "[i/n] title" of the running step
        self.started = time.monotonic()

    def __enter__(self) -> "_InstallReporter":
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.progress.stop()

    def _print(self, text: str) -> None:
        self.progress.console.print(text, highlight=False)

    def __call__(self, e: rig.StepEvent) -> None:
        pos = f"[{e.index}/{e.total}]"
        if e.state == "log":
            self._print(f"[dim]command output goes to {escape(e.note)}[/dim]")
        elif e.state == "waiting":
            self._print(f"[yellow]waiting:[/yellow] {escape(e.note)}")
        elif e.state == "skipped":
            self._print(f"[dim]{pos} {e.title}: already done[/dim]")
        elif e.state == "start":
            self.current = f"{pos} {e.title}"
            if self.live:
                self.task = self.progress.add_task(self.current, total=None)
            else:
                self._print(f"{self.current} ...")
        elif e.state == "output" and self.live and self.task is not None:
            # The latest line of pip's output, minus this machine's index warnings.
            if e.note.strip() and not e.note.startswith("WARNING:"):
                self.progress.update(self.task, description=(
                    f"{self.current} [dim]{escape(e.note.strip()[:70])}[/dim]"))
        elif e.state in ("done", "failed"):
            mark = "[green]done[/green]" if e.state == "done" else "[red]failed[/red]"
            if self.live and self.task is not None:
                self.progress.remove_task(self.task)
                self.progress.refresh()  # else the next print redraws the finished step
                self.task = None
            note = f" [dim]({escape(e.note)})[/dim]" if e.state == "done" and e.note else ""
            self._print(f"{pos} {e.title}: {mark} in {e.seconds:.1f} s{note}")
