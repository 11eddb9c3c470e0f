"""`--runtime docker` against real Docker engines on this machine (issue 5).

- The CPU image: `kvctl image build cpu` finds it by content (instant), and
  the GPU Dockerfile builds FROM it (so docker/Dockerfile.gpu runs in CI).
- 1P1D in CPU containers → `kvctl verify` passes all four checks → `kvctl
  down` leaves no container, network or anonymous volume, and no log follower.
- GPU plumbing without a GPU: a dockerd with a stub nvidia hook gives each
  role's container NVIDIA_VISIBLE_DEVICES = its --gpus entry; a dockerd
  without it refuses, and kvctl says why and leaves nothing behind.
- Two engines (P on the main one, D on an extra dockerd) sharing a host store.
- Failure paths: image missing, port in use, a server exiting during start-up
  (its log tail shown), SIGINT during launch.

Tests skip without an engine or the CPU image, and fail instead under
KVCTL_REQUIRE_DOCKER=1 (CI). Tests that start vLLM take the run-wide
`vllm_slot` and join the "vllm" xdist group: one server pair at a time on
this 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest
from conftest import Kvctl, live_processes_under
from docker_helpers import (
    build_fake_gpu_image,
    ensure_image,
    our_containers,
    second_engine,
    skip_or_fail,
)

from kvctl.verify.checks import CHECKS

pytestmark = pytest.mark.docker

LAUNCH_TIMEOUT_S = 600
VERIFY_TIMEOUT_S = 600
FAKE_GPU_IMAGE = "kvctl-test-fakegpu:1"
# Tests that start vLLM run on the worker of the other vLLM tests (make test: --dist loadgroup).
VLLM_GROUP = pytest.mark.xdist_group("vllm")


def _worker_octet(offset: int) -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return 100 + 10 * int(re.sub(r"\D", "", worker) or 0) + offset


@pytest.fixture(scope="module")
def base_tag(main_engine) -> str:
    """The local Debian base (made by `kvctl image build cpu`); the GPU plumbing tests run on it."""
    import docker.errors

    from kvctl.provision.images import base_tag

    tag = base_tag()
    try:
        main_engine.images.get(tag)
    except docker.errors.ImageNotFound:
        skip_or_fail(f"base image {tag} is not built: run `kvctl image build cpu`")
    return tag


@pytest.fixture
def plain_dockerd(main_engine, base_tag):
    """The second engine, without the nvidia hook, holding the base image."""
    with second_engine(stub_hook=False, subnet_octet=_worker_octet(1)) as d:
        ensure_image(main_engine, d.client, base_tag)
        yield d


@pytest.fixture
def stub_dockerd(main_engine, base_tag):
    """The second engine with a stub nvidia-container-runtime-hook, holding the fake GPU image."""
    import docker.errors

    with second_engine(stub_hook=True, subnet_octet=_worker_octet(2)) as d:
        ensure_image(main_engine, d.client, base_tag)
        try:
            d.client.images.get(FAKE_GPU_IMAGE)
        except docker.errors.ImageNotFound:
            build_fake_gpu_image(d.client, base_tag, FAKE_GPU_IMAGE)
        yield d


def _on(kvctl: Kvctl, engine_url: str | None) -> Kvctl:
    """The same `kvctl` runner, talking to `engine_url` by DOCKER_HOST."""
    run = Kvctl(kvctl.home)
    run.env = dict(kvctl.env)
    if engine_url:
        run.env["DOCKER_HOST"] = engine_url
    else:
        run.env.pop("DOCKER_HOST", None)
    return run


def _assert_nothing_left(home: Path, *clients) -> None:
    for client in clients:
        assert our_containers(client, home) == [], "containers left behind"
        label = f"kvctl.home={home.absolute()}"
        assert client.networks.list(filters={"label": label}) == []
        assert client.volumes.list(filters={"label": label}) == []
    assert live_processes_under(home) == [], "log followers or servers left running"
    assert not list(home.glob("clusters/*/cluster.json")), "cluster state left behind"


def _ready_seconds(stderr: str) -> dict[str, float]:
    return {m[0]: float(m[1]) for m in re.findall(r"(prefill|decode): healthy \(([\d.]+) s\)", stderr)}


# ---- images -------------------------------------------------------------------------

def test_image_build_is_cached_by_content_and_gpu_dockerfile_builds_on_cpu_image(kvctl, main_engine,
                                                                                   cpu_tag):
    first = kvctl("image", "build", "cpu", "--json", timeout=1800)  # CI: already built, cached
    assert first.rc == 0, first
    t0 = time.monotonic()
    r = kvctl("image", "build", "cpu", "--json", timeout=120)
    assert r.rc == 0, r
    doc = json.loads(r.stdout)
    assert doc["tag"] == json.loads(first.stdout)["tag"] and doc["cached"] is True
    assert time.monotonic() - t0 < 30  # hashing and one engine query, no build

    r = kvctl("image", "build", "gpu", "--base-image", cpu_tag, "--json", timeout=1800)
    assert r.rc == 0, r
    gpu = json.loads(r.stdout)
    assert gpu["tag"].startswith("kvctl-gpu:") and gpu["base_image"] == cpu_tag
    labels = main_engine.images.get(gpu["tag"]).labels
    assert labels["kvctl.device"] == "gpu" and labels["kvctl.lmcache"] == "0.3.2"
    assert labels["kvctl.python"] == "/opt/kvctl/venv/bin/python"  # the CPU base's, passed through
    # vLLM's V0 LMCacheConnector now imports LMCache 0.3's module; our plugin is installed.
    out = main_engine.containers.run(
        gpu["tag"], remove=True, entrypoint=["/opt/kvctl/venv/bin/python", "-c",
        "import importlib.metadata as md, importlib.util as u, pathlib;"
        "p = pathlib.Path(u.find_spec('vllm').submodule_search_locations[0]);"
        "t = (p / 'distributed/kv_transfer/kv_connector/lmcache_connector.py').read_text();"
        "print('v1' if 'lmcache.v1.cache_engine' in t and 'lmcache.experimental' not in t else 'old');"
        "print(md.version('lmcache'));"
        "print(sorted(e.name for e in md.entry_points(group='vllm.general_plugins')))"])
    patched, version, plugins = out.decode().split("\n")[:3]
    assert (patched, version) == ("v1", "0.3.2") and "'kvctl_connectors'" in plugins

    r = kvctl("image", "build", "gpu", "--base-image", cpu_tag, "--json", timeout=120)
    assert r.rc == 0 and json.loads(r.stdout)["cached"] is True, r


# ---- input errors (no container starts) ---------------------------------------------

def test_default_image_is_this_checkouts_cpu_image_and_gpu_latest_with_gpus():
    """Launches elsewhere pass --image: the content tag moves whenever a project file changes."""
    from kvctl.provision.images import default_image
    from kvctl.runtime.docker import DockerRuntime
    from kvctl.runtime.docker_options import DockerOptions

    assert DockerRuntime().image_ref() == default_image("cpu")
    assert re.fullmatch(r"kvctl-cpu:[0-9a-f]{16}", default_image("cpu"))
    assert DockerRuntime(DockerOptions(gpus=("0", "1"))).image_ref() == "kvctl-gpu:latest"
    assert DockerRuntime(DockerOptions(image="x:y", gpus=("0", "1"))).image_ref() == "x:y"


def test_missing_image_names_kvctl_image_build(kvctl, kvctl_home, main_engine, tiny_model):
    r = kvctl("launch", "1p1d", "--runtime", "docker", "--model", str(tiny_model),
              "--image", "kvctl-cpu:no-such-tag", "--json")
    assert r.rc == 2, r
    err = json.loads(r.stdout)
    assert "kvctl-cpu:no-such-tag" in err["error"] and "kvctl image build cpu" in err["fix"]
    _assert_nothing_left(kvctl_home, main_engine)


@pytest.mark.parametrize("args,where", [
    (["--runtime", "docker", "--gpus", "0"], "--gpus"),
    (["--runtime", "docker", "--bind", "not-an-ip"], "--bind"),
    (["--runtime", "docker", "--decode-docker-host", "tcp://10.9.8.7:2375"], "--bind"),
    (["--runtime", "local", "--image", "kvctl-cpu:x"], "--runtime"),
])
def test_bad_docker_options_exit_2(args, where, kvctl, tiny_model):
    r = kvctl("launch", "1p1d", "--model", str(tiny_model), *args, "--json")
    assert r.rc == 2, r
    assert where in json.loads(r.stdout)["where"]


def test_port_in_use_shows_the_engines_error_and_leaves_nothing(kvctl_home, main_engine, base_tag,
                                                                 tiny_model):
    """The engine itself refuses the port (the CLI's own pre-check is bypassed here)."""
    from kvctl.errors import RuntimeFailure
    from kvctl.runtime.base import InstanceSpec
    from kvctl.runtime.docker import DockerRuntime
    from kvctl.runtime.docker_options import DockerOptions

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cdir = kvctl_home / "clusters" / "porttest"
        spec = InstanceSpec(cluster="porttest", role="prefill", model=tiny_model,
                            served_model_name="m", dtype="float32", port=port, cwd=cdir,
                            log_path=cdir / "logs" / "prefill.log")
        runtime = DockerRuntime(DockerOptions(image=base_tag), store=cdir / "store")
        with pytest.raises(RuntimeFailure) as e:
            runtime.start(spec)
    assert "container did not start" in e.value.what
    assert re.search(r"address already in use|already allocated", e.value.details), e.value.details
    assert "port" in e.value.fix
    _assert_nothing_left(kvctl_home, main_engine)


# ---- GPU plumbing (extra dockerd instances, no GPU, no vLLM) ---------------------------

def _wait_for_log(path: Path, text: str, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        log = path.read_text()
        if text in log or time.monotonic() > deadline:
            return log
        time.sleep(0.2)


def test_gpu_requests_give_each_role_its_device(kvctl, kvctl_home, stub_dockerd, tiny_model):
    run = _on(kvctl, stub_dockerd.url)
    r = run("launch", "1p1d", "--runtime", "docker", "--image", FAKE_GPU_IMAGE, "--gpus", "1,0",
            "--model", str(tiny_model), "--json", timeout=LAUNCH_TIMEOUT_S)
    assert r.rc == 0, r
    state = json.loads(r.stdout)
    try:
        for role, gpu in (("prefill", "1"), ("decode", "0")):
            rec = state["instances"][role]
            assert rec["engine"] == stub_dockerd.url
            c = stub_dockerd.client.containers.get(rec["container_id"])
            requests = c.attrs["HostConfig"]["DeviceRequests"]
            assert [d["DeviceIDs"] for d in requests] == [[gpu]]
            assert c.labels["kvctl.role"] == role and c.labels["kvctl.cluster.spec"] == "default"
            # What the server process saw, through the log file kvctl streams it into.
            # The log follower streams container output asynchronously: give it a moment.
            log = _wait_for_log(Path(rec["log_path"]), f"fake-vllm NVIDIA_VISIBLE_DEVICES={gpu}\n")
            assert f"fake-vllm NVIDIA_VISIBLE_DEVICES={gpu}\n" in log, log
            assert "--worker-cls" not in log.split("fake-vllm args:")[1].splitlines()[0]  # GPU image
        st = run("status", "--name", "default", "--json")
        assert st.rc == 0 and json.loads(st.stdout)["healthy"] is True, st
        logs = run("logs", "decode", "--tail", "5")
        assert logs.rc == 0 and "fake-vllm NVIDIA_VISIBLE_DEVICES=0" in logs.stdout, logs
    finally:
        down = run("down")
    assert down.rc == 0, down
    _assert_nothing_left(kvctl_home, stub_dockerd.client)


def test_gpu_request_without_nvidia_hook_fails_clearly_and_leaves_nothing(kvctl, kvctl_home, plain_dockerd,
                                                                         base_tag, tiny_model):
    run = _on(kvctl, plain_dockerd.url)
    r = run("launch", "1p1d", "--runtime", "docker", "--image", base_tag, "--gpus", "0,1",
            "--model", str(tiny_model), timeout=LAUNCH_TIMEOUT_S)
    assert r.rc == 3, r
    assert 'could not select device driver "" with capabilities: [[gpu]]' in r.stderr, r
    assert "NVIDIA Container Toolkit" in r.stderr, r
    _assert_nothing_left(kvctl_home, plain_dockerd.client)


# ---- real vLLM in CPU containers ------------------------------------------------------

@VLLM_GROUP
def test_docker_1p1d_verifies_and_down_leaves_nothing(kvctl, kvctl_home, main_engine, cpu_tag, tiny_model,
                                                      vllm_slot):
    volumes_before = {v.name for v in main_engine.volumes.list()}
    t0 = time.monotonic()
    r = kvctl("launch", "1p1d", "--runtime", "docker", "--image", cpu_tag, "--model", str(tiny_model), "--json",
              timeout=LAUNCH_TIMEOUT_S)
    launch_s = time.monotonic() - t0
    assert r.rc == 0, r
    state = json.loads(r.stdout)
    try:
        assert state["runtime"] == "docker"
        print(f"docker launch-to-ready {launch_s:.1f} s; per role: {_ready_seconds(r.stderr)}")
        store = state["store"]
        for role, rec in state["instances"].items():
            c = main_engine.containers.get(rec["container_id"])
            assert c.image.tags and cpu_tag in c.image.tags
            assert c.labels["kvctl.cluster.spec"] == "default" and c.labels["kvctl.role"] == role
            mounts = {m["Destination"]: m for m in c.attrs["Mounts"]}
            assert mounts[str(tiny_model)]["RW"] is False and mounts[store]["RW"] is True
            assert mounts[store]["Source"] == store  # the same store, same path, in P and D
            port = rec["url"].rsplit(":", 1)[1]
            assert c.attrs["HostConfig"]["PortBindings"][f"{port}/tcp"] == [
                {"HostIp": "127.0.0.1", "HostPort": port}]
            assert c.attrs["HostConfig"]["IpcMode"] == "host"
            assert "VLLM_USE_V1=0" in c.attrs["Config"]["Env"]
            assert "connectors.v0.cpu_worker.KVTransferCPUWorker" in c.attrs["Config"]["Cmd"]
        v = kvctl("verify", "--json", timeout=VERIFY_TIMEOUT_S)
        assert v.rc == 0, v
        doc = json.loads(v.stdout)
        assert doc["passed"] is True and doc["requests"]
        for req in doc["requests"]:
            assert [c["name"] for c in req["checks"]] == list(CHECKS)
            assert all(c["passed"] for c in req["checks"]), req["checks"]
        logs = kvctl("logs", "prefill", "--tail", "200")
        assert logs.rc == 0 and "KV send DONE" in logs.stdout, logs
    finally:
        down = kvctl("down", "--json")
    assert down.rc == 0, down
    stopped = json.loads(down.stdout)["stopped"]
    assert sorted(s["role"] for s in stopped) == ["decode", "prefill", "router"]
    assert all(s["was_running"] for s in stopped)
    _assert_nothing_left(kvctl_home, main_engine)
    assert {v.name for v in main_engine.volumes.list()} <= volumes_before  # no anonymous volume


@VLLM_GROUP
def test_two_engines_share_a_host_store(kvctl, kvctl_home, main_engine, plain_dockerd, cpu_tag, tiny_model,
                                        tmp_path, vllm_slot):
    t0 = time.monotonic()
    if ensure_image(main_engine, plain_dockerd.client, cpu_tag):
        print(f"CPU image copied to the second engine in {time.monotonic() - t0:.0f} s")
    store = tmp_path / "shared-store"
    r = kvctl("launch", "1p1d", "--runtime", "docker", "--image", cpu_tag, "--model", str(tiny_model), "--store", str(store),
              "--decode-docker-host", plain_dockerd.url, "--json", timeout=LAUNCH_TIMEOUT_S)
    assert r.rc == 0, r
    state = json.loads(r.stdout)
    try:
        p, d = state["instances"]["prefill"], state["instances"]["decode"]
        assert d["engine"] == plain_dockerd.url and p["engine"] != plain_dockerd.url
        assert main_engine.containers.get(p["container_id"]).status == "running"
        assert plain_dockerd.client.containers.get(d["container_id"]).status == "running"
        v = kvctl("verify", "--json", timeout=VERIFY_TIMEOUT_S)
        assert v.rc == 0, v
        assert all(c["passed"] for req in json.loads(v.stdout)["requests"] for c in req["checks"])
        assert list(store.glob("*.safetensors")), "P's entries must be in the shared host dir"
    finally:
        down = kvctl("down")
    assert down.rc == 0, down
    _assert_nothing_left(kvctl_home, main_engine, plain_dockerd.client)


@VLLM_GROUP
def test_server_exiting_during_startup_shows_its_log_tail(kvctl, kvctl_home, main_engine, cpu_tag, tiny_model,
                                                          vllm_slot):
    r = kvctl("launch", "1p1d", "--runtime", "docker", "--image", cpu_tag, "--model", str(tiny_model),
              "--prefill-arg=--no-such-vllm-flag", timeout=LAUNCH_TIMEOUT_S)
    assert r.rc == 3, r
    assert re.search(r"the prefill server container \S+ exited with code [1-9]", r.stderr), r
    assert "unrecognized arguments: --no-such-vllm-flag" in r.stderr, r  # from the log tail
    _assert_nothing_left(kvctl_home, main_engine)


@VLLM_GROUP
def test_sigint_during_launch_leaves_nothing(kvctl, kvctl_home, main_engine, cpu_tag, tiny_model, vllm_slot):
    p = kvctl.popen("launch", "1p1d", "--runtime", "docker", "--image", cpu_tag, "--model", str(tiny_model))
    try:
        deadline = time.monotonic() + 120
        while len([c for c in our_containers(main_engine, kvctl_home) if c.status == "running"]) < 2:
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "containers did not start"
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    _assert_nothing_left(kvctl_home, main_engine)
