"""Rig views: the install progress display, the install result, the rig's status, and
installing the rig when a launch needs it."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvctl.errors import BadInput
from kvctl.provision import extras, rig
from kvctl.provision.overlay import Overlay
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


def render_installed(out: Output, info: rig.RigInfo, done: list[extras.ExtraInfo] = ()) -> None:
    """`kvctl rig install`: what ran (stderr) and the rig's python (stdout), or the JSON
    (with "extras": each extra installed, when --extra asked for some)."""
    if out.json_mode:
        out.emit_json(info.to_json() | ({"extras": [e.to_json() for e in done]} if done else {}))
        return
    for what, built in (("rig", info), *((f"extra {e.name}", e) for e in done)):
        ran = [s for s in built.steps if s.status == "ran"]
        verb = f"built ({len(ran)} steps ran)" if ran else "already complete"
        out.info(f"[bold green]{what} {verb}[/bold green] in {built.total_s:.1f} s: "
                 f"{escape(str(built.path))}")
    out.stdout.print(str(info.python), highlight=False)


def render_rig_status(out: Output, st: dict) -> None:
    """`kvctl rig status`: each step's state, size, interpreter and the overlay, or the JSON."""
    if out.json_mode:
        out.emit_json(st)
        return
    table = Table(title=f"rig {st['path']} (engine {st['engine']})", title_justify="left")
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
    inputs = st["inputs"]
    pins = [*inputs["torch"], *inputs["vllm"]]
    out.stdout.print(f"inputs: {' '.join(pins)}, {len(inputs['requirements'])} requirements, "
                     f"python {inputs['python']} (key {st['key']})", highlight=False)
    for ex in st.get("extras", []):
        if ex["installed"]:
            verified = next((s["note"] for s in ex["steps"] if s["name"] == "verify"), "")
            out.stdout.print(f"extra {ex['name']}: [green]installed[/green], {ex['size_bytes'] / 1e6:.0f} MB "
                             f"({escape(ex['pins'])}; key {ex['key']}): {escape(ex['site'])}",
                             highlight=False)
            out.stdout.print(f"  verified: {escape(verified)}", highlight=False)
        else:
            todo = ", ".join(s["name"] for s in ex["steps"] if s["state"] != "done")
            out.stdout.print(f"extra {ex['name']}: [yellow]not installed[/yellow] (steps not done: {todo}); "
                             f"`{escape(ex['install'])}` installs {escape(ex['pins'])}", highlight=False)
        out.stdout.print(f"  for {', '.join(ex['connectors'])} ({escape(ex['summary'])})", highlight=False)
    ov = st["overlay"]
    built = "[green]built[/green]" if ov["built"] else "[yellow]built at the next launch[/yellow]"
    out.stdout.print(f"overlay {ov['key']} ({built}, kvctl {ov['version']}, {ov['files']} files): "
                     f"{escape(ov['path'])}", highlight=False)
    for name, where in ov["packages"].items():
        out.stdout.print(f"  {name} from {escape(where)}", highlight=False)
    for line in ov["entry_points"]:
        out.stdout.print(f"  entry point {escape(line)}", highlight=False)
    others = [k for k in ov["overlays"] if k != ov["key"]]
    if others:
        out.stdout.print(f"  {len(others)} other overlay(s) in {escape(str(Path(ov['path']).parent))}",
                         highlight=False)


def render_overlay(out: Output, built: Overlay, status: dict, engine: str | None, python: str | None) -> None:
    """`kvctl rig overlay`: the site directory alone on stdout (for `$(...)`), what happened on
    stderr; or the JSON: the overlay's status, `built_now`, `seconds`, and `engine`/`python`."""
    if out.json_mode:
        out.emit_json(status | {"built_now": built.built, "seconds": round(built.seconds, 3),
                                "engine": engine, "python": python})
        return
    what = f"built in {built.seconds:.2f} s" if built.built else "already built"
    out.info(f"overlay {built.key} ({what}, kvctl {status['version']}, {status['files']} files)")
    if engine is not None:
        out.info(f"rig {engine}: {python}" if python else f"rig {engine}: not installed (`kvctl rig install "
                                                           f"--engine {engine}`)")
    out.stdout.print(str(built.site), highlight=False, markup=False)


def render_layered_venv(out: Output, venv: rig.LayeredVenv) -> None:
    """`kvctl rig venv`: what happened (stderr) and the venv's python (stdout), or the JSON."""
    if out.json_mode:
        out.emit_json(venv.to_json())
        return
    what = {"created": "created", "relinked": "now layered on", "unchanged": "already layered on"}
    out.info(f"{escape(str(venv.path))}: {what[venv.action]} the rig at {escape(venv.rig_site)}")
    out.stdout.print(str(venv.python), highlight=False)
