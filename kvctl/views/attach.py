"""Attach views: the attached cluster (its instances and what is not observable), detach."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from kvctl.attach.attach import AttachResult, DetachReport
from kvctl.views.output import Output


def render_attached(out: Output, result: AttachResult) -> None:
    """`kvctl attach`: the cluster state (JSON, with `notes`), or a table and what next."""
    state = result.state
    if out.json_mode:
        out.emit_json({**state.to_json(), "notes": result.notes})
        return
    table = Table(title=f"attached cluster {state.name!r} (not started by kvctl)", title_justify="left")
    for col in ("instance", "role", "url", "log"):
        table.add_column(col, overflow="fold")
    for name, rec in state.instances.items():
        table.add_row(escape(name), rec.role, rec.url, escape(rec.log_source or "(none: not observable)"))
    out.stdout.print(table)
    lines = [f"model: {escape(state.served_model_name)}"]
    if state.endpoint:
        lines.append(f"endpoint: {escape(state.endpoint)}")
    lines.append(f"store: {escape(state.store) if state.store else 'not visible here'}")
    lines += [f"[yellow]note:[/yellow] {escape(n)}" for n in result.notes]
    lines.append(f"next: `kvctl status --name {state.name}`, `kvctl verify --name {state.name}`, "
                 f"`kvctl detach {state.name}`")
    out.info("\n".join(lines))


def render_detached(out: Output, report: DetachReport) -> None:
    """`kvctl detach`: what was forgotten."""
    if out.json_mode:
        out.emit_json(report.to_json())
        return
    if not report.found:
        out.info(f"no cluster named {report.name!r}; nothing to forget")
        return
    out.info(f"forgot attached cluster {report.name!r} ({report.removed}); its servers keep running")
