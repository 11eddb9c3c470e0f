"""Scenario views: the list of shipped scenarios, the live run display, the run's tables and verdict."""

from __future__ import annotations

import time
from typing import Any, ClassVar

from rich import box
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvctl.cluster.lifecycle import LaunchProgress
from kvctl.scenario.runner import PhaseResult, ScenarioProgress, ScenarioReport, SecondRoundReport
from kvctl.views.cluster import LaunchDisplay
from kvctl.views.output import Output, human_size
from kvctl.views.store import render_store_report
from kvctl.views.verify import render_answers, render_eval, render_verify_report


def render_scenario_list(rows: list[dict[str, Any]], out: Output) -> None:
    """One line per scenario (name, runtime, model, runs here or what is missing), its description under it."""
    # A wide table does not fit 80 columns.
    width = {k: max([len(k)] + [len(str(r.get(k) or "?")) for r in rows])
             for k in ("name", "shape", "runtime", "model")}
    out.stdout.print("  ".join(k.upper().ljust(width[k]) for k in width) + "  RUNS HERE", style="bold",
                     highlight=False)
    for r in rows:
        runs = ("[green]yes[/green]" if r["runnable"] else
                "[red]invalid[/red]" if not r["valid"] else
                f"[yellow]no[/yellow] (missing {escape(', '.join(r.get('missing') or [str(r['runtime'])]))})")
        cells = "  ".join(escape(str(r.get(k) or "?")).ljust(width[k]) for k in width)
        out.stdout.print(f"{cells}  {runs}", highlight=False)
        note = r.get("description") or r["note"]
        out.stdout.print(f"  [dim]{escape(note)}[/dim]", highlight=False)
        if r["valid"] and not r["runnable"] and r.get("description"):
            out.stdout.print(f"  [yellow]not here:[/yellow] [dim]{escape(r['note'])}[/dim]", highlight=False)
    out.info("run one with `kvctl scenario run NAME`; check one with `kvctl validate NAME`")


def render_run(report: ScenarioReport, out: Output) -> None:
    """The verify table, the store table and the final PASS/FAIL line."""
    if report.verify is not None:
        render_verify_report(report.verify, out.stdout)
        render_answers(report.verify, out.stdout)
    if report.eval is not None:
        render_eval(report.eval, out.stdout)
    if report.second_round is not None:
        render_second_round(report.second_round, out)
    if report.store is not None:
        render_store_report(report.store, out)
        if not report.store.root.exists():
            out.info("(the store went with the cluster at teardown; --keep keeps it)")
    if report.kept:
        out.info(f"kept store and logs: {report.kept}")
    if report.error is not None:
        out.error(report.error)
    out.stdout.print(verdict(report), highlight=False)


def render_second_round(rnd: SecondRoundReport, out: Output) -> None:
    """The second round's verify table, then what LMCache served and each prompt's TTFT, both rounds."""
    render_verify_report(rnd.verify, out.stdout)
    doc = rnd.to_json()
    table = Table(title=f"second round after restarting {', '.join(rnd.restarted)} ({rnd.restart_s:.1f} s)",
                  title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("tokens", "P TTFT round 1 s", "P TTFT round 2 s", "ratio"):
        table.add_column(col, justify="right")
    for row in doc["ttft"]:
        table.add_row(str(row["prompt_tokens"]), _s(row["first_round_s"]), _s(row["second_round_s"]),
                      _s(row["ratio"]))
    out.stdout.print(table)
    lm = doc["lmcache"]
    out.stdout.print(f"LMCache retrieved tokens {lm['retrieved_tokens']['before']} -> {lm['retrieved_tokens']['after']}, "
                     f"stored {lm['stored_tokens']['before']} -> {lm['stored_tokens']['after']}; outputs "
                     f"{'unchanged' if rnd.outputs_unchanged else 'CHANGED'}; TTFT round 2 / round 1 (sum): "
                     f"{_s(doc['ttft_ratio_total'])}", highlight=False)


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def verdict(report: ScenarioReport) -> str:
    """`PASS name: N requests x C checks, store ...; wall` or `FAIL name (exit E): why; wall`."""
    wall = f"wall {report.wall_s:.1f} s"
    if report.passed:
        v, s = report.verify, report.store
        assert v is not None and s is not None
        checks = len(report.expected_checks)
        return (f"[bold green]PASS[/bold green] {report.scenario}: {len(v.requests)} requests x {checks} checks, "
                f"store {len(s.entries)} entries ({human_size(s.total_bytes)})"
                + (f"; eval {report.eval.name} P/D {report.eval.pd_accuracy:.0%} vs baseline "
                   f"{report.eval.baseline_accuracy:.0%}" if report.eval is not None else "")
                + f"; {wall}")
    failed = [p for p in report.phases.values() if p.status in ("failed", "interrupted")]
    why = "; ".join(f"{p.name}: {p.detail}" for p in failed) or "not all phases ran"
    return f"[bold red]FAIL[/bold red] {report.scenario} (exit {report.exit_code}): {escape(why)}; {wall}"


class RunDisplay(ScenarioProgress):
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

    def __enter__(self) -> RunDisplay:
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
        if stage in ("prefill", "endpoint"):  # a request's first stage, direct or through the router
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
