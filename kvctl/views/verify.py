"""Verify views: the request progress bar, the request x check table and the load figures."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvctl.verify.checks import CHECKS, OFFLOAD_CHECK, CheckResult
from kvctl.verify.evals import EvalReport
from kvctl.verify.load_mode import LoadReport
from kvctl.verify.report import (FROM_HEADERS, FROM_LOGS, PART_LOAD, PART_OFFLOAD, PART_TRANSFER, PARTS,
                                 REQUIRE_OBSERVABLE, ChildEvidence, VerifyReport)
from kvctl.verify.verifier import Progress as RequestProgress
from kvctl.views.output import Output

# Short column headers keep the table within 80 columns; the caption spells them out.
_SHORT = {**dict(zip(CHECKS, ("send", "store", "skip", "match"), strict=True)), OFFLOAD_CHECK: "offload"}


@contextlib.contextmanager
def request_bar(out: Output, label: str, total: int) -> Iterator[RequestProgress]:
    """A transient bar on stderr while requests run; yields the driver's progress callback."""
    with Progress(TextColumn("[bold]verify[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=out.stderr, transient=True) as bar:
        task = bar.add_task(label, total=total)

        def progress(i: int, n: int, stage: str) -> None:
            if stage == "done":
                bar.advance(task)
            else:
                bar.update(task, description=f"{label}: request {i + 1}/{n} {stage}")

        yield progress


def _mark(c: CheckResult | None) -> Text:
    if c is None or (not c.passed and c.observable):
        return Text("✗", style="bold red")
    return Text("✓", style="green") if c.passed else Text("?", style="yellow")


def _render_not_observable(report: VerifyReport, console: Console) -> int:
    """One line per check that was not observable (with the reason); returns how many checks were not."""
    reasons = report.not_observable()
    for name, why in reasons.items():
        console.print(Text.assemble(("? ", "yellow"), (f"{name} not observable: ", "yellow"), why))
    return sum(len(r.not_observable) for r in report.requests)


def _verdict(report: VerifyReport, passed: bool, failed: int, unseen: int) -> Text:
    note = ""
    if unseen:
        note = (f" ({unseen} checks not observable, allowed by --require observable)"
                if report.require == REQUIRE_OBSERVABLE
                else f" ({unseen} checks not observable; --require observable would allow them)")
    if passed:
        return Text.assemble(("PASSED", "bold green"), note)
    run = len(report.run_failures())
    why = f"{failed} failed checks" + (f", {run} instance{'s' if run != 1 else ''} never served" if run else "")
    return Text.assemble((f"FAILED ({why})", "bold red"), note)


def _routed(report: VerifyReport) -> bool:
    """Whether requests went through a router to instances other than a plain `prefill` and `decode`
    (a pool's members, or an attached cluster's names): then who served what is worth showing."""
    return any(r.instances_from in (FROM_HEADERS, FROM_LOGS)
               and (r.prefill_instance != "prefill" or r.decode_instance != "decode") for r in report.requests)


def _short(name: str | None, role: str) -> str:
    """prefill-1 -> P1, decode-0 -> D0 (a pool member); another name as it is; ? when unknown."""
    if name is None:
        return "?"
    index = name.removeprefix(f"{role}-")
    return f"{role[0].upper()}{index}" if index != name and index.isdigit() else name


def render_instances(report: VerifyReport, console: Console) -> None:
    """How many requests each instance served; each run failure (an instance that never did); the notes."""
    served = report.served()
    if _routed(report) and served:
        cells = ", ".join(f"{name} {v['served']}" for name, v in served.items())
        console.print(Text.assemble(("requests served: ", "bold"), cells))
    for f in report.run_failures():
        console.print(Text.assemble((f"✗ {f.check} {f.instance}: ", "bold red"), f.reason))
    for note in report.instance_notes():
        console.print(Text.assemble(("note: ", "yellow"), note))


def render_verify_report(report: VerifyReport, console: Console) -> None:
    """The request x check table, then the evidence of every failed check and the unobservable ones."""
    # the offload child's column only when a request has its check (a prefill with LMCache)
    shown = list(CHECKS) + ([OFFLOAD_CHECK] if any(r.check(OFFLOAD_CHECK) for r in report.requests) else [])
    legend = "  ".join(f"{_SHORT[name]}={name}" for name in shown)
    table = Table(title=f"kvctl verify: cluster {report.cluster}", title_justify="left",
                  caption=legend, caption_justify="left", box=box.SIMPLE_HEAD,
                  collapse_padding=True, pad_edge=False)
    table.add_column("#", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column("key", min_width=8, no_wrap=True)
    for check in shown:
        table.add_column(_SHORT.get(check, check), justify="center")
    table.add_column("P s", justify="right")
    table.add_column("D s", justify="right")
    table.add_column("KV bytes", justify="right", no_wrap=True)
    # which P and which D served each request through the router (a pool's: P1->D0)
    routed = _routed(report)
    if routed:
        table.add_column("P->D", no_wrap=True)
        legend += "  P->D=prefill-N, decode-M that served it"
        table.caption = legend
    for i, r in enumerate(report.requests):
        marks = [_mark(r.check(n)) for n in shown]
        served = ((f"{_short(r.prefill_instance, 'prefill')}->{_short(r.decode_instance, 'decode')}",)
                  if routed else ())
        table.add_row(str(i + 1), str(r.prompt_tokens), r.key[:8] or "-", *marks,
                      _secs(r.prefill_latency_s), _secs(r.decode_latency_s),
                      f"{r.transfer_bytes:,}" if r.transfer_bytes is not None else "-", *served)
    console.print(table)
    render_children(report, console)
    render_instances(report, console)
    failed = [(i, c) for i, r in enumerate(report.requests) for c in r.checks if not c.passed and c.observable]
    for i, c in failed:
        console.print(Text.assemble((f"✗ request {i + 1} {c.name}: ", "bold red"), c.evidence))
    unseen = _render_not_observable(report, console)
    verdict = _verdict(report, report.passed, len(failed), unseen)
    path = f"through the endpoint {report.endpoint}" if report.endpoint else "to P, then D directly"
    console.print(Text.assemble(verdict, f"  {len(report.requests)} requests {path}, D max_tokens={report.max_tokens},"
                                         f" baseline: {report.baseline}"))


def _part_header(part: str, report: VerifyReport) -> str:
    """`P transfer: FSConnector (child 0)`: the part and the connector its column shows."""
    c = next((c for r in report.requests for c in r.children if c.part == part), None)
    side = "D" if part == PART_LOAD else "P"
    if c is None:
        return f"{side} {part}"
    return f"{side} {part}: {c.connector}" + (f" (child {c.child})" if c.child is not None else "")


def _part_cell(c: ChildEvidence | None) -> str:
    if c is None or c.tokens is None:
        return "-"
    if c.part == PART_TRANSFER:
        return f"sent {c.tokens:,}"
    if c.part == PART_OFFLOAD and "saved" in c.detail:  # an FSConnector offload child
        return f"saved {c.tokens:,}"
    if c.part == PART_OFFLOAD:
        return f"stored {c.detail.get('stored') or 0:,} retrieved {c.detail.get('retrieved') or 0:,}"
    computed = c.detail.get("computed")
    return f"loaded {c.tokens:,}" + (f" computed {computed:,}" if computed is not None else "")


def render_children(report: VerifyReport, console: Console) -> None:
    """Each connector's own evidence per request (a multi connector cluster's; nothing otherwise)."""
    if not any(r.children for r in report.requests):
        return
    parts = [p for p in PARTS if any(r.child(p) for r in report.requests)]
    table = Table(title="each connector's evidence (tokens, from its own lines)", title_justify="left",
                  caption=(f"{PART_OFFLOAD}: the LMCache server's Stored/Retrieved lines since the request "
                           "(counted by delta)" if any("stored" in c.detail for r in report.requests for c in r.children
                                                      if c.part == PART_OFFLOAD) else None),
                  caption_justify="left", box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    table.add_column("#", justify="right")
    for part in parts:
        table.add_column(_part_header(part, report), justify="right")
    for i, r in enumerate(report.requests):
        table.add_row(str(i + 1), *[_part_cell(r.child(p)) for p in parts])
    console.print(table)


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def render_load(result: LoadReport, console: Console) -> None:
    """The load figures, then the evidence of every failed check (each mismatch, each error)."""
    load = result.load.to_json()
    table = Table(title=f"kvctl verify (load): cluster {result.verify.cluster}", title_justify="left",
                  box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False, show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    p, d = load["prefill_latency_s"], load["decode_latency_s"]
    rows = (
        ("requests / concurrency", f"{load['requests']} / {load['concurrency']}"),
        ("completed, errors", f"{load['completed']}, {load['num_errors']}"),
        ("wall time", f"{load['wall_s']:.1f} s"),
        ("throughput", f"{load['throughput_rps']:.2f} req/s ({load['prompt_tokens_per_s']:.0f} prompt tok/s)"),
        ("P latency p50 / p99", f"{_secs(p['p50'])} / {_secs(p['p99'])} s"),
        (f"D latency p50 / p99 ({result.verify.max_tokens} tokens)", f"{_secs(d['p50'])} / {_secs(d['p99'])} s"),
        ("KV bytes transferred", f"{load['transfer_bytes']:,}"),
        ("mismatches", str(load["num_mismatches"])),
    )
    for what, value in rows:
        table.add_row(what, value)
    console.print(table)
    for i, r in enumerate(result.verify.requests):
        for c in r.checks:
            if not c.passed and c.observable:
                console.print(Text.assemble((f"✗ request {i + 1} {c.name}: ", "bold red"), c.evidence))
    render_instances(result.verify, console)
    unseen = _render_not_observable(result.verify, console)
    failed = sum(load["failed_checks"].values())
    verdict = _verdict(result.verify, result.passed, failed, unseen)
    console.print(Text.assemble(verdict, f"  baseline: {result.verify.baseline}"))


def render_answers(report: VerifyReport, console: Console, width: int = 100) -> None:
    """Each prompt and D's answer on one line (cut to `width`): what the model said."""
    console.print(Text("answers (D, through the cluster):", style="bold"))
    for i, r in enumerate(report.requests):
        prompt = " ".join(r.prompt.split())
        answer = " ".join(r.decode_output.split())
        line = f"{prompt if len(prompt) <= 48 else prompt[:45] + '...'} -> {answer}"
        console.print(Text(f" {i + 1}  " + (line if len(line) <= width else line[:width - 3] + "...")))


def render_eval(scored: EvalReport, console: Console) -> None:
    """The eval set item by item (expected, D's and the baseline's verdicts), then the gate's verdict."""
    table = Table(title=f"kvctl verify --eval {scored.name}", title_justify="left", box=box.SIMPLE_HEAD,
                  collapse_padding=True, pad_edge=False)
    for col in ("item", "expected", "P/D", "baseline", "P/D answer"):
        table.add_column(col, no_wrap=col != "P/D answer")
    for item in scored.items:
        answer = " ".join(item.pd_output.split())
        table.add_row(item.id, "/".join(item.expected), _ok(item.pd_correct), _ok(item.baseline_correct),
                      answer if len(answer) <= 60 else answer[:57] + "...")
    console.print(table)
    style = "bold green" if scored.passed else "bold red"
    console.print(Text.assemble(("PASSED  " if scored.passed else "FAILED  ", style), scored.verdict()))


def _ok(correct: bool) -> Text:
    return Text("✓", style="green") if correct else Text("✗", style="red")
