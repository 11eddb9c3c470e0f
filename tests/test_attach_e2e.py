"""Attach on real vLLM servers: a cluster launched as `src` is attached again as a cluster
kvctl did not start, from its URLs, log files and store, and verified; `down` refuses it,
`detach` forgets it, and `src` keeps running throughout.

One module-scoped launch serves every test here (this machine has 2 cores, and the
servers take the run-wide vLLM slot for as long as the module runs).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e2e_helpers import slot_lock_path
from conftest import Kvctl, live_processes_under

from kvctl.attach.attach import detach_cluster
from kvctl.cluster.lifecycle import down
from kvctl.cluster.state import list_clusters, load_cluster


def e2e(test):
    return pytest.mark.xdist_group("vllm")(pytest.mark.e2e(test))


LAUNCH_TIMEOUT_S = 600
VERIFY_TIMEOUT_S = 300
PROMPTS = ("--prompt", "Hello, how are you?", "--prompt", "Grüße aus Köln")


@pytest.fixture(scope="module")
def src(tmp_path_factory, shared_dir, rig_python, tiny_model) -> Iterator[tuple[Kvctl, dict]]:
    """`kvctl launch 1p1d --name src`, held for the module; torn down (and every attachment forgotten) after."""
    home = tmp_path_factory.mktemp("attach-e2e-home")
    kvctl = Kvctl(home)
    previous = os.environ.get("KVCTL_HOME")
    os.environ["KVCTL_HOME"] = str(home)  # for the library calls of the teardown
    with open(slot_lock_path(shared_dir), "w") as slot:
        fcntl.flock(slot, fcntl.LOCK_EX)
        try:
            r = kvctl("launch", "1p1d", "--name", "src", "--model", str(tiny_model), "--json",
                      timeout=LAUNCH_TIMEOUT_S)
            assert r.rc == 0, r
            yield kvctl, json.loads(r.stdout)
        finally:
            for name in list_clusters():
                if load_cluster(name).managed:
                    down(name)
                else:
                    detach_cluster(name)
            if previous is None:
                os.environ.pop("KVCTL_HOME", None)
            else:
                os.environ["KVCTL_HOME"] = previous
            assert live_processes_under(home) == []


def _attach(kvctl: Kvctl, state: dict, name: str, *, logs: tuple[str, str] | None = None,
            store: bool = True) -> dict:
    p, d = state["instances"]["prefill"], state["instances"]["decode"]
    p_log, d_log = logs or (p["log_path"], d["log_path"])
    args = ["attach", name, "--prefill", p["url"], "--decode", d["url"], "--prefill-log", p_log,
            "--decode-log", d_log, "--json"]
    if store:
        args += ["--store", state["store"]]
    r = kvctl(*args)
    assert r.rc == 0, r
    return json.loads(r.stdout)


@e2e
def test_attach_from_urls_and_log_files_verifies_then_detaches(src):
    kvctl, state = src
    attached = _attach(kvctl, state, "other")
    assert attached["managed"] is False and attached["served_model_name"] == state["served_model_name"]
    assert attached["store"] == state["store"] and attached["notes"] == []

    r = kvctl("status", "--name", "other", "--json")
    assert r.rc == 0, r
    assert json.loads(r.stdout)["healthy"] is True

    r = kvctl("verify", "--name", "other", *PROMPTS, "--max-tokens", "8", "--json", timeout=VERIFY_TIMEOUT_S)
    assert r.rc == 0, r
    report = json.loads(r.stdout)
    assert report["cluster"] == "other" and report["passed"] is True
    assert all(c["passed"] for req in report["requests"] for c in req["checks"])

    r = kvctl("inspect-store", "--name", "other", "--json")
    assert r.rc == 0 and json.loads(r.stdout)["entries"], r

    r = kvctl("down", "--name", "other")
    assert r.rc == 2 and "was attached, not started by kvctl" in r.stderr, r
    r = kvctl("detach", "other")
    assert r.rc == 0 and "its servers keep running" in r.stderr, r
    assert "other" not in list_clusters()
    for inst in state["instances"].values():  # `src` was never touched
        assert httpx.get(f"{inst['url']}/health", timeout=5).status_code == 200


@e2e
def test_attach_with_log_commands_verifies(src, tmp_path):
    """The logs as commands' output (as `kubectl logs -f` would give them), captured while verify runs."""
    kvctl, state = src
    p, d = state["instances"]["prefill"]["log_path"], state["instances"]["decode"]["log_path"]
    attached = _attach(kvctl, state, "tailed", logs=(f"cmd:tail -n0 -F {p}", f"cmd:tail -n0 -F {d}"))
    assert attached["instances"]["decode"]["log_source"] == f"cmd:tail -n0 -F {d}"
    r = kvctl("verify", "--name", "tailed", *PROMPTS, "--max-tokens", "8", "--json", timeout=VERIFY_TIMEOUT_S)
    assert r.rc == 0, r
    report = json.loads(r.stdout)
    assert report["passed"] is True and report["not_observable"] == {}
    captured = Path(attached["instances"]["prefill"]["log_path"])
    assert "KV send DONE" in captured.read_text() and "Uvicorn running" not in captured.read_text()
    assert not [line for line in live_processes_under(Path(p).parent) if "tail -n0 -F" in line]
    assert kvctl("detach", "tailed").rc == 0


@e2e
def test_attach_without_a_visible_store_reports_its_check_not_observable(src):
    kvctl, state = src
    attached = _attach(kvctl, state, "nostore", store=False)
    assert attached["store"] is None and any("store" in n for n in attached["notes"])
    r = kvctl("verify", "--name", "nostore", *PROMPTS, "--max-tokens", "8", "--json", timeout=VERIFY_TIMEOUT_S)
    assert r.rc == 1, r  # --require all (the default): what kvctl could not see is no pass
    report = json.loads(r.stdout)
    assert list(report["not_observable"]) == ["store_entry_written"]
    for req in report["requests"]:
        checks = {c["name"]: c for c in req["checks"]}
        assert checks["store_entry_written"]["observable"] is False and not checks["store_entry_written"]["passed"]
        assert all(c["passed"] for n, c in checks.items() if n != "store_entry_written"), checks
    r = kvctl("verify", "--name", "nostore", *PROMPTS, "--max-tokens", "8", "--require", "observable",
              timeout=VERIFY_TIMEOUT_S)
    assert r.rc == 0 and "store_entry_written not observable" in r.stdout, r
    assert kvctl("detach", "nostore").rc == 0


@e2e
def test_verify_through_the_router_endpoint(src):
    """Requests through kvctl's router in front of the same P and D, checked like direct ones."""
    from kvctl.cluster.router_process import router_instance, start_router
    from kvctl.net import free_ports

    kvctl, state = src
    p, d = state["instances"]["prefill"], state["instances"]["decode"]
    # kvctl's own router start (it waits, bounded, for /health), as a launch does
    record = start_router({"prefill": ("prefill", p["url"]), "decode": ("decode", d["url"])},
                          kvctl.home / "routed-router", free_ports(1)[0])
    endpoint = record["url"]
    try:
        r = kvctl("attach", "routed", "--prefill", p["url"], "--decode", d["url"], "--prefill-log", p["log_path"],
                  "--decode-log", d["log_path"], "--store", state["store"], "--endpoint", endpoint)
        assert r.rc == 0, r
        r = kvctl("verify", "--name", "routed", "--via-endpoint", *PROMPTS, "--max-tokens", "8", "--json",
                  timeout=VERIFY_TIMEOUT_S)
        assert r.rc == 0, r
        report = json.loads(r.stdout)
        assert report["passed"] is True and report["not_observable"] == {}
        assert kvctl("detach", "routed").rc == 0
    finally:
        router_instance(record).stop(10.0)
