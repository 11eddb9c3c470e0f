"""Docker test helpers: the engine, the CPU image, and extra dockerd instances.

Tests that need Docker call `require_docker()` (or take the fixtures below):
they skip when no engine answers or the CPU image is missing, and FAIL instead
when KVCTL_REQUIRE_DOCKER=1 (CI, where `make docker-ready` provides both).

`ExtraDockerd` starts another dockerd on this machine with its own socket,
data root, exec root, pidfile, containerd namespace and bridge (no iptables:
published ports go through docker's userland proxy), optionally with a stub
`nvidia-container-runtime-hook` first on its PATH, which makes dockerd accept
GPU requests and set NVIDIA_VISIBLE_DEVICES without a GPU (brief section 6).
`stop()` removes its containers, stops it, deletes its bridge and temp dirs.
`second_engine()` runs one on a persistent data root under a lock, so images
copied there (`ensure_image`) are reused by later tests and runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REQUIRE_DOCKER = os.environ.get("KVCTL_REQUIRE_DOCKER") == "1"
DOCKERD_START_S = 60.0
DOCKERD_STOP_S = 30.0
# The second engine's images live here between runs (the CPU image is ~7 GB).
SECOND_ENGINE_ROOT = Path(os.environ.get("KVCTL_TEST_DOCKER_CACHE", "/var/tmp/kvctl-test-dockerd"))
STUB_HOOK = "#!/bin/sh\n# kvctl test stub: accepts the OCI prestart hook call and does nothing\nexit 0\n"


def skip_or_fail(why: str) -> None:
    if REQUIRE_DOCKER:
        pytest.fail(f"docker test cannot run (KVCTL_REQUIRE_DOCKER=1): {why}")
    pytest.skip(why)


def engine_client() -> Any:
    """A client of the default engine (DOCKER_HOST or the local socket); skips/fails without one."""
    from kvctl.errors import KvctlError
    from kvctl.runtime.docker_engine import connect

    try:
        return connect(None)
    except KvctlError as e:
        skip_or_fail(f"no Docker engine: {e.what} (scripts/ensure-docker.sh starts one)")


def cpu_image(client: Any, engine: str = "v0") -> str:
    """This checkout's CPU image tag of vLLM `engine`, which must already exist (tests never build it).

    $KVCTL_TEST_CPU_IMAGE (v0) or $KVCTL_TEST_CPU_IMAGE_V1 (v1) overrides it: for working in a
    checkout others edit, where the content tag moves with every saved file.
    """
    import docker.errors

    from kvctl.provision.images import default_image

    override = "KVCTL_TEST_CPU_IMAGE" + ("" if engine == "v0" else f"_{engine.upper()}")
    tag = os.environ.get(override) or default_image("cpu", engine)
    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        skip_or_fail(f"CPU image {tag} is not built: run `kvctl image build cpu"
                     + ("`" if engine == "v0" else f" --engine {engine}`"))
    return tag


def our_containers(client: Any, home: Path) -> list[Any]:
    """Containers (any state) labelled with this KVCTL_HOME."""
    return client.containers.list(all=True, filters={"label": f"kvctl.home={home.absolute()}"},
                                  ignore_removed=True)  # one removed while listing is gone


def transfer_image(src: Any, dst: Any, ref: str) -> None:
    """Copy image `ref` from engine `src` to `dst` (docker save | docker load, streamed)."""
    timeouts = src.api.timeout, dst.api.timeout
    src.api.timeout = dst.api.timeout = None  # ~7 GB for the CPU image: minutes
    try:
        dst.images.load(src.images.get(ref).save(named=True))
    finally:
        src.api.timeout, dst.api.timeout = timeouts


class ExtraDockerd:
    """One more dockerd on this machine; see the module docstring.

    `data_root` None: a temp data root, removed by stop(); else that dir, kept.
    """

    def __init__(self, name: str, stub_hook: bool, subnet_octet: int, data_root: Path | None = None):
        # Short paths: unix socket paths are limited to 108 bytes.
        self.root = Path(tempfile.mkdtemp(prefix=f"kvd-{name}-", dir="/tmp"))
        self.data_root = data_root or self.root / "data"
        self.own_data = data_root is None
        self.sock = self.root / "docker.sock"
        self.url = f"unix://{self.sock}"
        self.bridge = f"kvb{os.getpid() % 100000}{name[:4]}"[:15]
        self.subnet = f"10.213.{subnet_octet}"
        self.namespace = f"kvctl-test-{name}"
        self.stub_hook = stub_hook
        self.log = self.root / "dockerd.log"
        self.proc: subprocess.Popen | None = None
        self.client: Any = None

    def start(self) -> ExtraDockerd:
        from kvctl.errors import KvctlError
        from kvctl.runtime.docker_engine import connect

        if shutil.which("dockerd") is None:
            skip_or_fail("dockerd is not installed (scripts/ensure-docker.sh installs it)")
        env = dict(os.environ)
        env.pop("DOCKER_HOST", None)
        if self.stub_hook:
            bindir = self.root / "bin"
            bindir.mkdir()
            hook = bindir / "nvidia-container-runtime-hook"
            hook.write_text(STUB_HOOK)
            hook.chmod(0o755)
            env["PATH"] = f"{bindir}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        subprocess.run(["ip", "link", "del", self.bridge], stderr=subprocess.DEVNULL, check=False)
        subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], check=True)
        subprocess.run(["ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge], check=True)
        subprocess.run(["ip", "link", "set", self.bridge, "up"], check=True)
        argv = ["dockerd", "--host", self.url, "--data-root", str(self.data_root),
                "--exec-root", str(self.root / "x"), "--pidfile", str(self.root / "dockerd.pid"),
                "--bridge", self.bridge, "--iptables=false", "--ip-masq=false",
                "--containerd-namespace", self.namespace,
                "--containerd-plugins-namespace", self.namespace + "-plugins"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + DOCKERD_START_S
        while True:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                self.stop()
                pytest.fail(f"extra dockerd exited with {self.proc.returncode}:\n{tail}")
            try:
                self.client = connect(self.url)
                return self
            except KvctlError:
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"extra dockerd did not answer within {DOCKERD_START_S} s")
                time.sleep(0.3)

    def stop(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                for c in self.client.containers.list(all=True):
                    c.remove(force=True, v=True)
            with contextlib.suppress(Exception):
                self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # dockerd and its containerd
            try:
                self.proc.wait(DOCKERD_STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        subprocess.run(["ip", "link", "del", self.bridge], stderr=subprocess.DEVNULL, check=False)
        _unmount_under(self.root)
        _unmount_under(self.data_root)
        shutil.rmtree(self.root, ignore_errors=True)  # with a temp data root, that too


def _unmount_under(root: Path) -> None:
    """Unmount anything a killed dockerd left mounted under `root` (deepest first)."""
    try:
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return
    for target in sorted((m for m in mounts if m.startswith(str(root) + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], stderr=subprocess.DEVNULL, check=False)


@contextlib.contextmanager
def second_engine(stub_hook: bool, subnet_octet: int = 201) -> Iterator[ExtraDockerd]:
    """A second dockerd on a persistent data root (SECOND_ENGINE_ROOT), one user at a time.

    Its images survive between runs, so the CPU image (~7 GB) is copied there
    once per machine, not per test; `stub_hook` picks how this start sees GPUs.
    """
    SECOND_ENGINE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(SECOND_ENGINE_ROOT / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other xdist workers and runs wait here
        d = ExtraDockerd("second", stub_hook, subnet_octet, data_root=SECOND_ENGINE_ROOT / "data")
        try:
            yield d.start()
        finally:
            d.stop()


def ensure_image(src: Any, dst: Any, ref: str) -> bool:
    """Copy `ref` from engine `src` to `dst` unless it is there; drop other tags of its repo
    on `dst` (layers they share stay). Returns True when it copied."""
    import docker.errors

    try:
        dst.images.get(ref)
        return False
    except docker.errors.ImageNotFound:
        pass
    transfer_image(src, dst, ref)  # first: layers `dst` already has are not written again
    repo = ref.rsplit(":", 1)[0]
    for img in dst.images.list(name=repo):
        for tag in img.tags:
            if tag != ref:
                with contextlib.suppress(docker.errors.APIError):
                    dst.images.remove(tag)
    return True


# A stand-in for vLLM's OpenAI server, for the GPU plumbing test only (no GPU,
# no vLLM): it answers /health and prints the GPU variables the container got.
FAKE_SERVER = r'''
import http.server, os, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
print("fake-vllm NVIDIA_VISIBLE_DEVICES=%s" % os.environ.get("NVIDIA_VISIBLE_DEVICES"), flush=True)
print("fake-vllm args: %s" % " ".join(sys.argv[1:]), flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("0.0.0.0", port), H).serve_forever()
'''

FAKE_DOCKERFILE = """\
FROM {base}
COPY vllm/ /opt/fake/vllm/
ENV PYTHONPATH=/opt/fake
LABEL kvctl.device=gpu kvctl.python=/usr/bin/python3
"""


def build_fake_gpu_image(client: Any, base: str, tag: str) -> str:
    """An image whose `python -m vllm.entrypoints.openai.api_server` is FAKE_SERVER."""
    import io
    import tarfile

    files = {"Dockerfile": FAKE_DOCKERFILE.format(base=base),
             "vllm/__init__.py": "", "vllm/entrypoints/__init__.py": "",
             "vllm/entrypoints/openai/__init__.py": "",
             "vllm/entrypoints/openai/api_server.py": FAKE_SERVER}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    client.images.build(fileobj=buf, custom_context=True, tag=tag, rm=True, forcerm=True)
    return tag
