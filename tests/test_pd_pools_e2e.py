"""A 2P2D cluster behind kvctl's router: `kvctl launch pd --prefill 2 --decode 2`.

Four real vLLM V0 servers from the CPU rig, sharing one store, and the real
router process launch starts in front of them. `status` lists the four
instances with role and url; requests through the endpoint with the `openai`
SDK all answer what P alone generates (the baseline); each P and each D
served at least one of them (the router's `routed ... prefill=NAME
decode=NAME` lines and its X-Kvctl-* headers agree), each D from the store;
`logs NAME` reads one instance; `down` stops all five processes.

`kvctl verify` through the endpoint follows each request to the P and D the
router's headers name (their logs hold its send and skip lines, and the
router's own log agrees) and counts the requests each instance served, in
load mode too; with
decode-1 frozen (SIGSTOP: once its /health has timed out for the router's grace,
30 s, the router marks it unhealthy and skips it), the
requests still pass but the run fails naming decode-1.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from conftest import Kvctl, group_alive, pid_alive
from e2e_helpers import slot_lock_path, send_through_endpoint

from kvctl.router.config import HEALTH_GRACE_S
from kvctl.router.route_log import parse_route_line

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm")]

LAUNCH_TIMEOUT_S = 900  # four servers on a small machine
PROMPT = "Four servers, one store, one endpoint: where does this prompt's KV cache go?"
NAMES = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "decode-1": "decode"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shared_dir, rig_python, tiny_model):
    """One 2P2D cluster for the module, launched by the CLI, holding the run-wide vLLM slot."""
    home = tmp_path_factory.mktemp("pools-home")
    kvctl = Kvctl(home)
    with open(slot_lock_path(shared_dir), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        r = kvctl("launch", "pd", "--prefill", "2", "--decode", "2", "--name", "pools",
                  "--model", str(tiny_model), "--timeout", str(LAUNCH_TIMEOUT_S), "--json",
                  timeout=LAUNCH_TIMEOUT_S + 120)
        assert r.rc == 0, r
        try:
            yield kvctl, json.loads(r.stdout)
        finally:
            kvctl("down", "--name", "pools")


def test_status_lists_each_instance_with_role_and_url(cluster):
    kvctl, state = cluster
    assert {n: i["role"] for n, i in state["instances"].items()} == NAMES
    st = json.loads(kvctl("status", "--name", "pools", "--json").stdout)
    assert {n: i["role"] for n, i in st["instances"].items()} == NAMES
    urls = {i["url"] for i in st["instances"].values()}
    assert len(urls) == 4 and all(u.startswith("http://127.0.0.1:") for u in urls)
    assert all(i["healthy"] for i in st["instances"].values()) and st["endpoint_healthy"] is True
    store = state["store"]
    assert {i["kv_transfer_config"]["kv_connector_extra_config"]["fs_storage_path"]
            for i in state["instances"].values()} == {store}  # one store for all four
    routed = httpx.get(f"{state['endpoint']}/kvctl/instances").json()["instances"]
    assert {i["name"]: i["role"] for i in routed} == NAMES


def _skips(log: str) -> int:
    return Path(log).read_text().count("skip model forwarding")


def test_requests_through_the_endpoint_reach_every_instance_and_match_the_baseline(cluster):
    kvctl, state = cluster
    inst = state["instances"]
    skips = {n: _skips(inst[n]["log_path"]) for n in ("decode-0", "decode-1")}
    sent = send_through_endpoint(state, PROMPT, 4)
    served = sent.served
    assert {p for _, p, _ in served} == {"prefill-0", "prefill-1"}, served
    assert {d for _, _, d in served} == {"decode-0", "decode-1"}, served

    by_id = sent.records
    for request_id, p, d in served:  # the router's log names the same P and D for each request
        assert (by_id[request_id].prefill, by_id[request_id].decode) == (p, d)
    # every D served its requests from the store, and each request id is in its P's and D's log
    assert sum(_skips(inst[n]["log_path"]) - skips[n] for n in skips) == 4
    for request_id, p, d in served:
        assert request_id in Path(inst[p]["log_path"]).read_text()
        assert request_id in Path(inst[d]["log_path"]).read_text()


VERIFY_TIMEOUT_S = 900
VERIFY_PROMPTS = [f"Pool request {i}: which prefill and which decode served me?" for i in range(4)]


def _verify(kvctl: Kvctl, *extra: str):
    args = [a for p in VERIFY_PROMPTS for a in ("--prompt", p)]
    return kvctl("verify", "--name", "pools", "--max-tokens", "8", *args, *extra, timeout=VERIFY_TIMEOUT_S)


def _router_health(state: dict) -> dict[str, bool]:
    return {i["name"]: i["healthy"]
            for i in httpx.get(f"{state['endpoint']}/kvctl/instances", timeout=10).json()["instances"]}


def _wait_health(state: dict, name: str, healthy: bool, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while _router_health(state)[name] is not healthy:
        assert time.monotonic() < deadline, f"the router never saw {name} healthy={healthy}"
        time.sleep(0.5)


def test_verify_through_the_endpoint_follows_each_request_to_its_instances(cluster):
    kvctl, state = cluster
    inst = state["instances"]
    router_log = Path(state["router"]["log_path"])
    seen_lines = len(router_log.read_text().splitlines())
    t0 = time.monotonic()
    r = _verify(kvctl, "--json")
    print(f"verify of {len(VERIFY_PROMPTS)} requests through the router: {time.monotonic() - t0:.1f} s")
    assert r.rc == 0, r
    doc = json.loads(r.stdout)
    assert doc["passed"] is True and doc["run_failures"] == [] and doc["instance_notes"] == []
    assert {n: v["role"] for n, v in doc["instances"].items()} == NAMES
    assert all(v["served"] >= 1 for v in doc["instances"].values()), doc["instances"]
    assert sum(v["served"] for v in doc["instances"].values()) == 2 * len(VERIFY_PROMPTS)

    routed = {rec.id: rec for line in router_log.read_text().splitlines()[seen_lines:]
              if (rec := parse_route_line(line)) is not None}
    for req in doc["requests"]:
        assert req["instances_from"] == "headers" and req["passed"], req
        p, d, key = req["prefill_instance"], req["decode_instance"], req["key"]
        assert (routed[req["request_id"]].prefill, routed[req["request_id"]].decode) == (p, d)  # router agrees
        other_p = next(n for n in NAMES if NAMES[n] == "prefill" and n != p)
        other_d = next(n for n in NAMES if NAMES[n] == "decode" and n != d)
        p_log, d_log = Path(inst[p]["log_path"]).read_text(), Path(inst[d]["log_path"]).read_text()
        assert f"KV send DONE. key={key}" in p_log  # (prefill-0 logs it too: the baseline runs there)
        assert any(key in line for line in d_log.splitlines() if "skip model forwarding" in line)
        assert key not in Path(inst[other_d]["log_path"]).read_text()
        assert req["request_id"] in p_log and req["request_id"] in d_log  # one id reached both...
        for other in (other_p, other_d):  # ...and no other instance
            assert req["request_id"] not in Path(inst[other]["log_path"]).read_text()

    human = _verify(kvctl)
    assert human.rc == 0, human
    assert "requests served: prefill-0" in human.stdout and "decode-1" in human.stdout

    # load mode: through the router too (the default), every response checked, counted per instance
    t0 = time.monotonic()
    load = kvctl("verify", "--name", "pools", "--requests", "8", "--concurrency", "4", "--max-tokens", "8",
                 "--json", timeout=VERIFY_TIMEOUT_S)
    print(f"load mode, 8 requests at concurrency 4 through the router: {time.monotonic() - t0:.1f} s")
    assert load.rc == 0, load
    doc = json.loads(load.stdout)
    assert doc["load"]["num_errors"] == 0 and doc["load"]["num_mismatches"] == 0 and doc["run_failures"] == []
    assert all(r["instances_from"] == "headers" and r["passed"] for r in doc["requests"])
    assert all(v["served"] >= 1 for v in doc["instances"].values()) and set(doc["instances"]) == set(NAMES)


def test_verify_fails_naming_a_decode_that_never_served(cluster, tmp_path):
    kvctl, state = cluster
    pid = state["instances"]["decode-1"]["pid"]
    os.kill(pid, signal.SIGSTOP)  # decode-1's API server stops answering: its /health times out
    try:
        _wait_health(state, "decode-1", False, timeout_s=HEALTH_GRACE_S + 60)  # down once the grace has passed
        junit = tmp_path / "verify.xml"
        r = _verify(kvctl, "--json", "--junit-xml", str(junit))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert r.rc == 1, r
    doc = json.loads(r.stdout)
    assert all(req["passed"] for req in doc["requests"]), doc["requests"]  # every request was fine...
    assert doc["passed"] is False  # ...but one instance of the pool never served
    assert [(f["check"], f["instance"]) for f in doc["run_failures"]] == [("instance_served", "decode-1")]
    assert "decode-1 served none of the 4 requests" in doc["run_failures"][0]["reason"]
    assert doc["instances"]["decode-1"]["served"] == 0 and doc["instances"]["decode-0"]["served"] == 4
    assert 'type="NeverServed"' in junit.read_text()
    _wait_health(state, "decode-1", True)  # it answers again once resumed


def test_logs_reads_one_instance(cluster):
    kvctl, state = cluster
    rec = state["instances"]["decode-1"]
    r = kvctl("logs", "decode-1", "--name", "pools")
    assert r.rc == 0, r
    lines = r.stdout.splitlines()
    assert lines == Path(rec["log_path"]).read_text().splitlines()[:len(lines)]  # the log only grows
    assert f"--port {rec['url'].rsplit(':', 1)[1]} " in lines[0]  # decode-1's own server
    ambiguous = kvctl("logs", "prefill", "--name", "pools")
    assert ambiguous.rc == 2 and "prefill-0, prefill-1" in ambiguous.stderr, ambiguous


def test_down_stops_all_five_processes(cluster):
    kvctl, state = cluster
    d = kvctl("down", "--name", "pools", "--json")
    assert d.rc == 0, d
    stopped = json.loads(d.stdout)["stopped"]
    assert {s["instance"] for s in stopped} == {*NAMES, "router"}
    assert {s["role"] for s in stopped} == {"prefill", "decode", "router"}
    assert not pid_alive(state["router"]["pid"])
    for name, rec in state["instances"].items():
        assert not group_alive(rec["pid"]), name
