"""Store views: inspect-store's table, what `store check --fix` and `store prune` did.

Every name shown comes from a directory listing and may be anything (markup
characters, bytes that are not UTF-8): `_name` makes it printable and inert.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich import box
from rich.markup import escape
from rich.table import Table

from connectors.store.eviction import EvictionReport
from kvctl.store.doctor import DoctorReport
from kvctl.store.inspect import FixResult, StoreReport
from kvctl.views.output import Output, human_size


def _when(ts: float | None) -> str:
    """Time of day for today's entries, the date for older ones."""
    if not ts:
        return "-"
    try:
        same_day = time.localtime(ts)[:3] == time.localtime()[:3]
        return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d", time.localtime(ts))
    except (OverflowError, OSError, ValueError):
        return "?"


def _name(path: Path | str) -> str:
    """A file name as rich may print it: undecodable bytes as \\xNN, markup escaped."""
    text = str(path.name if isinstance(path, Path) else path)
    return escape(text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"))


_SIGNATURE = {"verified": "[green]verified[/green]", "signed": "signed", "unsigned": "[yellow]unsigned[/yellow]",
              "bad signature": "[red]bad signature[/red]"}


def render_store_report(report: StoreReport, out: Output) -> None:
    table = Table(title=f"FS store {_name(str(report.root))}", title_justify="left", box=box.SIMPLE_HEAD,
                  collapse_padding=True, pad_edge=False)
    right = {"justify": "right"}
    for col, kw in (("key", {"no_wrap": True}), ("tokens", right), ("layers", right), ("kv heads", right),
                    ("head size", right), ("dtype", {}), ("bytes", {**right, "no_wrap": True}),
                    ("created", {"no_wrap": True}), ("signature", {"no_wrap": True}), ("valid", {"no_wrap": True})):
        table.add_column(col, **kw)
    for e in report.entries:
        ident = e.identity
        valid = ("[yellow]unchecked[/yellow]" if e.unchecked else
                 {True: "[green]yes[/green]", False: "[red]NO[/red]", None: "[dim]unread[/dim]"}[e.valid])
        table.add_row(e.key[:10] + "…", str(e.num_tokens) if ident else "?",
                      str(ident.num_layers) if ident else "?", str(ident.kv_heads) if ident else "?",
                      str(ident.head_size) if ident else "?", escape(str(ident.dtype)) if ident else "?",
                      human_size(e.bytes), _when(e.created), _SIGNATURE.get(e.signature, "?"), valid)
    out.stdout.print(table)
    for e in report.invalid:
        out.stdout.print(f"[red]invalid[/red] {_name(e.path)}: {escape(e.error or '')}", highlight=False)
    for e in report.unchecked:
        out.stdout.print(f"[yellow]unchecked[/yellow] {_name(e.path)}: {escape(e.error or '')}", highlight=False)
    for t in report.temp_files:
        out.stdout.print(f"[yellow]temp leftover[/yellow] {_name(t.path)} ({human_size(t.bytes)}, "
                         f"{t.age_s:.0f}s old)", highlight=False)
    stale = {m.path for m in report.stale_pending}
    for m in report.pending:
        what = "[yellow]stale pending marker[/yellow]" if m.path in stale else "pending save"
        out.stdout.print(f"{what} {_name(m.path)} ({m.age_s:.0f}s old)", highlight=False)
    for f in report.foreign_files:
        kind = "foreign dir" if f.is_dir else "foreign file"
        size = "" if f.is_dir else f" ({human_size(f.bytes)})"
        out.stdout.print(f"[yellow]{kind}[/yellow] {_name(f.path)}{size}", highlight=False)
    valid = sum(1 for e in report.entries if e.valid)
    unchecked = f", {len(report.unchecked)} unchecked" if report.unchecked else ""
    checked = f", {valid} valid, {len(report.invalid)} invalid{unchecked}" if report.verified else (
        f", {len(report.invalid)} invalid{unchecked} (add --verify to check data)")
    n = len(report.entries)
    out.stdout.print(f"{n} entr{'y' if n == 1 else 'ies'}, {human_size(report.total_bytes)}{checked}; "
                     f"{len(report.temp_files)} temp, {len(report.pending)} pending, "
                     f"{len(report.foreign_files)} foreign", highlight=False)


def render_fix(fixed: FixResult, out: Output) -> None:
    for path, reason in fixed.removed:
        out.stdout.print(f"[green]removed[/green] {_name(path)}: {escape(reason)}", highlight=False)
    for path, reason in fixed.kept:
        out.stdout.print(f"[dim]kept[/dim] {_name(path)}: {escape(reason)}", highlight=False)


def render_check_verdict(report: StoreReport, fixed: bool, out: Output) -> None:
    """The last line of `store check`: OK, or what remains wrong."""
    if report.problems == 0:
        out.stdout.print("[green]store OK[/green]")
        return
    n = len(report.invalid)
    parts = [f"{n} invalid entr{'y' if n == 1 else 'ies'}", f"{len(report.temp_files)} temp file(s)"]
    if report.stale_pending:
        parts.append(f"{len(report.stale_pending)} stale pending marker(s)")
    if report.unchecked:
        parts.append(f"{len(report.unchecked)} unchecked (not readable by this user)")
    fixable = report.invalid or report.temp_files or report.stale_pending
    hint = "" if fixed or not fixable else " (kvctl store check --fix removes them)"
    out.stdout.print(f"[red]{', '.join(parts)} remain[/red]{hint}")


def render_prune(report: EvictionReport, out: Output) -> None:
    n = len(report.removed)
    out.stdout.print(f"removed {n} entr{'y' if n == 1 else 'ies'} ({human_size(report.freed_bytes)}); "
                     f"{human_size(report.total_bytes)} of entries left", highlight=False)


def render_doctor(report: DoctorReport, out: Output) -> None:
    """`kvctl doctor store`: one line per check, then the verdict."""
    out.stdout.print(f"store path {_name(str(report.path))} on {escape(report.filesystem)} "
                     f"({escape(report.mount_options) or 'no options'})", highlight=False)
    for c in report.checks:
        mark = ("[yellow]warn[/yellow]" if c.warning else "[green]ok[/green]") if c.passed else "[red]FAIL[/red]"
        out.stdout.print(f"  {mark} {c.name}: {escape(c.detail)}", highlight=False)
    out.stdout.print("[green]passed[/green]" if report.passed else "[red]failed[/red]", highlight=False)
