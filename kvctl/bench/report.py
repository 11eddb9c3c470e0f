"""Bench results: headline ratios, goals, and the README's markdown table.

A result is one JSON object per bench:

    {"bench": "store", "ratios": {name: worst case over sizes},
     "ratios_by_size": {size label: {name: value}}, "ratio_definitions": {name: text},
     "goals": [{"ratio", "goal", "value", "met"}], "params": {...},
     "machine": {...}, "raw": {...the bench's own figures...}}
"""

from __future__ import annotations

import math
from typing import Any

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
    "load_to_cache_vs_best_peer": (True, "KV from the store into a paged cache (read, checksum, scatter) vs "
                                         "the faster peer format doing the same (safetensors, mapped)"),
    "load_to_cache_vs_memcpy": (True, "KV from the store into a paged cache vs one readinto of the same bytes "
                                      "from the page cache into a preallocated buffer (the limit)"),
    "load_to_cache_vs_raw_read": (True, "KV from the store into a paged cache vs read() of the raw bytes + scatter"),
    "load_to_cache_vs_per_layer_safetensors": (True, "into a paged cache, vs a safetensors file per layer (mapped)"),
    "load_to_cache_vs_seed_safetensors": (True, "into a paged cache, vs the seed's one file [2, L, T, H, D] (mapped)"),
    "save_mac_vs_unkeyed": (True, "save with a store key (entry signed: keyed BLAKE3 tag) vs without: throughput"),
    "load_mac_vs_unkeyed": (True, "load with a store key (checksum and tag checked) vs without: throughput"),
    "load_to_cache_mac_vs_unkeyed": (True, "KV into a paged cache from a keyed store (checksum and tag checked) "
                                           "vs from an unkeyed one"),
    "publish_p50_100k_vs_1k": (False, "bounded store at its bound: p50 publish latency (eviction included) with "
                                      "100k entries / with 1k entries"),
    "lookup_p50_100k_vs_1k": (False, "p50 latency of an already-stored check (header read) with 100k / 1k entries"),
    "evict_p50_100k_vs_1k": (False, "p50 latency of making room for one entry with 100k / 1k entries"),
    "publish_p50": (False, "p50 publish latency at the most entries / at the fewest"),
    "lookup_p50": (False, "p50 lookup latency at the most entries / at the fewest"),
    "evict_p50": (False, "p50 eviction latency at the most entries / at the fewest"),
    "gather_vs_memcpy": (True, "paged cache -> token-major entry (all layers) vs copy_ of the same bytes"),
    "scatter_vs_memcpy": (True, "token-major entry -> paged cache (all layers) vs copy_ of the same bytes"),
    "ttft_transfer_vs_recompute": (False, "D's TTFT with the KV loaded / D's TTFT recomputing the prefill"),
    "multi_overhead": (False, "children's sends as MultiConnectorV0 timed them / their own times "
                                "(store write, plus gather where FSConnector logs gather_ms)"),
    "multi_send_vs_gather_once": (False, "P's whole multi send per request (children's sends as "
                                         "MultiConnectorV0 timed them) / (one gather + the children's "
                                         "store writes)"),
    "ttft_transfer_vs_floor": (False, "D's TTFT with the KV loaded / D's TTFT for a 1-token prompt "
                                      "(same server, max_tokens=1)"),
}
GOALS: dict[str, dict[str, float]] = {
    "store": {"save_vs_raw_write": 0.8, "save_fsync_vs_raw_write_fsync": 0.8, "load_vs_raw_read": 0.8,
              "load_to_cache_vs_best_peer": 1.0, "load_to_cache_vs_memcpy": 0.5,
              "load_to_cache_mac_vs_unkeyed": 0.9,
              "publish_p50_100k_vs_1k": 2.0,
              "save_vs_best_peer": 1.0, "load_vs_best_peer": 1.0,
              "save_vs_per_layer_safetensors": 1.0, "load_vs_per_layer_safetensors": 1.0},
    "layout": {"gather_vs_memcpy": 0.5, "scatter_vs_memcpy": 0.5},
    "ttft": {"ttft_transfer_vs_recompute": 0.2, "ttft_transfer_vs_floor": 1.5, "multi_overhead": 1.05,
             "multi_send_vs_gather_once": 1.05},
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


# --- figures as text (the rich tables are kvctl.views.bench) ---

def fmt(v: Any, digits: int = 2) -> str:
    """A figure as tables show it: `-` for none, `inf`, else `digits` decimals."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if math.isfinite(v) else "inf"
    return str(v)


def machine_line(m: dict) -> str:
    mem = f", {m['mem_total_bytes'] / 2**30:.0f} GiB" if m.get("mem_total_bytes") else ""
    fs = f", bench dir on {m['fs_type']}" if m.get("fs_type") else ""
    return (f"{m['cpu_model']}, {m['cores']} cores{mem}{fs}, load {m.get('loadavg_1m')}, "
            f"{m['date']}")


# --- README table ---

# The README's short table: the ratios (every other one is in --json).
README_RATIOS = ("save_vs_raw_write", "load_vs_raw_read", "save_fsync_vs_raw_write_fsync",
                 "save_vs_per_layer_safetensors", "load_vs_per_layer_safetensors",
                 "save_vs_best_peer", "load_vs_best_peer", "load_to_cache_vs_best_peer",
                 "load_to_cache_vs_memcpy", "save_mac_vs_unkeyed", "load_mac_vs_unkeyed",
                 "load_to_cache_mac_vs_unkeyed", "publish_p50_100k_vs_1k", "gather_vs_memcpy", "scatter_vs_memcpy",
                 "ttft_transfer_vs_recompute", "ttft_transfer_vs_floor", "multi_overhead",
                 "multi_send_vs_gather_once")


def markdown(results: list[dict], command: str) -> str:
    """The README's results section: one row per headline ratio, with the machine and date."""
    lines = ["| bench | ratio | worst | per size | goal | better |", "|---|---|---:|---|---|---|"]
    for result in results:
        goals = {g["ratio"]: g for g in result["goals"]}
        for name, value in result["ratios"].items():
            if name not in README_RATIOS:
                continue
            per = ", ".join(f"{size}: {fmt(r.get(name))}" for size, r in result["ratios_by_size"].items()
                            if name in r)
            g = goals.get(name)
            goal = "" if g is None else f"{g['goal']} ({'met' if g['met'] else 'missed'})"
            lines.append(f"| {result['bench']} | `{name}` | {fmt(value)} | {per} | {goal} | "
                         f"{'higher' if higher_is_better(name) else 'lower'} |")
    lines.append("")
    if results:
        lines.append(f"Measured on {machine_line(results[0]['machine'])}.")
    lines.append(f"Regenerate with `{command}` (every ratio and raw figure: add `--json`). "
                 "Throughput ratios are ours / baseline (> 1: ours faster); time ratios (TTFT, "
                 "multi overhead) are lower-is-better; `worst` is the worst case over the sizes.")
    return "\n".join(lines) + "\n"
