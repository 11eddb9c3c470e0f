"""`kvctl verify`: send requests through P then D and prove the KV travelled."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvctl.errors import BadInput, ExitCode
from kvctl.verify.junit import write_verify_junit
from kvctl.verify.load_mode import LoadReport, generate_prompts, run_load
from kvctl.options import JSON_OPT
from kvctl.views.output import Output
from kvctl.verify.verifier import (CHECKS, DEFAULT_MAX_TOKENS, DEFAULT_PROMPTS, VerifyReport, check_prompts,
                          load_cluster_info, load_prompts_file, verify_cluster)


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)


def verify(
    name: str = typer.Option("default", "--name", help="Cluster name (see `kvctl status`)."),
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", help="A prompt; repeat for several."),
    prompts_file: Optional[Path] = typer.Option(
        None, "--prompts", help="File of prompts: a JSON list of strings, or one per line."),
    max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens", help="Tokens D (and the baseline) generate."),
    concurrency: int = typer.Option(1, "--concurrency", min=1, help="Clients sending requests at once (load mode "
                                                                    "when > 1)."),
    requests: Optional[int] = typer.Option(None, "--requests", min=1, help="Generate this many distinct prompts "
                                                                           "(load mode)."),
    json_out: bool = JSON_OPT,
    junit_xml: Optional[Path] = typer.Option(None, "--junit-xml", help="Also write JUnit XML here."),
) -> None:
    """Verify a running cluster: P sends KV, the store holds it, D skips its prefill, outputs match.

    Per prompt: tokenize on P, P with max_tokens=1, D with --max-tokens, and a
    baseline (P with --max-tokens). Exit 0 if every check passes, 1 if any fails.
    Load mode (--requests N and/or --concurrency C > 1): C clients at once, a
    failed request is counted instead of stopping the run, and the report adds
    throughput, p50/p99 latency of P and D, transfer bytes and every mismatch.
    """
    out = Output(json_mode=json_out)
    if prompt and prompts_file:
        raise BadInput("--prompt and --prompts both given", where="--prompt / --prompts",
                       fix="pass prompts one way: repeated --prompt TEXT, or --prompts FILE")
    if requests is not None and (prompt or prompts_file):
        raise BadInput("--requests generates its prompts; --prompt/--prompts give them",
                       where="--requests / --prompt / --prompts", fix="drop one of them")
    load_mode = requests is not None or concurrency > 1
    if requests is not None:
        prompts = generate_prompts(requests)
    elif prompts_file is not None:
        prompts = load_prompts_file(prompts_file)
    elif prompt:
        prompts = check_prompts(prompt)
    else:
        prompts = list(DEFAULT_PROMPTS)
    info = load_cluster_info(name)

    with Progress(TextColumn("[bold]verify[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=out.stderr, transient=True) as bar:
        task = bar.add_task(f"{name}", total=len(prompts))

        def progress(i: int, total: int, stage: str) -> None:
            if stage == "done":
                bar.advance(task)
            else:
                bar.update(task, description=f"{name}: request {i + 1}/{total} {stage}")

        if load_mode:
            result = run_load(info, prompts, max_tokens, concurrency, progress)
            report = result.verify
        else:
            result = report = verify_cluster(info, prompts, max_tokens, progress)

    if junit_xml is not None:
        write_verify_junit(report, junit_xml)
    if json_out:
        out.emit_json(result.to_json())
    elif isinstance(result, LoadReport):
        render_load(result, out.stdout)
    else:
        render_report(report, out.stdout)
    if not json_out and junit_xml is not None:
        out.info(f"JUnit XML written to {junit_xml}")
    if not result.passed:
        raise typer.Exit(int(ExitCode.CHECK_FAILED))


# Short column headers keep the table within 80 columns; the caption spells them out.
_SHORT = {"kv_send_logged": "send", "store_entry_written": "store", "decode_skipped_forward": "skip",
          "output_matches_baseline": "match"}


def render_report(report: VerifyReport, console: Console) -> None:
    """The request x check table, then the evidence of every failed check."""
    legend = "  ".join(f"{short}={name}" for name, short in _SHORT.items())
    table = Table(title=f"kvctl verify: cluster {report.cluster}", title_justify="left",
                  caption=legend, caption_justify="left", box=box.SIMPLE_HEAD,
                  collapse_padding=True, pad_edge=False)
    table.add_column("#", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column("key", min_width=8, no_wrap=True)
    for check in CHECKS:
        table.add_column(_SHORT.get(check, check), justify="center")
    table.add_column("P s", justify="right")
    table.add_column("D s", justify="right")
    table.add_column("KV bytes", justify="right", no_wrap=True)
    for i, r in enumerate(report.requests):
        marks = [Text("✓", style="green") if (c := r.check(n)) and c.passed else Text("✗", style="bold red")
                 for n in CHECKS]
        table.add_row(str(i + 1), str(r.prompt_tokens), r.key[:8] or "-", *marks,
                      _secs(r.prefill_latency_s), _secs(r.decode_latency_s),
                      f"{r.transfer_bytes:,}" if r.transfer_bytes is not None else "-")
    console.print(table)
    failed = [(i, c) for i, r in enumerate(report.requests) for c in r.checks if not c.passed]
    for i, c in failed:
        console.print(Text.assemble((f"✗ request {i + 1} {c.name}: ", "bold red"), c.evidence))
    verdict = (Text("PASSED", style="bold green") if report.passed
               else Text(f"FAILED ({len(failed)} failed checks)", style="bold red"))
    console.print(Text.assemble(verdict, f"  {len(report.requests)} requests, D max_tokens={report.max_tokens},"
                                         f" baseline: {report.baseline}"))


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
            if not c.passed:
                console.print(Text.assemble((f"✗ request {i + 1} {c.name}: ", "bold red"), c.evidence))
    failed = sum(load["failed_checks"].values())
    verdict = (Text("PASSED", style="bold green") if result.passed
               else Text(f"FAILED ({failed} failed checks)", style="bold red"))
    console.print(Text.assemble(verdict, f"  baseline: {result.verify.baseline}"))
