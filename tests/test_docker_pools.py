"""xPyD pools on the docker runtime: `kvctl launch pd --prefill N --decode M --runtime docker`.

Light (no engine, no container): GPU lists per instance, in order or by name,
with their errors (count mismatch, unknown or missing instance, mixed forms);
the docker spec of a pool (`build_pd_spec` with runtime docker, as scenarios
use it) and each instance's container config: its own name, labels, port and
device request, one shared store mount, no device request on the cpu image.

Docker (real dockerd, the CPU image, real vLLM V0 servers in containers, the
real router process, the `openai` SDK): a 2P1D cluster answers through its
endpoint, every instance serves, status and logs work per instance, and down
leaves no container, follower or router. A half-started pool (one role's
containers failing, or the launching kvctl killed with SIGKILL) leaves nothing
once launch has cleaned up or `kvctl down` has run.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import live_processes_under, pid_alive
from docker_helpers import our_containers
from e2e_helpers import send_through_endpoint

from kvctl.cluster.lifecycle import instance_specs
from kvctl.cluster.spec import build_1p1d_spec, build_pd_spec
from kvctl.errors import BadInput
from kvctl.net import free_ports
from kvctl.runtime.docker import DockerRuntime, container_name
from kvctl.runtime.docker_options import default_gpu_lists, docker_options, gpu_lists, parse_gpus

LAUNCH_TIMEOUT_S = 900  # three vLLM containers on a 2-core machine
NAMES = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"}
PROMPT = "Three containers, one store, one endpoint: where does this prompt's KV cache go?"
CPU_LABELS = {"kvctl.python": "/opt/kvctl/venv/bin/python"}
GPU_LABELS = {**CPU_LABELS, "kvctl.device": "gpu"}


# ---- GPU lists (light) ------------------------------------------------------------------

POOL = ("prefill-0", "prefill-1", "decode-0")


def test_gpu_lists_in_order_or_by_name():
    assert gpu_lists(parse_gpus("0,1"), ("prefill", "decode")) == {"prefill": ["0"], "decode": ["1"]}
    assert gpu_lists(parse_gpus("0+1,2,3"), POOL) == {
        "prefill-0": ["0", "1"], "prefill-1": ["2"], "decode-0": ["3"]}
    # by name, in any order, repeated options (a list) or one comma-separated value, spaces allowed
    named = parse_gpus(["decode-0=2+3", "prefill-1 = 1", "prefill-0=0"])
    assert gpu_lists(named, POOL) == {"prefill-0": ["0"], "prefill-1": ["1"], "decode-0": ["2", "3"]}
    assert gpu_lists(parse_gpus("prefill=1,decode=0"), ("prefill", "decode")) == {
        "prefill": ["1"], "decode": ["0"]}
    assert default_gpu_lists(POOL) == {"prefill-0": ["0"], "prefill-1": ["1"], "decode-0": ["2"]}


@pytest.mark.parametrize("value, names, message", [
    ("0,1", POOL, "2 GPU lists for 3 instances (prefill-0, prefill-1, decode-0)"),
    ("0", ("prefill", "decode"), "1 GPU list for 2 instances (prefill, decode)"),
    ("prefill-0=0,prefill-1=1,decode-0=2,decode-1=3", POOL, "GPUs for decode-1: no such instance"),
    ("prefill=0,decode=1", POOL, "GPUs for prefill, decode: no such instance"),
    ("prefill-0=0,decode-0=1", POOL, "no GPUs for prefill-1"),
])
def test_gpu_lists_that_do_not_match_the_instances_are_refused(value, names, message):
    with pytest.raises(BadInput) as e:
        gpu_lists(parse_gpus(value), names)
    assert message in e.value.what and e.value.fields == ("gpus",)
    assert all(n in e.value.what + e.value.fix for n in names)  # the error lists the instances


@pytest.mark.parametrize("value, message", [
    ("0,x", "not a GPU list: 'x'"), ("0,,1", "not a GPU list: ''"), ("=1", "not a GPU list: '=1'"),
    ("prefill-0=a", "not a GPU list"), ("0,decode-0=1", "mix names and positions"),
    ("decode-0=1,decode-0=2", "GPUs given twice for decode-0"),
])
def test_malformed_gpu_lists_are_refused(value, message):
    with pytest.raises(BadInput) as e:
        parse_gpus(value)
    assert message in e.value.what and e.value.fields == ("gpus",)


@pytest.mark.parametrize("gpus, message", [
    (["0,1"], "2 GPU lists for 3 instances (prefill-0, prefill-1, decode-0)"),
    (["prefill-0=0", "prefill-1=1", "decode-9=2"], "GPUs for decode-9: no such instance"),
])
def test_launch_pd_refuses_gpu_lists_naming_the_flag(kvctl, kvctl_home, model_dir, gpus, message):
    args = [a for g in gpus for a in ("--gpus", g)]
    r = kvctl("launch", "pd", "--prefill", "2", "--decode", "1", "--runtime", "docker", "--name", "g",
              "--model", str(model_dir), *args, "--json")
    assert r.rc == 2, r
    err = json.loads(r.stdout)
    assert err["where"] == "--gpus" and message in err["error"], err
    assert not (kvctl_home / "clusters" / "g").exists()


# ---- the docker spec of a pool (light: spec objects, no engine) -------------------------

def _configs(spec, labels):
    runtime = DockerRuntime.for_cluster(spec)
    return {n: runtime.container_config(s, "img:1", labels) for n, s in instance_specs(spec).items()}


def test_docker_pool_spec_gives_each_instance_its_container_port_and_gpus(kvctl_home, model_dir):
    spec = build_pd_spec(prefill=2, decode=1, name="dp", runtime="docker", model=model_dir,
                         docker=docker_options(gpus=["prefill-0=0", "prefill-1=1", "decode-0=2+3"]))
    assert spec.runtime == "docker" and [p.name for p in spec.instances()] == list(NAMES)
    configs = _configs(spec, GPU_LABELS)
    cdir = kvctl_home / "clusters" / "dp"
    assert {n: c["name"] for n, c in configs.items()} == {n: container_name("dp", n, cdir) for n in NAMES}
    assert len({c["name"] for c in configs.values()}) == 3
    for name, c in configs.items():
        assert c["labels"] == {"kvctl.cluster.spec": "dp", "kvctl.role": NAMES[name], "kvctl.instance": name,
                               "kvctl.home": str(kvctl_home.absolute())}
        (port,) = c["ports"]
        assert c["ports"][port] == ("127.0.0.1", int(port.split("/")[0]))
        mounts = {m["Target"]: m for m in c["mounts"]}
        assert mounts[str(spec.store)]["Source"] == str(spec.store) and not mounts[str(spec.store)]["ReadOnly"]
        assert mounts[str(model_dir)]["ReadOnly"] is True
        assert "--worker-cls" not in c["command"]  # the GPU image runs vLLM's own worker
    assert len({p for c in configs.values() for p in c["ports"]}) == 3  # one port each
    assert {n: c["device_requests"][0]["DeviceIDs"] for n, c in configs.items()} == {
        "prefill-0": ["0"], "prefill-1": ["1"], "decode-0": ["2", "3"]}


def test_docker_pool_on_the_cpu_image_has_no_device_request(kvctl_home, model_dir):
    """The CPU rig has no GPU: no list given, the cpu image -> no device request at all."""
    spec = build_pd_spec(prefill=1, decode=2, name="cpu", runtime="docker", model=model_dir,
                         docker=docker_options())
    configs = _configs(spec, CPU_LABELS)
    assert list(configs) == ["prefill-0", "decode-0", "decode-1"]
    assert all(c["device_requests"] is None for c in configs.values())
    assert all("connectors.v0.cpu_worker.KVTransferCPUWorker" in c["command"] for c in configs.values())
    # each server keeps its own core bind, as on the local runtime
    binds = [c["environment"].get("VLLM_CPU_OMP_THREADS_BIND") for c in configs.values()]
    assert all(binds) and binds == [p.cpu_bind for p in spec.instances()]


def test_gpu_image_without_lists_gives_instance_i_device_i(kvctl_home, model_dir):
    spec = build_pd_spec(prefill=2, decode=2, name="gd", runtime="docker", model=model_dir,
                         docker=docker_options())
    configs = _configs(spec, GPU_LABELS)
    assert [c["device_requests"][0]["DeviceIDs"] for c in configs.values()] == [["0"], ["1"], ["2"], ["3"]]


def test_1p1d_keeps_its_gpus_form_and_container_names(kvctl_home, model_dir):
    spec = build_1p1d_spec(name="one", runtime="docker", model=model_dir, docker=docker_options(gpus="1,0"))
    configs = _configs(spec, GPU_LABELS)
    assert {n: c["device_requests"][0]["DeviceIDs"] for n, c in configs.items()} == {
        "prefill": ["1"], "decode": ["0"]}
    assert configs["prefill"]["name"].startswith("kvctl-one-prefill-")
    with pytest.raises(BadInput) as e:
        build_1p1d_spec(name="one", runtime="docker", model=model_dir, docker=docker_options(gpus="0"))
    assert e.value.fields == ("gpus",) and "1 GPU list for 2 instances (prefill, decode)" in e.value.what


def test_a_scenario_with_pools_plans_a_docker_pool(kvctl_home, model_dir, tmp_path):
    """Scenarios (`prefill: N`) launch docker pools through build_pd_spec, as `kvctl launch pd` does."""
    from kvctl.scenario.runner import plan_scenario
    from kvctl.scenario.schema import load_scenario

    path = tmp_path / "docker-pool.yaml"
    path.write_text(f"name: docker-pool\nruntime: docker\nmodel: {model_dir}\nprefill: 2\ndecode: 1\n"
                    "prompts: [Hello]\n")
    spec = plan_scenario(load_scenario(str(path))).spec
    assert spec.runtime == "docker" and spec.docker is not None
    configs = _configs(spec, CPU_LABELS)
    assert {n: c["labels"]["kvctl.instance"] for n, c in configs.items()} == {n: n for n in NAMES}
    assert len({c["name"] for c in configs.values()}) == 3


def test_ctrl_c_while_the_router_starts_stops_it(tmp_path, monkeypatch):
    """The launch has no record of the router until it is healthy: an interrupt then must stop it."""
    from kvctl.cluster import router_process

    started = []
    real_popen = router_process.subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(router_process.subprocess, "Popen", popen)
    monkeypatch.setattr(router_process.httpx.Client, "get", interrupted)
    port = free_ports(1)[0]
    with pytest.raises(KeyboardInterrupt):
        router_process.start_router({"prefill-0": ("prefill", "http://127.0.0.1:9"),
                                     "decode-0": ("decode", "http://127.0.0.1:9")}, tmp_path, port)
    (proc,) = started
    assert proc.wait(timeout=10) is not None and not pid_alive(proc.pid)


# ---- real containers ------------------------------------------------------------------

def _assert_nothing_left(home: Path, client) -> None:
    assert our_containers(client, home) == [], "containers left behind"
    assert live_processes_under(home) == [], "log followers, servers or the router left running"
    assert not list(home.glob("clusters/*/cluster.json")), "cluster state left behind"


def _ready_seconds(stderr: str) -> dict[str, float]:
    return {m[0]: float(m[1]) for m in re.findall(r"([a-z]+-\d+): healthy \(([\d.]+) s\)", stderr)}


def _skips(log: str) -> int:
    return Path(log).read_text().count("skip model forwarding")


@pytest.mark.docker
@pytest.mark.xdist_group("vllm")
def test_docker_2p1d_behind_the_router_serves_from_every_instance_and_down_leaves_nothing(
        kvctl, kvctl_home, main_engine, cpu_tag, tiny_model, vllm_slot):
    t0 = time.monotonic()
    r = kvctl("launch", "pd", "--prefill", "2", "--decode", "1", "--runtime", "docker", "--image", cpu_tag,
              "--name", "dpool", "--model", str(tiny_model), "--timeout", str(LAUNCH_TIMEOUT_S), "--json",
              timeout=LAUNCH_TIMEOUT_S + 120)
    launch_s = time.monotonic() - t0
    assert r.rc == 0, r
    state = json.loads(r.stdout)
    try:
        print(f"docker 2P1D launch-to-ready {launch_s:.1f} s (router included); "
              f"per instance: {_ready_seconds(r.stderr)}")
        assert state["runtime"] == "docker" and state["endpoint"] == state["router"]["url"]
        assert pid_alive(state["router"]["pid"])
        inst = state["instances"]
        assert {n: i["role"] for n, i in inst.items()} == NAMES
        for name, rec in inst.items():
            c = main_engine.containers.get(rec["container_id"])
            assert c.status == "running" and c.name == rec["container_name"] and name in c.name
            assert c.labels["kvctl.instance"] == name and c.labels["kvctl.role"] == NAMES[name]
            assert c.attrs["HostConfig"]["DeviceRequests"] in (None, [])  # CPU rig: no GPU list
            assert {m["Destination"] for m in c.attrs["Mounts"]} >= {state["store"]}  # one shared store
            assert rec["gpus"] is None

        st = kvctl("status", "--name", "dpool", "--json")
        assert st.rc == 0, st
        doc = json.loads(st.stdout)
        assert doc["endpoint"] == state["endpoint"] and doc["endpoint_healthy"] is True and doc["healthy"]
        assert {n: (i["role"], i["url"]) for n, i in doc["instances"].items()} == {
            n: (NAMES[n], inst[n]["url"]) for n in NAMES}
        assert all(i["url"].startswith("http://127.0.0.1:") and i["healthy"] for i in doc["instances"].values())

        skips = _skips(inst["decode-0"]["log_path"])
        sent = send_through_endpoint(state, PROMPT, 4, stream=True, baseline_timeout=300)
        served, records = sent.served, sent.records
        assert {p for _, p, _ in served} == {"prefill-0", "prefill-1"}, served
        assert {d for _, _, d in served} == {"decode-0"}, served
        for request_id, p, d in served:  # the router's log, and each container's log, name the request
            assert (records[request_id].prefill, records[request_id].decode) == (p, d)
            assert request_id in Path(inst[p]["log_path"]).read_text()
            assert request_id in Path(inst[d]["log_path"]).read_text()
        assert _skips(inst["decode-0"]["log_path"]) - skips == 5  # D served all five from the store

        for name in NAMES:  # logs NAME: that instance's container log
            logs = kvctl("logs", name, "--name", "dpool", "--tail", "400")
            assert logs.rc == 0, logs
            full = Path(inst[name]["log_path"]).read_text()
            assert full.startswith(f"kvctl: starting {name} container {inst[name]['container_name']}")
            assert any(rid in logs.stdout for rid, p, d in served if name in (p, d)), name
        router_logs = kvctl("logs", "router", "--name", "dpool", "--tail", "50")
        assert router_logs.rc == 0 and "routed id=" in router_logs.stdout, router_logs
        ambiguous = kvctl("logs", "prefill", "--name", "dpool")
        assert ambiguous.rc == 2 and "prefill-0, prefill-1" in ambiguous.stderr, ambiguous
    finally:
        down = kvctl("down", "--name", "dpool", "--json")
    assert down.rc == 0, down
    stopped = json.loads(down.stdout)["stopped"]
    assert {s["instance"] for s in stopped} == {*NAMES, "router"}
    assert {s["role"] for s in stopped} == {"prefill", "decode", "router"}
    assert not pid_alive(state["router"]["pid"])
    _assert_nothing_left(kvctl_home, main_engine)


@pytest.mark.docker
@pytest.mark.xdist_group("vllm")
def test_docker_pool_with_a_failing_role_cleans_up_every_container(kvctl, kvctl_home, main_engine, cpu_tag,
                                                                   tiny_model, vllm_slot):
    """decode-0 exits at once (a bad flag) while prefill-0 and prefill-1 are starting: launch stops all."""
    r = kvctl("launch", "pd", "--prefill", "2", "--decode", "1", "--runtime", "docker", "--image", cpu_tag,
              "--name", "half", "--model", str(tiny_model), "--decode-arg=--no-such-vllm-flag",
              timeout=LAUNCH_TIMEOUT_S)
    assert r.rc == 3, r
    assert re.search(r"the decode-0 server container \S+ exited with code [1-9]", r.stderr), r
    assert "unrecognized arguments: --no-such-vllm-flag" in r.stderr, r
    _assert_nothing_left(kvctl_home, main_engine)


@pytest.mark.docker
@pytest.mark.xdist_group("vllm")
def test_down_removes_a_pool_whose_launch_was_killed(kvctl, kvctl_home, main_engine, cpu_tag, tiny_model,
                                                     vllm_slot):
    """SIGKILL: the launching kvctl cleans nothing up; `kvctl down` must find every container."""
    p = kvctl.popen("launch", "pd", "--prefill", "1", "--decode", "2", "--runtime", "docker",
                    "--image", cpu_tag, "--name", "killed", "--model", str(tiny_model))
    try:
        deadline = time.monotonic() + 120
        while len([c for c in our_containers(main_engine, kvctl_home) if c.status == "running"]) < 2:
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "containers did not start"
            time.sleep(0.2)
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert our_containers(main_engine, kvctl_home), "the killed launch left its containers (as expected)"
    down = kvctl("down", "--name", "killed", "--json")
    assert down.rc == 0, down
    _assert_nothing_left(kvctl_home, main_engine)
