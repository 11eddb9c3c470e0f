"""`kvctl launch 1p1d --engine v1` and `--prefill-engine v0 --decode-engine v1`, then `kvctl verify`.

Real servers from the rigs (V1: $KVCTL_RIG_V1_PYTHON or the installed V1 rig;
skipped without one, failed under KVCTL_REQUIRE_RIG_V1=1, as tests/test_v1_e2e.py
finds it). One module-scoped cluster per shape, each holding the run-wide vLLM slot:

- V1 P and D with V1's defaults (prefix caching, chunked prefill) and different
  block sizes (P 32, D 64): verify passes all four checks for every prompt,
  decode_skipped_forward on the V1 `KV load DONE.` counts; the same under
  `verify --concurrency 8` (async saves: D waits for entries still being saved);
- V0 P -> V1 D on one store (the "upgrade the decode pool first" path).

cluster.json records each instance's engine. A V1 server takes ~50 s to start here.
"""

from __future__ import annotations

import fcntl
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e_helpers import slot_lock_path
from conftest import Kvctl, pid_alive
from test_v1_e2e import V1_PYTHON_ENV, _python_or_skip

from kvctl.verify.checks import CHECKS

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm")]

LAUNCH_TIMEOUT_S = 600
VERIFY_TIMEOUT_S = 900
_LOADED = re.compile(r"loaded=(\d+) computed=(\d+) of prompt_tokens=(\d+) \(prefix_cached=(\d+)\)")


@pytest.fixture(scope="module")
def module_slot(shared_dir: Path) -> Iterator[None]:
    with open(slot_lock_path(shared_dir), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="module")
def kvctl_v1(tmp_path_factory, module_slot) -> Kvctl:
    """`kvctl` subprocesses with a tmp KVCTL_HOME, the V1 rig's python, and the V0 rig if there is one."""
    run = Kvctl(tmp_path_factory.mktemp("v1-cluster-home"))
    run.env[V1_PYTHON_ENV] = str(_python_or_skip("v1"))
    return run


@pytest.fixture(scope="module")
def v0_available(kvctl_v1) -> None:
    if not kvctl_v1.env.get("KVCTL_RIG_PYTHON"):
        _python_or_skip("v0")  # skips (or fails under KVCTL_REQUIRE_RIG) without the V0 rig


def _launch(run: Kvctl, model: Path, name: str, *args: str) -> dict:
    res = run("launch", "1p1d", "--runtime", "local", "--name", name, "--model", str(model), "--json",
              *args, timeout=LAUNCH_TIMEOUT_S)
    if res.rc != 0:
        run("down", "--name", name)
        pytest.fail(f"launch failed: {res}")
    return json.loads(res.stdout)


def _down(run: Kvctl, state: dict) -> None:
    res = run("down", "--name", state["name"])
    assert res.rc == 0, res
    pids = [i["pid"] for i in state["instances"].values()]
    assert not [p for p in pids if pid_alive(p)], f"servers left running: {pids}"


def _verify_passes(run: Kvctl, name: str, *args: str) -> dict:
    res = run("verify", "--name", name, "--json", *args, timeout=VERIFY_TIMEOUT_S)
    assert res.rc == 0, res
    doc = json.loads(res.stdout)
    assert doc["passed"] is True and doc["requests"]
    for req in doc["requests"]:
        assert [c["name"] for c in req["checks"]] == list(CHECKS)
        assert all(c["passed"] for c in req["checks"]), req["checks"]
        assert req["decode_output"] == req["baseline_output"] != ""
    return doc


def _v1_load_evidence(req: dict) -> tuple[int, int, int, int]:
    evidence = next(c["evidence"] for c in req["checks"] if c["name"] == "decode_skipped_forward")
    m = _LOADED.search(evidence)
    assert m, evidence
    loaded, computed, prompt, cached = map(int, m.groups())
    assert loaded >= 1 and computed == prompt - cached - loaded, evidence
    return loaded, computed, prompt, cached


@pytest.fixture(scope="module")
def v1_cluster(kvctl_v1, tiny_model) -> Iterator[dict]:
    state = _launch(kvctl_v1, tiny_model, "v1bs", "--engine", "v1",
                    "--prefill-arg=--block-size", "--prefill-arg=32",
                    "--decode-arg=--block-size", "--decode-arg=64")
    yield state
    _down(kvctl_v1, state)


def test_v1_launch_records_engine_and_v1_arguments(v1_cluster):
    for role, inst in v1_cluster["instances"].items():
        assert inst["vllm_engine"] == "v1", inst
        cmd = inst["command"]
        assert "--worker-cls" not in cmd and "--no-enable-prefix-caching" not in cmd, cmd
        assert "--disable-frontend-multiprocessing" not in cmd and "--no-enable-chunked-prefill" not in cmd
        assert cmd[cmd.index("--block-size") + 1] == ("32" if role == "prefill" else "64")


def test_v1_verify_passes_with_block_size_mismatch(kvctl_v1, v1_cluster):
    doc = _verify_passes(kvctl_v1, v1_cluster["name"])
    for req in doc["requests"]:
        _v1_load_evidence(req)


def test_v1_verify_passes_under_concurrency_8(kvctl_v1, v1_cluster):
    """Eight clients at once through the router: P answers while its saves are still being written
    (async), D waits for the entries their pending markers announce, and loads every one."""
    doc = _verify_passes(kvctl_v1, v1_cluster["name"], "--requests", "16", "--concurrency", "8",
                         "--max-tokens", "4")
    assert len(doc["requests"]) == 16
    for req in doc["requests"]:
        loaded, _, prompt, cached = _v1_load_evidence(req)
        assert loaded == prompt - 1 - cached, req
    d_log = Path(v1_cluster["instances"]["decode"]["log_path"]).read_text(errors="replace")
    waits = [line for line in d_log.splitlines() if "KV load WAITED." in line]
    assert all(line.endswith(": published") for line in waits), waits
    print(f"verify --concurrency 8: {len(waits)} of 16 requests waited for an entry being saved: "
          + "; ".join(line.split("KV load WAITED. ")[1] for line in waits))


@pytest.fixture(scope="module")
def v0_to_v1_cluster(kvctl_v1, v0_available, v1_cluster, tiny_model) -> Iterator[dict]:
    _down(kvctl_v1, v1_cluster)  # one pair at a time (idempotent: the fixture's own down is a no-op)
    state = _launch(kvctl_v1, tiny_model, "v0v1", "--prefill-engine", "v0", "--decode-engine", "v1")
    yield state
    _down(kvctl_v1, state)


def test_v0_prefill_v1_decode_verify_passes(kvctl_v1, v0_to_v1_cluster):
    engines = {role: inst["vllm_engine"] for role, inst in v0_to_v1_cluster["instances"].items()}
    assert engines == {"prefill": "v0", "decode": "v1"}
    assert "--worker-cls" in v0_to_v1_cluster["instances"]["prefill"]["command"]
    doc = _verify_passes(kvctl_v1, v0_to_v1_cluster["name"])
    for req in doc["requests"]:
        _v1_load_evidence(req)
