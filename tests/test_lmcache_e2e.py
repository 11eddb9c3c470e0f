"""LMCache for real on CPU: kvctl runs the `lmcache server` of a prefill whose MultiConnector has an
LMCacheMPConnector offload child (vLLM V1 rig + the lmcache extra), and proves what it did.

- `kvctl scenario run v1-seed-replica`: P = MultiConnector [FSConnector transfer, LMCacheMPConnector],
  D = FSConnector; every check passes, offload_logged included (the server's `Stored N tokens`
  lines), and the second round, after a P restart, is served by LMCache: its retrieved count
  rises, the outputs are unchanged, and each prompt's TTFT is reported for both rounds.
- One cluster for the faults, with a tiny L1 (5 MB): status and `logs lmcache` show the server;
  a burst of long prompts fills L1 (LMCache logs its eviction) and every answer stays right;
  the server killed mid-run: P keeps serving (recomputes), no wrong answer, and verify fails
  offload_logged naming the offload child, with every P/D check passing.
- A server that never comes up (an L1 no host can allocate): the launch fails naming it, and
  nothing is left running (no vLLM server was started).

Servers from the V1 rig ($KVCTL_RIG_V1_PYTHON or the installed one) and the lmcache extra
(`kvctl rig install --engine v1 --extra lmcache`; skipped without them, failed under
KVCTL_REQUIRE_RIG_V1=1). One module-scoped cluster per shape, holding the run-wide vLLM slot.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Kvctl, live_processes_under
from test_v1_cluster import LAUNCH_TIMEOUT_S, VERIFY_TIMEOUT_S, module_slot
from test_v1_e2e import REQUIRE_ENV, V1_PYTHON_ENV, _python_or_skip

from kvctl.cluster.lmcache import MQ_TIMEOUT_S
from kvctl.provision.extras import LMCACHE, ExtraVenv
from kvctl.provision.rig import default_spec

# A scenario of two V1 servers plus a restart of P takes ~5 minutes on 2 idle cores; the fault
# cluster ~3 more: beyond pytest's default per-test 900 s when the machine is shared.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(2400)]

__all__ = ["module_slot"]
CHECKS5 = ["kv_send_logged", "store_entry_written", "decode_skipped_forward", "output_matches_baseline",
           "offload_logged"]
P_D_CHECKS = CHECKS5[:4]
FS = {"kv_connector": "FSConnector", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"fs_storage_path": "store", "transfer": True}}
P_CONFIG = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
    "connectors": [FS, {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}]}}
D_CONFIG = {"kv_connector": "FSConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"fs_storage_path": "store"}}


def _require_lmcache(python: Path) -> None:
    """Skip (fail under KVCTL_REQUIRE_RIG_V1=1) unless the lmcache extra is installed beside the V1 rig."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(V1_PYTHON_ENV, str(python))
        venv = ExtraVenv(LMCACHE, default_spec("v1"))
        if venv.unfinished():
            why = f"the lmcache extra is not installed at {venv.dir} (`kvctl rig install --engine v1 --extra lmcache`)"
            if os.environ.get(REQUIRE_ENV["v1"]) == "1":
                pytest.fail(f"{why} ({REQUIRE_ENV['v1']}=1; make rig-v1 installs it)")
            pytest.skip(why)


def _kvctl(tmp_path_factory, name: str) -> Kvctl:
    """kvctl with a fresh KVCTL_HOME on this run's V1 rig (its extras live beside it)."""
    python = _python_or_skip("v1")
    _require_lmcache(python)
    run = Kvctl(tmp_path_factory.mktemp(name))
    run.env[V1_PYTHON_ENV] = str(python)
    return run


def _checks(req: dict) -> dict[str, dict]:
    return {c["name"]: c for c in req["checks"]}


# ------------------------------------------------------------------ the scenario


@pytest.fixture(scope="module")
def seed_replica(tmp_path_factory, module_slot) -> tuple[Kvctl, dict]:
    run = _kvctl(tmp_path_factory, "lmcache-scenario")
    res = run("scenario", "run", "v1-seed-replica", "--json", timeout=LAUNCH_TIMEOUT_S + 2 * VERIFY_TIMEOUT_S)
    assert res.stdout, res
    return run, json.loads(res.stdout)


def test_v1_seed_replica_passes_with_each_childs_evidence(seed_replica):
    run, doc = seed_replica
    assert doc["passed"] is True and doc["exit_code"] == 0, json.dumps(doc, indent=1)[:4000]
    assert [p["name"] for p in doc["phases"]] == ["launch", "verify", "second_round", "inspect", "down"]
    for req in doc["verify"]["requests"]:
        checks = _checks(req)
        assert sorted(checks) == sorted(CHECKS5) and all(c["passed"] for c in checks.values()), req
        assert "KV send DONE." in checks["kv_send_logged"]["evidence"]
        assert "KV load DONE." in checks["decode_skipped_forward"]["evidence"]
        offload = checks["offload_logged"]["evidence"]
        assert "LMCacheMPConnector (child 1)" in offload and "lmcache-prefill" in offload
        if req["prompt_tokens"] >= 256:  # a whole chunk: the server's own line is the evidence
            assert "Stored " in offload and "tokens in" in offload, offload
        # each child's own evidence, as its own field: FS sent the prompt, LMCache stored its whole
        # chunks, D loaded what neither its prefix cache nor its own last-token step computed
        parts = req["children"]
        assert parts["transfer"]["connector"] == "FSConnector" and parts["transfer"]["child"] == 0
        assert parts["transfer"]["tokens"] == req["prompt_tokens"], parts
        assert parts["offload"]["connector"] == "LMCacheMPConnector" and parts["offload"]["child"] == 1
        assert parts["offload"]["stored"] >= req["prompt_tokens"] // 256 * 256, parts
        load = parts["load"]
        assert load["instance"] == "decode" and load["tokens"] >= 1, parts
        assert load["tokens"] + load["computed"] + load["prefix_cached"] == req["prompt_tokens"], parts
    assert live_processes_under(run.home) == []  # LMCache server and vLLM servers gone with the cluster


def test_v1_seed_replica_second_round_is_served_by_lmcache(seed_replica):
    _, doc = seed_replica
    rnd = doc["second_round"]
    assert rnd["restarted"] == ["prefill"] and rnd["passed"] and rnd["outputs_unchanged"], rnd
    lm = rnd["lmcache"]
    assert lm["retrieved_rose"] and lm["retrieved_tokens"]["after"] > lm["retrieved_tokens"]["before"], lm
    long_prompts = [r for r in rnd["verify"]["requests"] if r["prompt_tokens"] >= 256]
    assert long_prompts
    for req in long_prompts:  # P's prefix cache went with the restart: LMCache served the chunks
        assert "Retrieved " in _checks(req)["offload_logged"]["evidence"], req
    assert all(row["first_round_s"] and row["second_round_s"] for row in rnd["ttft"]), rnd["ttft"]


# ------------------------------------------------------------------ the faults


@pytest.fixture(scope="module")
def fault_cluster(tmp_path_factory, module_slot, seed_replica) -> Iterator[tuple[Kvctl, dict]]:
    run = _kvctl(tmp_path_factory, "lmcache-faults")
    res = run("launch", "1p1d", "--runtime", "local", "--engine", "v1", "--name", "lmc",
              "--prefill-config", json.dumps(P_CONFIG), "--decode-config", json.dumps(D_CONFIG),
              "--lmcache-l1-size-gb", "0.005", "--json", timeout=LAUNCH_TIMEOUT_S)
    if res.rc != 0:
        run("down", "--name", "lmc")
        pytest.fail(f"launch failed: {res}")
    state = json.loads(res.stdout)
    yield run, state
    assert run("down", "--name", "lmc").rc == 0
    assert live_processes_under(run.home) == []


def test_status_and_logs_show_the_lmcache_server(fault_cluster):
    run, state = fault_cluster
    [(name, rec)] = state["lmcache"].items()
    assert name == "lmcache-prefill" and rec["serves"] == ["prefill"] and rec["options"]["l1_size_gb"] == 0.005
    extra = state["instances"]["prefill"]["kv_transfer_config"]["kv_connector_extra_config"]["connectors"][1]
    assert extra["kv_connector_extra_config"] == {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": rec["port"],
                                                  "lmcache.mp.mq_timeout": MQ_TIMEOUT_S}
    status = json.loads(run("status", "--name", "lmc", "--json").stdout)
    assert status["healthy"] and status["lmcache"][name]["healthy"] is True
    logs = run("logs", "lmcache", "--name", "lmc")
    assert logs.rc == 0 and "LMCache cache server is running" in logs.stdout


def _prompts(tag: str, n: int) -> list[str]:
    """`n` distinct prompts of about 1,150 tokens (four 256-token chunks each; the tiny model takes 2,048)."""
    return [f"{tag} {i}: " + " ".join(f"{tag}{i} word{j}" for j in range(200)) for i in range(n)]


def _verify(run: Kvctl, prompts: list[str], name: str = "lmc") -> tuple[int, dict]:
    args = [a for p in prompts for a in ("--prompt", p)]
    res = run("verify", "--name", name, "--json", *args, timeout=VERIFY_TIMEOUT_S)
    return res.rc, json.loads(res.stdout)


def assert_only_the_offload_child_failed(rc: int, doc: dict) -> None:
    """P served every request (recomputed) and D's answers are right; only `offload_logged`
    failed, naming P's LMCache child and its dead server."""
    assert rc == 1 and doc["passed"] is False
    for req in doc["requests"]:
        checks = _checks(req)
        assert all(checks[n]["passed"] for n in P_D_CHECKS), req
        offload = checks["offload_logged"]
        assert not offload["passed"] and offload.get("observable", True)
        assert offload["evidence"].startswith("P's offload child LMCacheMPConnector (child 1) (LMCache server "
                                              "lmcache-prefill) failed: its server"), offload


def test_l1_full_evicts_then_answers_right(fault_cluster):
    run, state = fault_cluster
    log = Path(state["lmcache"]["lmcache-prefill"]["log_path"])
    rc, doc = _verify(run, _prompts("fill", 8))  # 32 chunks of 256 KB (tiny model, fp32) into a 5 MB L1
    for req in doc["requests"]:
        checks = _checks(req)
        assert all(checks[n]["passed"] for n in P_D_CHECKS), req  # right answers while L1 is full
    assert "triggering eviction" in log.read_text(errors="replace")
    rc, doc = _verify(run, _prompts("after", 1))  # eviction made room: stored again
    assert rc == 0 and all(c["passed"] for c in doc["requests"][0]["checks"]), doc


def test_server_killed_mid_run_p_recomputes_and_verify_names_the_offload_child(fault_cluster):
    run, state = fault_cluster
    os.killpg(state["lmcache"]["lmcache-prefill"]["pid"], signal.SIGKILL)
    assert_only_the_offload_child_failed(*_verify(run, _prompts("killed", 2)))
    status = json.loads(run("status", "--name", "lmc", "--json").stdout)
    assert status["healthy"] is False and status["lmcache"]["lmcache-prefill"]["running"] is False
    assert all(i["healthy"] for i in status["instances"].values())  # the vLLM servers still serve


def test_server_that_never_comes_up_fails_the_launch_naming_it(tmp_path_factory):
    run = _kvctl(tmp_path_factory, "lmcache-never")
    res = run("launch", "1p1d", "--runtime", "local", "--engine", "v1", "--name", "never",
              "--prefill-config", json.dumps(P_CONFIG), "--decode-config", json.dumps(D_CONFIG),
              "--lmcache-l1-size-gb", "100000", "--timeout", "120", "--json", timeout=300)
    assert res.rc == 3, res
    assert "the LMCache server lmcache-prefill exited during start-up" in res.stderr, res
    logs = run.home / "clusters" / "never" / "logs"
    assert (logs / "lmcache-prefill.log").is_file()  # kept for reading
    assert not (logs / "prefill.log").exists()  # no vLLM server was started
    assert not (run.home / "clusters" / "never" / "cluster.json").exists()
    assert live_processes_under(run.home) == []
