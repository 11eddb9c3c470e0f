"""Bench views: progress lines, and each result as rich tables (or the JSON object)."""

from __future__ import annotations

from collections.abc import Callable

from rich import box
from rich.markup import escape
from rich.table import Table

from kvctl.bench.report import fmt, higher_is_better, machine_line
from kvctl.views.output import Output


def progress_printer(out: Output) -> Callable[[str], None]:
    """A bench Progress: each line dimmed on stderr."""
    return lambda line: out.stderr.print(f"[dim]{escape(line)}[/dim]", highlight=False)


def render_results(out: Output, results: list[dict]) -> None:
    """One result's JSON, several merged under "ratios" (each also under its bench's name),
    or the figures and ratio tables of each and the machine they ran on."""
    if out.json_mode:
        if len(results) == 1:
            out.emit_json(results[0])
        else:
            merged = {k: v for r in results for k, v in r["ratios"].items()}
            out.emit_json({"ratios": merged, **{r["bench"]: r for r in results}})
        return
    for result in results:
        table = figures_table(result)
        if table is not None:
            out.stdout.print(table)
        out.stdout.print(ratio_table(result))
    if results:
        out.stdout.print(machine_line(results[0]["machine"]), highlight=False)


def ratio_table(result: dict) -> Table:
    t = Table(title=f"kvctl bench {result['bench']}: ratios (worst case over sizes)",
              box=box.SIMPLE_HEAVY)
    t.add_column("ratio")
    sizes = list(result["ratios_by_size"])
    t.add_column("worst", justify="right")
    for size in sizes:
        t.add_column(size, justify="right")
    t.add_column("goal", justify="right")
    t.add_column("better")
    goals = {g["ratio"]: g for g in result["goals"]}
    for name, value in result["ratios"].items():
        g = goals.get(name)
        goal = "-" if g is None else (f"[green]{g['goal']}[/green]" if g["met"] else f"[red]{g['goal']}[/red]")
        t.add_row(name, fmt(value), *(fmt(result["ratios_by_size"][s].get(name)) for s in sizes),
                  goal, "higher" if higher_is_better(name) else "lower")
    return t


def figures_table(result: dict) -> Table | None:
    raw, bench = result["raw"], result["bench"]
    if bench == "store":
        t = Table(title="store: GB/s of the KV bytes (best of N); cold = after DONTNEED",
                  box=box.SIMPLE)
        t.add_column("method")
        for size in raw["sizes"]:
            t.add_column(f"{size['mb']:g} MB save", justify="right")
            t.add_column(f"{size['mb']:g} MB load", justify="right")
        for m in (raw["sizes"][0]["save_s"] if raw["sizes"] else {}):
            t.add_row(m, *(fmt(s[k][m]) for s in raw["sizes"] for k in ("save_gbps", "load_gbps")))
        for m in (raw["sizes"][0]["load_cold_s"] if raw["sizes"] else {}):
            t.add_row(f"{m} (cold)", *(("-", fmt(s["kv_bytes"] / s["load_cold_s"][m] / 1e9))[i]
                                       for s in raw["sizes"] for i in (0, 1)))
        return t
    if bench == "layout":
        t = Table(title=f"layout on {raw['device_name']}: ms (best of N)", box=box.SIMPLE)
        for col in ("layout", "tokens", "MB", "gather", "scatter", "memcpy", "gather GB/s", "memcpy GB/s"):
            t.add_column(col, justify="right" if col != "layout" else "left")
        for c in raw["cases"]:
            t.add_row(c["layout"], str(c["tokens"]), f"{c['bytes'] / 2**20:.0f}",
                      fmt(c["gather_s"] * 1e3, 1), fmt(c["scatter_s"] * 1e3, 1),
                      fmt(c["memcpy_s"] * 1e3, 1), fmt(c["gather_gbps"]), fmt(c["memcpy_gbps"]))
        return t
    if bench == "ttft":
        t = Table(title=f"ttft: {raw['model']} ({raw['dtype']}), ms (best of N)", box=box.SIMPLE)
        for col in ("tokens", "TTFT transfer", "TTFT recompute", "TTFT 1-token", "D load", "P latency",
                    "multi send", "children store", "children gather"):
            t.add_column(col, justify="right")
        for s in raw["sizes"]:
            t.add_row(str(s["tokens"]), fmt(s["ttft_transfer_s"] * 1e3, 0),
                      fmt(s["ttft_recompute_s"] * 1e3, 0),
                      fmt(s["ttft_floor_s"] * 1e3 if s.get("ttft_floor_s") else None, 0),
                      fmt(s["d_load_ms"], 0),
                      fmt(s["p_latency_s"] * 1e3, 0), fmt(s["multi_children_send_ms"], 0),
                      fmt(s["children_store_ms"], 0), fmt(s.get("children_gather_ms"), 0))
        return t
    return None
