"""`kvctl bench store`: the load_to_cache ratios and `--scale` (quick shapes; no speed is asserted)."""

from __future__ import annotations

import json
import math

from kvctl.bench import report

TO_CACHE = ("load_to_cache_vs_best_peer", "load_to_cache_vs_memcpy", "load_to_cache_vs_raw_read",
            "load_to_cache_vs_per_layer_safetensors", "load_to_cache_vs_seed_safetensors")
SCALE = ("publish_p50_400_vs_100", "lookup_p50_400_vs_100", "evict_p50_400_vs_100")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_store_bench_quick_scale_and_to_cache_shapes(kvctl, rig_python, tmp_path):
    bench_dir = tmp_path / "bench"
    r = kvctl("bench", "store", "--quick", "--sizes", "0.25", "--repeat", "1", "--scale",
              "--scale-entries", "100,400", "--dir", str(bench_dir), "--json", timeout=900)
    assert r.rc == 0, r
    doc = json.loads(r.stdout)
    for name in TO_CACHE + SCALE + ("save_fsync_vs_raw_write_fsync", "save_vs_raw_write"):
        assert _positive(doc["ratios"].get(name)), (name, doc["ratios"].get(name))
        assert doc["ratio_definitions"][name]
    assert list(doc["ratios_by_size"]) == ["0.25 MB", "scale"]
    assert set(doc["ratios_by_size"]["scale"]) == set(SCALE)
    (size,) = doc["raw"]["sizes"]
    assert set(size["to_cache"]["to_cache_s"]) == {"ours", "ours_mac", "ours_two_pass", "per_layer_safetensors",
                                                   "seed_safetensors", "raw_read", "memcpy"}
    cases = doc["raw"]["scale"]["cases"]
    assert [c["entries"] for c in cases] == [100, 400]
    for case in cases:
        assert case["bound_held"] and case["entries_after"] == case["entries"]
        assert all(_positive(case[k]) for k in ("publish_p50_s", "lookup_p50_s", "evict_p50_s", "load_p50_s",
                                               "full_scan_s", "first_publish_s"))
        assert case["writer_scans"] >= 1
    assert doc["params"]["scale_entries"] == [100, 400]
    assert list(bench_dir.rglob("*")) == []  # every file it wrote is gone


def test_default_scale_ratio_names_and_goals():
    from kvctl.bench import suite

    assert suite.SCALE_ENTRIES == [1000, 10000, 100000]
    for name in ("publish_p50_100k_vs_1k", "lookup_p50_100k_vs_1k", "evict_p50_100k_vs_1k"):
        assert not report.higher_is_better(name) and report.definition(name)
    for name in TO_CACHE:
        assert report.higher_is_better(name) and report.definition(name)
    result = report.assemble("store", {"scale": {"publish_p50_100k_vs_1k": 1.4},
                                       "1 MB": {"load_to_cache_vs_memcpy": 0.3, "save_fsync_vs_raw_write_fsync": 0.9}},
                             raw={}, params={}, machine={})
    goals = {g["ratio"]: g for g in result["goals"]}
    assert goals["publish_p50_100k_vs_1k"]["goal"] == "<= 2" and goals["publish_p50_100k_vs_1k"]["met"] is True
    assert goals["load_to_cache_vs_memcpy"]["met"] is False
    assert goals["save_fsync_vs_raw_write_fsync"]["met"] is True
    assert "load_to_cache_vs_best_peer" in goals


def test_scale_entries_needs_two_counts(kvctl):
    for args in (("--scale-entries", "5"), ("--scale-entries", "0,10"), ("--scale-entries", "x,10")):
        r = kvctl("bench", "store", *args)
        assert r.rc == 2, r
        assert "--scale-entries" in r.stderr and "Traceback" not in r.stderr
