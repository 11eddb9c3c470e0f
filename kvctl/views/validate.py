"""Validate views: every problem of a config or scenario with its JSON path and fix."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvctl.scenario.validation import ENGINE_ANY, ValidationResult
from kvctl.views.output import Output


def render_validation(result: ValidationResult, out: Output) -> None:
    """`valid <kind>: <target>`, or a table of problems and the error/warning counts."""
    if not result.problems:
        kind = result.kind.replace("_", "-")
        needs = _engine_words(result.engine)
        out.stdout.print(f"[green]valid[/green] {kind}{needs}: {escape(result.target)}", highlight=False)
        return
    table = Table(title=escape(result.target), title_justify="left", show_lines=True)
    table.add_column("", no_wrap=True)
    table.add_column("path", overflow="fold")
    table.add_column("problem", overflow="fold")
    table.add_column("fix", overflow="fold")
    for p in result.problems:
        tag = "[red]error[/red]" if p.severity == "error" else "[yellow]warning[/yellow]"
        table.add_row(tag, Text(p.path), Text(p.message), Text(p.fix))
    out.stdout.print(table)
    n_err, n_warn = len(result.errors), len(result.problems) - len(result.errors)
    verdict = "[red]invalid[/red]" if n_err else "[green]valid[/green]"
    needs = " (checked for engine v1: the config needs it)" if result.engine == "v1" else _engine_words(result.engine)
    out.stdout.print(f"{verdict}: {n_err} error(s), {n_warn} warning(s){needs}")


def _engine_words(engine: str | None) -> str:
    """Which engine a config needs, as the verdict line says it ("" for a scenario)."""
    if engine is None:
        return ""
    if engine == ENGINE_ANY:
        return " (runs on engine v0 or v1)"
    return f" (needs engine {engine})"
