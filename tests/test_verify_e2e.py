"""`kvctl verify` end to end on real vLLM V0 CPU servers (the rig, the tiny model).

- A default 1P1D cluster (FSConnector producer on P, consumer on D): every
  check passes for every default prompt.
- A store entry corrupted between P and D: store_entry_written and
  decode_skipped_forward fail, D recomputes and its output still matches.
- D launched without a connector (`--decode-config none`): verify exits 1
  naming decode_skipped_forward, although the outputs match.

Launch, verify and down run as `kvctl` subprocesses; the corruption test drives
verify's library steps itself, so it can damage the entry between P and D.
Needs the CPU rig (conftest's `rig_python`: skipped without one, failed under
KVCTL_REQUIRE_RIG=1 as in CI).
"""

from __future__ import annotations

import fcntl
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from e2e_helpers import slot_lock_path
from conftest import Kvctl, pid_alive

from connectors.store.format import entry_path
from kvctl.verify.checks import CHECKS, check_output_matches_baseline, check_store_entry_written
from kvctl.verify.cluster_info import cluster_info
from kvctl.verify.verifier import ClusterVerifier

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm")]

LAUNCH_TIMEOUT_S = 600
VERIFY_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def vllm_module_slot(shared_dir):
    """The run-wide one-server-pair lock (conftest's vllm_slot), held for this module."""
    with open(slot_lock_path(shared_dir), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="module")
def kvctl_e2e(tmp_path_factory, rig_python, vllm_module_slot) -> Kvctl:
    """`kvctl` subprocesses with a module-wide tmp KVCTL_HOME and the rig."""
    run = Kvctl(tmp_path_factory.mktemp("verify-e2e-home"))
    assert run.env["KVCTL_RIG_PYTHON"] == str(rig_python)
    return run


class Cluster:
    """A launched cluster; torn down with `kvctl down`, which must leave no process."""

    def __init__(self, run: Kvctl, model: Path, name: str, *launch_args: str):
        self.run, self.name = run, name
        res = run("launch", "1p1d", "--runtime", "local", "--name", name, "--model", str(model), "--json",
                  *launch_args, timeout=LAUNCH_TIMEOUT_S)
        if res.rc != 0:
            run("down", "--name", name)
            pytest.fail(f"launch failed: {res}")
        self.state = json.loads(res.stdout)
        self.info = cluster_info(self.state)
        self.pids = [i["pid"] for i in self.state["instances"].values()]

    def down(self) -> None:
        res = self.run("down", "--name", self.name)
        assert res.rc == 0, res
        assert not [p for p in self.pids if pid_alive(p)], f"servers left running: {self.pids}"


@pytest.fixture(scope="module")
def cluster(kvctl_e2e, tiny_model):
    c = Cluster(kvctl_e2e, tiny_model, "e2e")
    yield c
    c.down()  # idempotent: the last test already took it down


def test_verify_passes_on_default_cluster(cluster, tmp_path):
    junit = tmp_path / "verify.xml"
    res = cluster.run("verify", "--name", cluster.name, "--json", "--junit-xml", str(junit),
                      timeout=VERIFY_TIMEOUT_S)
    assert res.rc == 0, res
    doc = json.loads(res.stdout)
    assert doc["passed"] is True and doc["cluster"] == "e2e"
    assert len(doc["requests"]) == 4
    for req in doc["requests"]:
        assert [c["name"] for c in req["checks"]] == list(CHECKS)
        assert all(c["passed"] for c in req["checks"]), req["checks"]
        assert req["decode_output"] == req["baseline_output"] != ""
        assert Path(cluster.info.store, f"{req['key']}.safetensors").is_file()
    assert max(r["prompt_tokens"] for r in doc["requests"]) >= 1000  # the long prompt
    cases = ET.parse(junit).getroot().findall("./testsuite/testcase")
    assert len(cases) == 16 and all(c.find("failure") is None for c in cases)


def test_corrupt_entry_before_decode_fails_checks(cluster):
    prompt = "Tell me a story about a corrupted cache file, please."
    with ClusterVerifier(cluster.info) as v:
        pre = v.run_prefill(prompt)
        assert pre.kv_send.passed and pre.store_entry.passed, (pre.kv_send, pre.store_entry)
        path = entry_path(cluster.info.store, pre.key)
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF  # one flipped byte in the KV data: checksum mismatch
        path.write_bytes(bytes(raw))

        store_check = check_store_entry_written(cluster.info.store, pre.key, pre.tokens)
        dec, skip_check, _ = v.run_decode(prompt, pre.key, 8)
        base = v.run_baseline(prompt, 8)
    assert not store_check.passed and "checksum" in store_check.evidence
    assert not skip_check.passed
    assert "redo model forwarding" in skip_check.evidence and "corrupt" in skip_check.evidence
    # D recomputed the prefill itself, so its output is still right
    assert check_output_matches_baseline(dec, base).passed


def test_verify_fails_when_decode_has_no_connector(cluster, kvctl_e2e, tiny_model):
    cluster.down()  # one server pair at a time on this machine
    plain = Cluster(kvctl_e2e, tiny_model, "e2e-plain", "--decode-config", "none")
    try:
        res = kvctl_e2e("verify", "--name", plain.name, "--json", "--prompt", "Hello, how are you?",
                        "--max-tokens", "8", timeout=VERIFY_TIMEOUT_S)
    finally:
        plain.down()
    assert res.rc == 1, res
    doc = json.loads(res.stdout)
    checks = {c["name"]: c for c in doc["requests"][0]["checks"]}
    assert doc["passed"] is False
    assert not checks["decode_skipped_forward"]["passed"]
    assert "without a kv-transfer-config" in checks["decode_skipped_forward"]["evidence"]
    assert checks["kv_send_logged"]["passed"] and checks["store_entry_written"]["passed"]
    assert checks["output_matches_baseline"]["passed"]  # outputs match, yet no KV travelled
