"""`kvctl scenario list` and `kvctl scenario run`: declarative 1P1D runs, always torn down."""

from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from kvctl.cluster.lifecycle import LaunchProgress
from kvctl.errors import BadInput
from kvctl.options import JSON_OPT
from kvctl.runtime import select_runtime
from kvctl.scenario.runner import (
    PhaseResult,
    ScenarioProgress,
    ScenarioReport,
    run_scenario,
    write_scenario_junit,
)
from kvctl.scenario.schema import list_scenarios, load_scenario, scenario_file
from kvctl.views.cluster import LaunchDisplay
from kvctl.views.output import Output, human_size
from kvctl.views.rig import ensure_rig
from kvctl.views.store import render_store_report as render_store
from kvctl.views.verify import render_verify_report as render_verify

scenario_app = typer.Typer(help="Run declarative scenarios: launch, verify, inspect the store, tear down.",
                           no_args_is_help=True)


def register(app: typer.Typer) -> None:
    scenario_app.command("list")(list_cmd)
    scenario_app.command("run")(run_cmd)
    app.add_typer(scenario_app, name="scenario")


def list_cmd(json_out: bool = JSON_OPT) -> None:
    """List the shipped scenarios and whether this machine can run them."""
    out = Output(json_mode=json_out)
    rows = [_describe(path) for path in list_scenarios()]
    if json_out:
        out.emit_json({"scenarios": rows})
        return
    # One line per scenario, its description under it: a wide table does not fit 80 columns.
    width = {k: max([len(k)] + [len(str(r.get(k) or "?")) for r in rows]) for k in ("name", "runtime", "model")}
    out.stdout.print("  ".join(k.upper().ljust(width[k]) for k in width) + "  RUNS HERE", style="bold",
                     highlight=False)
    for r in rows:
        runs = ("[green]yes[/green]" if r["runnable"] else
                "[red]invalid[/red]" if not r["valid"] else f"[yellow]no[/yellow] (needs {r['runtime']})")
        cells = "  ".join(escape(str(r.get(k) or "?")).ljust(width[k]) for k in width)
        out.stdout.print(f"{cells}  {runs}", highlight=False)
        note = r.get("description") or r["note"]
        out.stdout.print(f"  [dim]{escape(note)}[/dim]", highlight=False)
    out.info("run one with `kvctl scenario run NAME`; check one with `kvctl validate NAME`")


def _describe(path: Path) -> dict:
    row: dict = {"name": path.stem, "file": str(path)}
    try:
        s = load_scenario(str(path))
    except BadInput as e:
        return {**row, "valid": False, "runnable": False, "note": f"invalid: {e.what}"}
    row.update(name=s.name, valid=True, runtime=s.runtime, model=s.model, prompts=len(s.prompts),
               description=" ".join(s.description.split()))
    try:
        runtime, why = select_runtime(s.runtime)
        row.update(runnable=True, note=f"{runtime}: {why}")
    except BadInput as e:
        row.update(runnable=False, note=e.what)
    return row


def run_cmd(
    target: str = typer.Argument(..., metavar="NAME|FILE", help="A shipped scenario's name or a YAML file."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (the report) on stdout."),
    junit_xml: Path | None = typer.Option(None, "--junit-xml", help="Also write JUnit XML here."),
    keep: bool = typer.Option(False, "--keep", help="Keep the store and server logs (servers still stop)."),
) -> None:
    """Launch the scenario's cluster, verify every prompt, inspect the store, tear down.

    Teardown always runs. Exit 0 when everything passes, 1 when a check or the
    store check fails, 2 for an invalid scenario (nothing is started), 3 when
    the cluster cannot start, 130 on Ctrl-C.
    """
    out = Output(json_mode=json_out)
    if junit_xml is not None and not junit_xml.expanduser().absolute().parent.is_dir():
        raise BadInput(f"the directory of {junit_xml} does not exist", where="--junit-xml",
                       fix="pass a path in an existing directory")
    source = str(scenario_file(target))
    scenario = load_scenario(target)
    out.info(f"scenario [bold]{scenario.name}[/bold] ({source})")
    if scenario.runtime == "local":
        ensure_rig(out)
    with _RunDisplay(out) as display:
        report = run_scenario(scenario, display, keep=keep, source=source)
    if junit_xml is not None:
        write_scenario_junit(report, junit_xml)
    if junit_xml is not None:
        out.info(f"JUnit XML written to {junit_xml}")
    if json_out:
        if report.error is not None:
            Output(stderr=out.stderr).error(report.error)  # human form: stdout holds the report
        out.emit_json(report.to_json())
    else:
        render_run(report, out)
    if report.exit_code:
        raise typer.Exit(report.exit_code)


def render_run(report: ScenarioReport, out: Output) -> None:
    """The verify table, the store table and the final PASS/FAIL line."""
    if report.verify is not None:
        render_verify(report.verify, out.stdout)
    if report.store is not None:
        render_store(report.store, out)
        if not report.store.root.exists():
            out.info("(the store went with the cluster at teardown; --keep keeps it)")
    if report.kept:
        out.info(f"kept store and logs: {report.kept}")
    if report.error is not None:
        out.error(report.error)
    out.stdout.print(verdict(report), highlight=False)


def verdict(report: ScenarioReport) -> str:
    wall = f"wall {report.wall_s:.1f} s"
    if report.passed:
        v, s = report.verify, report.store
        assert v is not None and s is not None
        checks = len(report.expected_checks)
        return (f"[bold green]PASS[/bold green] {report.scenario}: {len(v.requests)} requests x {checks} checks, "
                f"store {len(s.entries)} entries ({human_size(s.total_bytes)}); {wall}")
    failed = [p for p in report.phases.values() if p.status in ("failed", "interrupted")]
    why = "; ".join(f"{p.name}: {p.detail}" for p in failed) or "not all phases ran"
    return f"[bold red]FAIL[/bold red] {report.scenario} (exit {report.exit_code}): {escape(why)}; {wall}"


class _RunDisplay(ScenarioProgress):
    """Phase lines on stderr; the live launch table and a request bar on a terminal."""

    _MARKS: ClassVar[dict[str, str]] = {"passed": "[green]✓[/green]", "failed": "[red]✗[/red]",
                                        "interrupted": "[yellow]![/yellow]"}

    def __init__(self, out: Output):
        self.out = out
        self.terminal = out.stderr.is_terminal
        self.launch_display: LaunchDisplay | None = None
        self.bar: Progress | None = None
        self.task = None
        self.request_t0 = 0.0

    def __enter__(self) -> _RunDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        if self.launch_display is not None:
            self.launch_display.__exit__(None, None, None)
            self.launch_display = None
        if self.bar is not None:
            self.bar.stop()
            self.bar, self.task = None, None

    def phase_started(self, phase: PhaseResult) -> None:
        if phase.name == "launch":
            self.launch_display = LaunchDisplay(self.out).__enter__()
        elif phase.name == "verify" and self.terminal:
            self.bar = Progress(TextColumn("[bold]verify[/bold] {task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(), console=self.out.stderr,
                                transient=True)
            self.bar.start()
        elif phase.name == "down":
            self.out.info("tearing down...")

    def phase_finished(self, phase: PhaseResult) -> None:
        self._close()
        mark = self._MARKS.get(phase.status, "-")
        detail = f": {escape(phase.detail)}" if phase.detail else ""
        self.out.info(f"{mark} {phase.name} {phase.status} ({phase.seconds or 0:.1f} s){detail}")

    def launch(self, progress: LaunchProgress) -> None:
        if self.launch_display is not None:
            self.launch_display(progress)

    def request(self, index: int, total: int, stage: str) -> None:
        if stage == "prefill":
            self.request_t0 = time.monotonic()
        if self.bar is not None:
            if self.task is None:
                self.task = self.bar.add_task("", total=total)
            if stage == "done":
                self.bar.advance(self.task)
            else:
                self.bar.update(self.task, description=f"request {index + 1}/{total} {stage}")
        elif stage == "done":
            self.out.info(f"  request {index + 1}/{total} done ({time.monotonic() - self.request_t0:.1f} s)")

