"""Cluster lifecycle on the local runtime: launch, status, logs, down, and every way
a launch can end early (server crash, timeout, Ctrl-C, SIGTERM, bad input).

The e2e tests start real vLLM servers from the CPU rig with the tiny model,
through `kvctl` subprocesses, and check with /proc that nothing is left
running. The process-group tests use real `sleep` processes as stand-ins for
servers, so down's SIGTERM/SIGKILL logic is checked in seconds.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from conftest import group_alive, live_processes_under, pid_alive

from kvctl.cluster.spec import build_1p1d_spec
from kvctl.cluster.state import ClusterState, InstanceRecord, load_cluster, save_cluster, utc_now
from kvctl.cluster.lifecycle import down, running_cluster
from kvctl.net import free_ports
from kvctl.runtime import get_runtime
from kvctl.runtime.local import server_tmp_dir
from kvctl.runtime.processes import process_start_ticks


def e2e(test):
    """Starts real vLLM servers: slow, and one pair at a time under --dist loadgroup."""
    return pytest.mark.xdist_group("vllm")(pytest.mark.e2e(test))


LAUNCH_TIMEOUT_S = 600  # subprocess limit; servers take 15-60 s here
PLAIN = ("--worker-cls", "auto", "--prefill-config", "none", "--decode-config", "none")
TOP_LEVEL = {"name", "runtime", "model", "served_model_name", "store", "created", "endpoint", "router",
             "instances", "store_signed"}  # launch keys the store by default


def assert_nothing_left(home: Path, pids: list[int] = ()) -> None:
    for pid in pids:
        assert not pid_alive(pid), f"server pid {pid} still running"
        assert not group_alive(pid), f"process group {pid} still has {group_alive(pid)}"
    assert live_processes_under(home) == []


def wait_for_state(home: Path, name: str, roles: int, timeout: float = 60) -> dict:
    path = home / "clusters" / name / "cluster.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = json.loads(path.read_text())
            if len(state["instances"]) == roles:
                return state
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"{path} did not list {roles} instances within {timeout} s")


# ---------------------------------------------------------------- e2e (rig)

@e2e
def test_launch_status_chat_logs_down(kvctl, kvctl_home, rig_python, tiny_model, vllm_slot):
    r = kvctl("launch", "1p1d", "--runtime", "auto", "--name", "lc", "--model", str(tiny_model),
              "--json", timeout=LAUNCH_TIMEOUT_S)
    assert r.rc == 0, r
    state = json.loads(r.stdout)  # exactly one JSON object on stdout
    assert set(state) == TOP_LEVEL and state["store_signed"] is True
    assert state["name"] == "lc" and state["runtime"] == "local"
    assert state["model"] == str(tiny_model) and state["served_model_name"] == tiny_model.name
    cdir = kvctl_home / "clusters" / "lc"
    assert state["store"] == str(cdir / "store") and Path(state["store"]).is_dir()
    assert set(state["instances"]) == {"prefill", "decode"}
    for role, want in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        inst = state["instances"][role]
        assert inst["role"] == role and inst["url"].startswith("http://127.0.0.1:")
        assert isinstance(inst["pid"], int) and pid_alive(inst["pid"])
        assert Path(inst["log_path"]).is_file() and inst["cwd"] == str(cdir)
        assert inst["kv_transfer_config"] == {
            "kv_connector": "FSConnector", "kv_role": want,
            "kv_connector_extra_config": {"fs_storage_path": state["store"]}}
    assert json.loads((cdir / "cluster.json").read_text()) == state
    pids = [i["pid"] for i in state["instances"].values()]
    assert "healthy" in r.stderr and "runtime: local (auto:" in r.stderr
    # each server's temp files (vLLM's IPC sockets, torch's file store) go to a dir of its own
    tmp_dirs = []
    for inst in state["instances"].values():
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{inst['pid']}/environ").read_text().split("\0") if "=" in kv)
        tmp_dirs.append(Path(env["TMPDIR"]))
        assert tmp_dirs[-1] == server_tmp_dir(Path(inst["log_path"])) and tmp_dirs[-1].is_dir()
        assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(tempfile.gettempdir() + "/torchinductor_")
    assert len(set(tmp_dirs)) == 2

    # A second launch under a running name is refused before anything starts.
    again = kvctl("launch", "1p1d", "--runtime", "local", "--name", "lc", "--model", str(tiny_model))
    assert again.rc == 2, again
    # Library fixes name no CLI flag: the command to run, and the cluster by name.
    assert "already exists and is running" in again.stderr and "tear cluster 'lc' down first" in again.stderr
    assert "`kvctl down`" in again.stderr
    assert json.loads((cdir / "cluster.json").read_text()) == state

    st = kvctl("status", "--name", "lc", "--json")
    assert st.rc == 0, st
    status = json.loads(st.stdout)
    assert status["healthy"] is True
    assert all(i["running"] and i["healthy"] for i in status["instances"].values())
    listing = json.loads(kvctl("status", "--json").stdout)
    assert [c["name"] for c in listing["clusters"]] == ["lc"]
    human = kvctl("status")
    assert human.rc == 0 and "healthy" in human.stdout and "lc" in human.stdout

    # Both servers answer the chat completion a person would send with curl.
    for role in ("prefill", "decode"):
        resp = httpx.post(f"{state['instances'][role]['url']}/v1/chat/completions", timeout=60, json={
            "model": state["served_model_name"], "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello, how are you?"}]})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"]

    logs = kvctl("logs", "decode", "--name", "lc", "--tail", "5")
    assert logs.rc == 0, logs
    assert 0 < len(logs.stdout.splitlines()) <= 5
    full = kvctl("logs", "prefill", "--name", "lc")
    assert full.stdout.startswith("kvctl: starting prefill server:") and "/v1/chat/completions" in full.stdout

    d = kvctl("down", "--name", "lc", "--json")
    assert d.rc == 0, d
    report = json.loads(d.stdout)
    assert report["found"] is True and report["removed"] == str(cdir)
    assert sorted(s["role"] for s in report["stopped"]) == ["decode", "prefill", "router"]
    assert all(s["was_running"] for s in report["stopped"])
    assert not any(d.exists() for d in tmp_dirs)
    assert not cdir.exists()
    assert_nothing_left(kvctl_home, pids)

    again = kvctl("down", "--name", "lc")  # idempotent
    assert again.rc == 0 and "nothing to tear down" in again.stderr
    gone = kvctl("status", "--name", "lc")
    assert gone.rc == 2 and "no cluster named 'lc'" in gone.stderr


@e2e
def test_crashing_server_fails_launch_with_log_tail(kvctl, kvctl_home, rig_python, tiny_model,
                                                    vllm_slot):
    r = kvctl("launch", "1p1d", "--runtime", "local", "--name", "bad", "--model", str(tiny_model),
              *PLAIN, "--prefill-arg=--no-such-vllm-flag", timeout=LAUNCH_TIMEOUT_S)
    assert r.rc == 3, r
    assert "the prefill server exited with code" in r.stderr
    assert "last " in r.stderr and "lines of the prefill log" in r.stderr
    assert "unrecognized arguments: --no-such-vllm-flag" in r.stderr  # vLLM's own words, from the tail
    assert not (kvctl_home / "clusters" / "bad" / "cluster.json").exists()
    assert (kvctl_home / "clusters" / "bad" / "logs" / "prefill.log").is_file()  # kept for reading
    assert_nothing_left(kvctl_home)
    assert json.loads(kvctl("status", "--json").stdout) == {"clusters": [], "damaged": []}


@e2e
def test_timeout_fails_launch_and_replaces_stale_state(kvctl, kvctl_home, rig_python, tiny_model,
                                                      vllm_slot):
    # Stale state under the same name (its process is long gone) must not block a launch.
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    save_cluster(ClusterState("slow", "local", str(tiny_model), "m", str(kvctl_home / "s"), utc_now(), {
        "prefill": InstanceRecord("prefill", "http://127.0.0.1:1", str(kvctl_home / "x.log"), None,
                                  str(kvctl_home), {"pid": dead.pid, "start_ticks": 1})}))
    r = kvctl("launch", "1p1d", "--runtime", "local", "--name", "slow", "--model", str(tiny_model),
              *PLAIN, "--timeout", "3", timeout=LAUNCH_TIMEOUT_S)
    assert r.rc == 3, r
    assert "server was not healthy after 3 s" in r.stderr and "raise the timeout" in r.stderr
    assert not (kvctl_home / "clusters" / "slow" / "cluster.json").exists()
    assert_nothing_left(kvctl_home)


@e2e
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_during_launch_leaves_nothing(sig, kvctl, kvctl_home, rig_python, tiny_model, vllm_slot):
    proc = kvctl.popen("launch", "1p1d", "--runtime", "local", "--name", "intr",
                       "--model", str(tiny_model), *PLAIN)
    try:
        state = wait_for_state(kvctl_home, "intr", roles=2)
        pids = [i["pid"] for i in state["instances"].values()]
        time.sleep(3)  # servers are importing vLLM now
        assert all(pid_alive(p) for p in pids)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    assert not (kvctl_home / "clusters" / "intr" / "cluster.json").exists()
    assert_nothing_left(kvctl_home, pids)


@e2e
def test_running_cluster_always_tears_down(kvctl_home, rig_python, tiny_model, vllm_slot):
    spec = build_1p1d_spec(name="ctx", model=tiny_model, prefill_config=None, decode_config=None,
                           worker_cls=None, timeout_s=LAUNCH_TIMEOUT_S)
    pids = []
    with pytest.raises(RuntimeError, match="scenario step failed"):
        with running_cluster(spec, keep_store=True) as state:
            pids = [r.runtime_fields["pid"] for r in state.instances.values()]
            assert all(pid_alive(p) for p in pids)
            (Path(state.store) / "entry").write_text("kept")
            raise RuntimeError("scenario step failed")
    assert_nothing_left(kvctl_home, pids)
    cdir = kvctl_home / "clusters" / "ctx"
    assert [p.name for p in cdir.iterdir()] == ["store"]  # state and logs gone, store kept
    assert (cdir / "store" / "entry").read_text() == "kept"


# ------------------------------------------- down on stand-in processes (no rig)

def _spawn_group(script: str) -> subprocess.Popen:
    """A shell in its own process group with children, like a server with workers."""
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    deadline = time.monotonic() + 5
    while len(group_alive(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def _save_fake(home: Path, name: str, procs: dict[str, subprocess.Popen], start_ticks_delta: int = 0) -> None:
    save_cluster(ClusterState(name, "local", "/m", "m", str(home / "clusters" / name / "store"), utc_now(), {
        role: InstanceRecord(role, "http://127.0.0.1:9", str(home / f"{role}.log"), None, str(home),
                             {"pid": p.pid, "start_ticks": process_start_ticks(p.pid) + start_ticks_delta})
        for role, p in procs.items()}))
    (home / "clusters" / name / "store").mkdir()


def test_down_stops_whole_process_groups(kvctl, kvctl_home):
    procs = {"prefill": _spawn_group("sleep 300 & sleep 300; wait"),
             "decode": _spawn_group("sleep 300 & sleep 300; wait")}
    try:
        _save_fake(kvctl_home, "fake", procs)
        st = kvctl("status", "--name", "fake", "--json")
        assert st.rc == 1, st  # running but not answering /health
        assert all(i["running"] and not i["healthy"] for i in json.loads(st.stdout)["instances"].values())
        d = kvctl("down", "--name", "fake", "--keep-store", "--json")
        assert d.rc == 0, d
        report = json.loads(d.stdout)
        assert {s["signal"] for s in report["stopped"]} == {"SIGTERM"}
        for p in procs.values():
            assert p.wait(timeout=5) is not None
            assert group_alive(p.pid) == []
        assert [x.name for x in (kvctl_home / "clusters" / "fake").iterdir()] == ["store"]
    finally:
        for p in procs.values():
            if group_alive(p.pid):
                os.killpg(p.pid, signal.SIGKILL)


def test_down_escalates_to_sigkill(kvctl_home):
    # SIG_IGN survives exec: the shell and its sleeps all ignore SIGTERM.
    proc = _spawn_group("trap '' TERM; sleep 300 & sleep 300; wait")
    try:
        _save_fake(kvctl_home, "stubborn", {"prefill": proc})
        t0 = time.monotonic()
        report = down("stubborn", grace_s=1)
        assert 1 <= time.monotonic() - t0 < 10
        assert [(s.signal, s.was_running) for s in report.stopped] == [("SIGKILL", True)]
        assert group_alive(proc.pid) == []
        assert proc.wait(timeout=5) == -signal.SIGKILL
        assert not (kvctl_home / "clusters" / "stubborn").exists()
        assert down("stubborn").found is False  # idempotent
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def test_down_never_kills_a_recycled_pid(kvctl, kvctl_home):
    proc = _spawn_group("sleep 300 & sleep 300; wait")
    try:
        _save_fake(kvctl_home, "recycled", {"prefill": proc}, start_ticks_delta=-1)  # "another" process
        d = kvctl("down", "--name", "recycled", "--json")
        assert d.rc == 0, d
        assert json.loads(d.stdout)["stopped"][0]["was_running"] is False
        assert pid_alive(proc.pid) and len(group_alive(proc.pid)) >= 2
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_kill_sigkills_the_whole_group_at_once_and_never_a_recycled_pid(kvctl_home):
    """Instance.kill (what the fault bench injects): SIGKILL to the process group, no grace."""
    stubborn = _spawn_group("trap '' TERM; sleep 300 & sleep 300; wait")  # only SIGKILL ends it
    other = _spawn_group("sleep 300 & sleep 300; wait")
    try:
        _save_fake(kvctl_home, "victim", {"prefill": stubborn})
        state = load_cluster("victim")
        rec = state.instances["prefill"]
        runtime = get_runtime(state.runtime)
        inst = runtime.attach("prefill", rec.role, rec.url, Path(rec.log_path), rec.runtime_fields)
        assert (inst.name, inst.role) == ("prefill", "prefill")
        t0 = time.monotonic()
        inst.kill()
        assert stubborn.wait(timeout=5) == -signal.SIGKILL and time.monotonic() - t0 < 5  # no SIGTERM grace
        deadline = time.monotonic() + 5
        while group_alive(stubborn.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group_alive(stubborn.pid) == []
        recycled = runtime.attach("decode", "decode", "", Path(rec.log_path),
                                  {"pid": other.pid, "start_ticks": process_start_ticks(other.pid) - 1})
        recycled.kill()  # the pid is "someone else's" now: left alone
        time.sleep(0.2)
        assert len(group_alive(other.pid)) >= 2
    finally:
        for p in (stubborn, other):
            if group_alive(p.pid):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def test_logs_tail_and_follow_until_the_server_exits(kvctl, kvctl_home):
    proc = _spawn_group("sleep 300 & sleep 300; wait")
    try:
        _save_fake(kvctl_home, "f", {"prefill": proc})
        log = kvctl_home / "prefill.log"
        log.write_text("".join(f"line {i}\n" for i in range(10)))
        r = kvctl("logs", "prefill", "--name", "f", "--tail", "3")
        assert r.rc == 0 and r.stdout.splitlines() == ["line 7", "line 8", "line 9"], r
        r = kvctl("logs", "prefill-0", "--name", "f", "--tail", "1")  # the pools' name of a 1P1D's prefill
        assert r.rc == 0 and r.stdout.splitlines() == ["line 9"], r
        r = kvctl("logs", "prefill-1", "--name", "f")
        assert r.rc == 2 and "prefill-1" in r.stderr, r
        follower = kvctl.popen("logs", "prefill", "--name", "f", "--follow", "--tail", "1")
        ready, _, _ = select.select([follower.stdout], [], [], 30)
        assert ready and follower.stdout.readline() == "line 9\n"  # following now
        with open(log, "a") as f:
            f.write("line 10\nline 11\n")
        time.sleep(1)
        assert follower.poll() is None  # still following while the server runs
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = follower.communicate(timeout=20)  # ends by itself once the server is gone
        assert follower.returncode == 0, err
        assert out.splitlines() == ["line 10", "line 11"]
        bad = kvctl("logs", "router", "--name", "f")
        assert bad.rc == 2 and "router" in bad.stderr
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


# ------------------------------------------------------------- bad input (no rig)

def test_unknown_cluster_names_the_existing_ones(kvctl, kvctl_home):
    r = kvctl("status", "--name", "nope")
    assert r.rc == 2, r
    # The library's fix names no CLI flag: it says what to launch, by name.
    assert "no cluster named 'nope'" in r.stderr and "launch a cluster named 'nope'" in r.stderr
    assert "kvctl launch 1p1d" in r.stderr
    assert "Traceback" not in r.stderr
    save_cluster(ClusterState("other", "local", "/m", "m", "/s", utc_now(), {}))
    for args in (("status", "--name", "nope"), ("logs", "prefill", "--name", "nope")):
        r = kvctl(*args)
        assert r.rc == 2, r
        assert "no cluster named 'nope'" in r.stderr and "one of: other" in r.stderr
    j = kvctl("status", "--name", "nope", "--json")
    assert j.rc == 2 and json.loads(j.stdout)["error"] == "no cluster named 'nope'"


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


BAD_LAUNCHES = [
    (["--model", "/no/such/model"], "--model", "model directory not found"),
    (["--prefill-config", "{not json"], "--prefill-config", "not valid JSON"),
    (["--decode-config", "[1, 2]"], "--decode-config", "must be a JSON object"),
    (["--prefill-config", "@/no/such/file.json"], "--prefill-config", "cannot read"),
    (["--prefill-config", '{"kv_connector":"NoSuchConnector","kv_role":"kv_producer"}'],
     "--prefill-config", "invalid kv-transfer-config"),
    (["--prefill-port", "BUSY"], "--prefill-port", "is not available"),
    (["--prefill-port", "FREE", "--decode-port", "FREE"], "--prefill-port, --decode-port",
     "cannot both use port"),
    (["--runtime", "podman"], "--runtime", "unknown runtime"),
    (["--name", "../evil"], "--name", "invalid cluster name"),
    (["--timeout", "0"], "--timeout", "timeout must be positive"),
    (["--decode-env", "NOEQUALS"], "--decode-env", "expected KEY=VALUE"),
    (["--router-host", "localhost:80"], "--router-host", "is not an IP address"),
    (["--router-host", "203.0.113.7"], "--router-host", "cannot listen on"),
    (["--router-port", "BUSY"], "--router-port", "is not available"),
    (["--no-router", "--router-port", "FREE"], "--router-port", "no router is started"),
]


@pytest.fixture
def free_port():
    return free_ports(1)[0]


@pytest.mark.parametrize("args,where,what", BAD_LAUNCHES, ids=[w + ":" + m for _, w, m in BAD_LAUNCHES])
def test_bad_launch_input_exits_2_and_starts_nothing(args, where, what, kvctl, kvctl_home, tiny_model,
                                                      busy_port, free_port):
    args = [{"BUSY": str(busy_port), "FREE": str(free_port)}.get(a, a) for a in args]
    if "--model" not in args:
        args += ["--model", str(tiny_model)]
    r = kvctl("launch", "1p1d", *args)
    assert r.rc == 2, r
    assert what in r.stderr and f"where: {where}" in r.stderr and "fix:" in r.stderr, r
    assert "Traceback" not in r.stderr
    assert list(kvctl_home.glob("clusters/*/cluster.json")) == []
    assert live_processes_under(kvctl_home) == []


def test_bad_input_json_mode_prints_one_error_object(kvctl, kvctl_home):
    r = kvctl("launch", "1p1d", "--model", "/no/such/model", "--json")
    assert r.rc == 2, r
    err = json.loads(r.stdout)
    assert err["where"] == "--model" and err["exit_code"] == 2 and "not found" in err["error"]


def test_launch_with_a_rig_override_that_points_nowhere_installs_nothing(kvctl, kvctl_home, tiny_model):
    """A missing rig is installed first, except when KVCTL_RIG_PYTHON names one: that is the user's to fix."""
    kvctl.env["KVCTL_RIG_PYTHON"] = "/nonexistent/python"
    r = kvctl("launch", "1p1d", "--model", str(tiny_model))
    assert r.rc == 2, r
    assert "KVCTL_RIG_PYTHON" in r.stderr and "Traceback" not in r.stderr
    assert "installing" not in r.stderr and not (kvctl_home / "rigs").exists()
    assert not (kvctl_home / "clusters" / "default" / "cluster.json").exists()
