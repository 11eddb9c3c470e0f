"""Rig views: the install progress display, and installing the rig when a launch needs it."""

from __future__ import annotations

import os
import time

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from kvctl.errors import BadInput
from kvctl.provision import rig
from kvctl.views.output import Output


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
        with InstallReporter(out.stderr) as reporter:
            rig.install(progress=reporter)


class InstallReporter:
    """Turns rig.install's StepEvents into a live view (a terminal) or plain lines (logs)."""

    def __init__(self, console: Console):
        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                 TimeElapsedColumn(), console=console)
        self.task: TaskID | None = None
        self.current = ""  # "[i/n] title" of the running step
        self.started = time.monotonic()

    def __enter__(self) -> "InstallReporter":
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
