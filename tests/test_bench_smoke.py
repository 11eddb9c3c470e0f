"""`kvctl bench`: every subcommand runs at tiny sizes and reports its ratios.

Benchmarks are not tests: nothing here asserts a speed. These only keep the
benches from rotting: each runs end to end (the store and layout benches in
the rig, ttft against real vLLM servers) and its JSON carries every headline
ratio as a positive finite number.
"""

from __future__ import annotations

import json
import math

import pytest

from kvctl.bench import report
from kvctl.bench.ttft import send_steps

STORE_RATIOS = ("save_vs_raw_write", "load_vs_raw_read", "save_fsync_vs_raw_write_fsync",
                "load_cold_vs_raw_read_cold", "save_vs_per_layer_safetensors",
                "load_vs_per_layer_safetensors", "save_vs_seed_safetensors",
                "load_vs_seed_safetensors", "save_vs_torch_save", "load_vs_torch_save",
                "save_vs_best_peer", "load_vs_best_peer")
LAYOUTS = ("paged_attention", "flash_attn", "flashinfer", "mla")
LAYOUT_RATIOS = ("gather_vs_memcpy", "scatter_vs_memcpy",
                 *(f"{r}_{layout}" for layout in LAYOUTS for r in ("gather_vs_memcpy", "scatter_vs_memcpy")))
TTFT_RATIOS = ("ttft_transfer_vs_recompute", "ttft_transfer_vs_floor", "multi_overhead",
               "multi_send_vs_gather_once")


def _check_ratios(doc: dict, names: tuple[str, ...]) -> None:
    for name in names:
        value = doc["ratios"].get(name)
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (name, value)
        assert doc["ratio_definitions"][name]
    for key in ("cpu_model", "cores", "date"):
        assert doc["machine"][key]


def test_store_bench_smoke(kvctl, rig_python, tmp_path):
    bench_dir = tmp_path / "bench"
    r = kvctl("bench", "store", "--sizes", "0.25,0.5", "--repeat", "1", "--dir", str(bench_dir),
              "--json", timeout=600)
    assert r.rc == 0, r
    doc = json.loads(r.stdout)
    _check_ratios(doc, STORE_RATIOS)
    assert list(doc["ratios_by_size"]) == ["0.25 MB", "0.5 MB"]
    assert doc["machine"]["fs_type"] not in ("", "unknown")
    sizes = doc["raw"]["sizes"]
    assert [s["tokens"] for s in sizes] == [2, 4]  # 128 KiB of KV per token
    # every method wrote a file at least as big as the KV it was given
    assert all(b >= s["kv_bytes"] for s in sizes for b in s["file_bytes"].values())
    assert {g["ratio"] for g in doc["goals"]} >= {"save_vs_raw_write", "load_vs_best_peer"}
    assert list(bench_dir.rglob("*")) == []  # every file it wrote is gone


def test_layout_bench_smoke(kvctl, rig_python):
    r = kvctl("bench", "layout", "--sizes", "40", "--repeat", "1", "--device", "cpu", "--json",
              timeout=600)
    assert r.rc == 0, r
    doc = json.loads(r.stdout)
    _check_ratios(doc, LAYOUT_RATIOS)
    cases = doc["raw"]["cases"]
    assert {c["layout"] for c in cases} == set(LAYOUTS)
    assert all(c["tokens"] == 40 and c["bytes"] == 32 * 2 * 40 * 8 * 128 * 2 for c in cases
               if c["layout"] != "mla")
    assert [c["bytes"] for c in cases if c["layout"] == "mla"] == [32 * 40 * 576 * 2]  # one latent
    assert doc["raw"]["device"] == "cpu"


@pytest.mark.e2e
@pytest.mark.xdist_group("vllm")  # with the other vLLM-starting tests (make test: --dist loadgroup)
def test_ttft_bench_smoke(kvctl, rig_python, tiny_model, vllm_slot, kvctl_home):
    r = kvctl("bench", "ttft", "--model", str(tiny_model), "--sizes", "48", "--repeat", "1",
              "--json", timeout=900)
    assert r.rc == 0, r
    doc = json.loads(r.stdout)
    _check_ratios(doc, TTFT_RATIOS)
    (size,) = doc["raw"]["sizes"]
    assert abs(size["tokens"] - 48) <= 3  # prompts are fitted by whole words
    assert size["first_token_match"] is True  # D's token from the stored hidden state == P's
    assert size["d_load_ms"] is not None  # D logged that it skipped its prefill
    assert not list((kvctl_home / "clusters").glob("*/cluster.json"))  # torn down


@pytest.mark.parametrize("args, field", [
    (("store", "--sizes", "0"), "--sizes"),
    (("store", "--sizes", "1,x"), "--sizes"),
    (("layout", "--sizes", "1.5"), "--sizes"),
    (("ttft", "--repeat", "0"), "--repeat"),
    (("layout", "--device", "tpu", "--sizes", "16"), "--device"),
])
def test_bad_input_exits_2_naming_the_option(kvctl, args, field):
    r = kvctl("bench", *args)
    assert r.rc == 2, r
    assert field in r.stderr
    assert "Traceback" not in r.stderr


def test_send_steps_pairs_each_child_with_its_store_write():
    log = "\n".join([
        "INFO [rank0]: KV send DONE. key=" + "a" * 32 + " tokens=48 bytes=100 ms=2.0",
        "INFO sent to connector FSConnector (child 0, 3.5 ms)",
        "INFO [rank0]: KV send DONE. key=" + "a" * 32 + " tokens=48 bytes=100 ms=1.5 gather_ms=0.5",
        "INFO sent to connector FSConnector (child 1, 2.5 ms)",
        "INFO something else",
        "INFO [rank0]: KV send DONE. key=" + "b" * 32 + " tokens=9 bytes=10 ms=0.5",
        "INFO sent to connector FSConnector (child 0, 1.0 ms)",
    ])
    steps = send_steps(log)
    assert [(s.tokens, s.child_ms, s.store_ms, s.gather_ms) for s in steps] == [
        (48, {0: 3.5, 1: 2.5}, {0: 2.0, 1: 1.5}, {1: 0.5}),
        (9, {0: 1.0}, {0: 0.5}, {}),
    ]


def test_headline_is_the_worst_case_in_the_right_direction():
    by_size = {"1 MB": {"save_vs_raw_write": 0.5, "ttft_transfer_vs_recompute": 0.2,
                        "load_vs_torch_save": 2.0},
               "8 MB": {"save_vs_raw_write": 0.9, "ttft_transfer_vs_recompute": 0.4,
                        "load_vs_torch_save": 3.0}}
    result = report.assemble("store", by_size, raw={}, params={}, machine={
        "cpu_model": "x", "cores": 2, "date": "d", "loadavg_1m": 1.0})
    assert result["ratios"] == {"save_vs_raw_write": 0.5, "ttft_transfer_vs_recompute": 0.4,
                                "load_vs_torch_save": 2.0}
    goal = next(g for g in result["goals"] if g["ratio"] == "save_vs_raw_write")
    assert goal["met"] is False and goal["goal"] == ">= 0.8"
    md = report.markdown([result], "kvctl bench all --markdown x.md")
    assert "| store | `save_vs_raw_write` | 0.50 | 1 MB: 0.50, 8 MB: 0.90 | >= 0.8 (missed) |" in md
    assert "| store | `ttft_transfer_vs_recompute` | 0.40 |" in md  # lower is better: the max
    assert "load_vs_torch_save" not in md  # the README table keeps to the ratios
    assert "kvctl bench all --markdown x.md" in md
