"""The benches as the CLI calls them: defaults, validation, one result object each.

Every run returns the report.assemble() object: headline ratios, ratios per
size, goals, params, machine info and the bench's raw figures.
"""

from __future__ import annotations

from pathlib import Path

from kvctl.bench import report, ttft
from kvctl.bench.common import Progress, machine_info, quiet, resolve_bench_dir, run_in_rig, scratch_dir
from kvctl.cluster.spec import resolve_model
from kvctl.errors import BadInput
from kvctl.provision.tiny_model import ensure_default_model

# ---- defaults: sizes, repeats and shapes of every bench, in one place ----
STORE_SIZES_MB = [1.0, 64.0, 512.0]  # 512 MB ~ 4k tokens of an 8B GQA model in bf16
STORE_QUICK_MB = [1.0, 8.0]
SCALE_ENTRIES = [1000, 10000, 100000]  # entries in the store for `bench store --scale`
SCALE_PUBLISHES = 300  # timed publishes per count (p50 of these)
SCALE_QUICK_PUBLISHES = 60
LAYOUT_TOKENS = [1024, 2048, 4096]
LAYOUT_QUICK_TOKENS = [256, 1024]
LAYOUT_THREADS = 1  # torch intra-op threads on CPU; 2 contended threads stall each other
LAYOUT_SHAPE = {"layers": 32, "kv_heads": 8, "head_size": 128, "block_size": 16, "dtype": "bfloat16",
                "mla_head_size": 576}  # MLA: one latent per token (DeepSeek-V2/V3)
TTFT_TOKENS = [512, 1024, 2048]
TTFT_QUICK_TOKENS = [256, 512]
REPEAT = 3  # best of N
DEVICES = ("auto", "cpu", "cuda")
README_COMMAND = "nice kvctl bench all --markdown bench-results.md"
# ---------------------------------------------------------------------------


def _label_mb(mb: float) -> str:
    return f"{mb:g} MB"


def run_store(sizes_mb: list[float], repeat: int, bench_dir: Path | None,
              progress: Progress = quiet, scale_entries: list[int] | None = None,
              scale_publishes: int = SCALE_PUBLISHES) -> dict:
    """Our store vs raw file I/O and the peers' formats, in the rig. Files are removed.

    Every size also loads into a paged cache (`load_to_cache_*`). With
    `scale_entries`, publish/lookup/evict latency with that many entries in
    the store too (`publish_p50_<most>_vs_<fewest>`, under "scale").
    Raises BadInput (dir, rig missing), RuntimeFailure (the bench failed).
    """
    root = resolve_bench_dir(bench_dir)
    params = {"sizes_mb": sizes_mb, "repeat": repeat}
    if scale_entries:
        params.update(scale_entries=scale_entries, scale_publishes=scale_publishes)
    with scratch_dir(root) as work:
        raw = run_in_rig("store", {"dir": str(work), **params}, progress)
    by_size = {_label_mb(s["mb"]): s["ratios"] for s in raw["sizes"]}
    if raw.get("scale"):
        by_size["scale"] = raw["scale"]["ratios"]
    return report.assemble("store", by_size, raw, params, machine_info(root))


def check_scale_entries(entries: list[float]) -> list[int]:
    """Counts of entries for the scale bench: at least two. Raises BadInput (field `scale_entries`)."""
    counts = sorted({int(n) for n in entries})
    if len(counts) < 2:
        raise BadInput(f"the scale bench compares two or more store sizes, got {counts}",
                       field="scale_entries", fix="pass at least two counts, e.g. 1000,10000,100000")
    return counts


def run_layout(tokens: list[int], repeat: int, device: str, threads: int = LAYOUT_THREADS,
               progress: Progress = quiet) -> dict:
    """Gather/scatter through the paged layouts vs memcpy, in the rig."""
    if device not in DEVICES:
        raise BadInput(f"unknown device {device!r}", field="device",
                       fix=f"use one of: {', '.join(DEVICES)}")
    if threads < 0:
        raise BadInput(f"threads must be 0 or more, got {threads}", field="threads",
                       fix="pass 1 (stable on a shared machine), or 0 for torch's default")
    params = {"tokens": tokens, "repeat": repeat, "device": device, "threads": threads,
              **LAYOUT_SHAPE}
    raw = run_in_rig("layout", params, progress)
    by_size: dict[str, dict[str, float]] = {}
    for case in raw["cases"]:
        label = f"{case['tokens']} tok"
        row = by_size.setdefault(label, dict.fromkeys(case["ratios"]))  # headline names first
        for name, value in case["ratios"].items():
            row[f"{name}_{case['layout']}"] = value
            row[name] = value if row[name] is None else min(row[name], value)
    machine = machine_info()
    machine["device"] = raw["device_name"]
    return report.assemble("layout", by_size, raw, params, machine)


def run_ttft(tokens: list[int], repeat: int, model: Path | None, progress: Progress = quiet) -> dict:
    """Decode TTFT with KV loaded vs recomputed, and MultiConnectorV0's send overhead.

    Launches one 1P1D cluster of real vLLM CPU servers (the bench model by
    default, written on first use) and always tears it down.
    """
    if model is None:
        progress("ttft: the bench model (written on first use, ~1.2 GB)")
        model = ensure_default_model("bench")
    model = resolve_model(model)
    raw = ttft.run(model, tokens, repeat, progress)
    by_size = {f"{s['tokens']} tok": s["ratios"] for s in raw["sizes"]}
    return report.assemble("ttft", by_size, raw, {"tokens": tokens, "repeat": repeat},
                           machine_info())


def run_all(quick: bool, repeat: int, bench_dir: Path | None, model: Path | None,
            progress: Progress = quiet) -> list[dict]:
    """store, layout and ttft with their default (or quick) sizes."""
    return [
        run_store(STORE_QUICK_MB if quick else STORE_SIZES_MB, repeat, bench_dir, progress,
                  scale_entries=SCALE_ENTRIES,
                  scale_publishes=SCALE_QUICK_PUBLISHES if quick else SCALE_PUBLISHES),
        run_layout(LAYOUT_QUICK_TOKENS if quick else LAYOUT_TOKENS, repeat, "auto",
                   progress=progress),
        run_ttft(TTFT_QUICK_TOKENS if quick else TTFT_TOKENS, repeat, model, progress),
    ]
