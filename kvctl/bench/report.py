"""Bench results: headline ratios, goals, and how they are shown (rich tables, markdown).

A result is one JSON object per bench:

    {"bench": "store", "ratios": {name: worst case over sizes},
     "ratios_by_size": {size label: {name: value}}, "ratio_definitions": {name: text},
     "goals": [{"ratio", "goal", "value", "met"}], "params": {...},
     "machine": {...}, "raw": {...the bench's own figures...}}
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from rich import box
from rich.console import Console
from rich.table import Table

# name -> (True when higher is better, definition)
DEFINITIONS: dict[str, tuple[bool, str]] = {
    "save_vs_raw_write": (True, "our save (fsync off) vs write() of the same bytes: throughput ratio"),
    "save_fsync_vs_raw_write_fsync": (True, "our save with fsync vs write()+fsync(): throughput ratio"),
    "load_vs_raw_read": (True, "our load (key, checksum, token check) vs read() of the file, warm cache"),
    "load_cold_vs_raw_read_cold": (True, "the same after posix_fadvise(DONTNEED): cold cache"),
    "save_vs_per_layer_safetensors": (True, "vs vLLM V1 example connector: a safetensors file per layer"),
    "load_vs_per_layer_safetensors": (True, "vs vLLM V1 example connector: a safetensors file per layer"),
    "save_vs_seed_safetensors": (True, "vs the seed's store: one safetensors file, [2, L, T, H, D]"),
    "load_vs_seed_safetensors": (True, "vs the seed's store: one safetensors file, [2, L, T, H, D]"),
    "save_vs_torch_save": (True, "vs torch.save of the same tensors"),
    "load_vs_torch_save": (True, "vs torch.load of the same tensors"),
    "save_vs_best_peer": (True, "vs the fastest of the three peer formats at that size"),
    "load_vs_best_peer": (True, "vs the fastest of the three peer formats at that size"),
    "gather_vs_memcpy": (True, "paged cache -> token-major entry (all layers) vs copy_ of the same bytes"),
    "scatter_vs_memcpy": (True, "token-major entry -> paged cache (all layers) vs copy_ of the same bytes"),
    "ttft_transfer_vs_recompute": (False, "D's TTFT with the KV loaded / D's TTFT recomputing the prefill"),
    "multi_overhead": (False, "children's sends as MultiConnectorV0 timed them / their own times "
                                "(store write, plus gather where FSConnector logs gather_ms)"),
}
GOALS: dict[str, dict[str, float]] = {
    "store": {"save_vs_raw_write": 0.8, "load_vs_raw_read": 0.8,
              "save_vs_best_peer": 1.0, "load_vs_best_peer": 1.0,
              "save_vs_per_layer_safetensors": 1.0, "load_vs_per_layer_safetensors": 1.0},
}


def higher_is_better(name: str) -> bool:
    base = next((k for k in DEFINITIONS if name == k or name.startswith(k + "_")), None)
    return DEFINITIONS[base][0] if base else True


def definition(name: str) -> str:
    for key, (_, text) in DEFINITIONS.items():
        if name == key:
            return text
        if name.startswith(key + "_"):
            return f"{text} ({name[len(key) + 1:]} only)"
    return ""


def worst(by_size: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per ratio, its worst value over the sizes (min when higher is better, else max)."""
    names: list[str] = []
    for ratios in by_size.values():
        names += [n for n in ratios if n not in names]
    out = {}
    for name in names:
        values = [r[name] for r in by_size.values() if name in r and _finite(r[name])]
        if values:
            out[name] = min(values) if higher_is_better(name) else max(values)
    return out


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def goals_for(bench: str, ratios: dict[str, float]) -> list[dict]:
    rows = []
    for name, goal in GOALS.get(bench, {}).items():
        value = ratios.get(name)
        met = None if value is None else (value >= goal if higher_is_better(name) else value <= goal)
        rows.append({"ratio": name, "goal": f"{'>=' if higher_is_better(name) else '<='} {goal:g}",
                     "value": value, "met": met})
    return rows


def assemble(bench: str, by_size: dict[str, dict[str, float]], raw: dict, params: dict,
             machine: dict) -> dict:
    ratios = worst(by_size)
    return {"bench": bench, "ratios": ratios, "ratios_by_size": by_size,
            "ratio_definitions": {n: definition(n) for n in ratios},
            "goals": goals_for(bench, ratios), "params": params, "machine": machine, "raw": raw}


# --- human output ---

def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if math.isfinite(v) else "inf"
    return str(v)


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
        t.add_row(name, _fmt(value), *(_fmt(result["ratios_by_size"][s].get(name)) for s in sizes),
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
            t.add_row(m, *(_fmt(s[k][m]) for s in raw["sizes"] for k in ("save_gbps", "load_gbps")))
        for m in (raw["sizes"][0]["load_cold_s"] if raw["sizes"] else {}):
            t.add_row(f"{m} (cold)", *(("-", _fmt(s["kv_bytes"] / s["load_cold_s"][m] / 1e9))[i]
                                       for s in raw["sizes"] for i in (0, 1)))
        return t
    if bench == "layout":
        t = Table(title=f"layout on {raw['device_name']}: ms (best of N)", box=box.SIMPLE)
        for col in ("layout", "tokens", "MB", "gather", "scatter", "memcpy", "gather GB/s", "memcpy GB/s"):
            t.add_column(col, justify="right" if col != "layout" else "left")
        for c in raw["cases"]:
            t.add_row(c["layout"], str(c["tokens"]), f"{c['bytes'] / 2**20:.0f}",
                      _fmt(c["gather_s"] * 1e3, 1), _fmt(c["scatter_s"] * 1e3, 1),
                      _fmt(c["memcpy_s"] * 1e3, 1), _fmt(c["gather_gbps"]), _fmt(c["memcpy_gbps"]))
        return t
    if bench == "ttft":
        t = Table(title=f"ttft: {raw['model']} ({raw['dtype']}), ms (best of N)", box=box.SIMPLE)
        for col in ("tokens", "TTFT transfer", "TTFT recompute", "D load", "P latency",
                    "multi send", "children store", "children gather"):
            t.add_column(col, justify="right")
        for s in raw["sizes"]:
            t.add_row(str(s["tokens"]), _fmt(s["ttft_transfer_s"] * 1e3, 0),
                      _fmt(s["ttft_recompute_s"] * 1e3, 0), _fmt(s["d_load_ms"], 0),
                      _fmt(s["p_latency_s"] * 1e3, 0), _fmt(s["multi_children_send_ms"], 0),
                      _fmt(s["children_store_ms"], 0), _fmt(s.get("children_gather_ms"), 0))
        return t
    return None


def render(results: Iterable[dict], console: Console) -> None:
    results = list(results)
    for result in results:
        table = figures_table(result)
        if table is not None:
            console.print(table)
        console.print(ratio_table(result))
    if results:
        console.print(machine_line(results[0]["machine"]), highlight=False)


def machine_line(m: dict) -> str:
    mem = f", {m['mem_total_bytes'] / 2**30:.0f} GiB" if m.get("mem_total_bytes") else ""
    fs = f", bench dir on {m['fs_type']}" if m.get("fs_type") else ""
    return (f"{m['cpu_model']}, {m['cores']} cores{mem}{fs}, load {m.get('loadavg_1m')}, "
            f"{m['date']}")


# --- README table ---

# The README's short table: the ratios (every other one is in --json).
README_RATIOS = ("save_vs_raw_write", "load_vs_raw_read", "save_fsync_vs_raw_write_fsync",
                 "save_vs_per_layer_safetensors", "load_vs_per_layer_safetensors",
                 "save_vs_best_peer", "load_vs_best_peer", "gather_vs_memcpy", "scatter_vs_memcpy",
                 "ttft_transfer_vs_recompute", "multi_overhead")


def markdown(results: list[dict], command: str) -> str:
    """The README's results section: one row per headline ratio, with the machine and date."""
    lines = ["| bench | ratio | worst | per size | goal | better |", "|---|---|---:|---|---|---|"]
    for result in results:
        goals = {g["ratio"]: g for g in result["goals"]}
        for name, value in result["ratios"].items():
            if name not in README_RATIOS:
                continue
            per = ", ".join(f"{size}: {_fmt(r.get(name))}" for size, r in result["ratios_by_size"].items()
                            if name in r)
            g = goals.get(name)
            goal = "" if g is None else f"{g['goal']} ({'met' if g['met'] else 'missed'})"
            lines.append(f"| {result['bench']} | `{name}` | {_fmt(value)} | {per} | {goal} | "
                         f"{'higher' if higher_is_better(name) else 'lower'} |")
    lines.append("")
    if results:
        lines.append(f"Measured on {machine_line(results[0]['machine'])}.")
    lines.append(f"Regenerate with `{command}` (every ratio and raw figure: add `--json`). "
                 "Throughput ratios are ours / baseline (> 1: ours faster); time ratios (TTFT, "
                 "multi overhead) are lower-is-better; `worst` is the worst case over the sizes.")
    return "\n".join(lines) + "\n"
