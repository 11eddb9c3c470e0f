"""Shared fixtures: the rig, the tiny model, a tmp KVCTL_HOME and a `kvctl` runner.

Tests that need the CPU rig use the `rig_python` fixture: the interpreter
running the tests, when it has torch and vLLM and imports this checkout's
connectors from anywhere, i.e. the venv layered on the rig that `make
test-env` makes (.venv/rig: the read-only rig's packages plus this checkout
and the test dependencies). It skips otherwise, and fails instead when
KVCTL_REQUIRE_RIG=1 (CI). Servers that kvctl starts get this checkout's code
through its overlay either way. Tests that start vLLM servers also take
`vllm_slot`, so that only one server pair runs at a time on this 2-core
machine, even under pytest-xdist.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvctl.runtime.processes import group_members, is_alive, processes_under

REQUIRE_RIG = os.environ.get("KVCTL_REQUIRE_RIG") == "1"


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so fixtures tear clusters down."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    def __str__(self) -> str:  # what a failing assert shows
        return f"rc={self.rc}\n--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-6000:]}"

    __repr__ = __str__


def _shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dir all xdist workers of this run share (the parent of each worker's basetemp)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _shared_dir(tmp_path_factory)


def _find_rig() -> tuple[Path | None, str]:
    """This interpreter when it can run rig-side tests, else None and why.

    It must have torch and vLLM, and import our connectors (and see their
    plugin entry point) from its own packages, not from the current directory:
    tests start servers with it elsewhere.
    """
    here = Path(__file__).resolve().parent.parent
    fix = (f"run the tests in the venv layered on the rig: `make test-env` in {here}, "
           f"then {here}/.venv/rig/bin/python -m pytest ...")
    missing = [m for m in ("torch", "vllm") if importlib.util.find_spec(m) is None]
    if missing:
        return None, f"{sys.executable} has no {' or '.join(missing)}; {fix}"
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as md, connectors.plugin; "
         "assert 'kvctl_connectors' in [e.name for e in md.entry_points(group='vllm.general_plugins')]; "
         "print(connectors.plugin.__file__)"],
        cwd="/", capture_output=True, text=True)
    ours = str(here / "connectors" / "plugin.py")
    if probe.returncode != 0 or probe.stdout.strip() != ours:
        return None, (f"{sys.executable} does not have this checkout installed "
                      f"(connectors.plugin: {probe.stdout.strip() or probe.stderr.strip()[-300:]}); {fix}")
    return Path(sys.executable), ""


_RIG = _find_rig()  # resolved once, before any test points KVCTL_HOME elsewhere


def _find_real_model() -> tuple[Path | None, str]:
    """The catalog's first real model, converted once per machine under the real
    KVCTL_HOME (`make real-model`, which `make test` runs first), like the rig."""
    from kvctl.provision import model_catalog, model_get

    entry = model_catalog.lookup(model_catalog.DEFAULT_REAL_MODEL)
    got = model_get.cached(entry)
    if got is None:
        return None, (f"{entry.name} is not converted under {model_get.models_dir()}: "
                      f"run `make real-model` (or `kvctl model get {entry.name}`)")
    return got.path, ""


_REAL_MODEL = _find_real_model()  # resolved with the real KVCTL_HOME, as _RIG is


@pytest.fixture(scope="session")
def rig_python() -> Path:
    """A python with the CPU rig and this checkout. Skips without; fails when KVCTL_REQUIRE_RIG=1."""
    python, why = _RIG
    if python is None:
        if REQUIRE_RIG:
            pytest.fail(f"CPU rig missing (KVCTL_REQUIRE_RIG=1): {why}")
        pytest.skip(f"CPU rig missing: {why}")
    return python


@pytest.fixture(scope="session")
def tiny_model(shared_dir: Path) -> Path:
    """The tiny random Llama, written once per test run (file lock: xdist workers share it)."""
    from kvctl.provision.tiny_model import write_model

    out = shared_dir / "tiny-model"
    with open(shared_dir / "tiny-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        write_model(out)  # returns at once when it is already there
    return out


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct as `kvctl model get` converted it (never converted by a test).
    Skips without it; fails when KVCTL_REQUIRE_RIG=1 (CI: `make test` gets it first)."""
    path, why = _REAL_MODEL
    if path is None:
        if REQUIRE_RIG:
            pytest.fail(f"real model missing (KVCTL_REQUIRE_RIG=1): {why}")
        pytest.skip(f"real model missing: {why}")
    return path


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A directory that passes the model check (config.json); nothing is started with it."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture(scope="module")
def main_engine():
    """This host's Docker engine (docker tests only: the import needs the docker SDK)."""
    from docker_helpers import engine_client

    return engine_client()


@pytest.fixture(scope="module")
def cpu_tag(main_engine) -> str:
    """This checkout's CPU image on the main engine (docker_helpers.cpu_image)."""
    from docker_helpers import cpu_image

    return cpu_image(main_engine)


@pytest.fixture
def vllm_slot(shared_dir: Path) -> Iterator[None]:
    """Hold the run-wide lock for starting vLLM servers (one pair at a time)."""
    from e2e_helpers import slot_lock_path

    with open(slot_lock_path(shared_dir), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def live_processes_under(root: Path) -> list[str]:
    """Live (non-zombie) processes whose cwd or command line is inside `root`: "PID: COMMAND"."""
    return [f"{pid}: {cmd[:200]}" for pid, cmd in processes_under(root)]


# The runtime's own psutil readings: a test asks the same question the runtime does.
pid_alive = is_alive
group_alive = group_members


class Kvctl:
    """Runs `kvctl` as a subprocess with this test's KVCTL_HOME (and the rig, if any)."""

    def __init__(self, home: Path):
        self.home = home
        self.env = {**os.environ, "KVCTL_HOME": str(home)}
        self.env.pop("KVCTL_RIG_PYTHON", None)
        if _RIG[0] is not None:
            self.env["KVCTL_RIG_PYTHON"] = str(_RIG[0])

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "kvctl.cli", *args]

    def __call__(self, *args: str, timeout: float = 120) -> Result:
        p = subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True,
                           timeout=timeout)
        return Result(p.returncode, p.stdout, p.stderr)

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self.argv(*args), env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)


@pytest.fixture
def kvctl_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh KVCTL_HOME; any cluster a test leaves behind is torn down afterwards."""
    home = tmp_path / "kvctl-home"
    home.mkdir()
    monkeypatch.setenv("KVCTL_HOME", str(home))
    if _RIG[0] is not None:
        monkeypatch.setenv("KVCTL_RIG_PYTHON", str(_RIG[0]))
    yield home
    from kvctl.cluster.state import list_clusters
    from kvctl.cluster.lifecycle import down

    from kvctl.attach.attach import detach_cluster
    from kvctl.errors import BadInput

    for name in list_clusters():
        try:
            down(name)
        except BadInput:  # attached: not ours to stop, only to forget
            detach_cluster(name)
    for line in live_processes_under(home):  # last resort: never leak servers
        pid = int(line.split(":")[0])
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


@pytest.fixture
def kvctl(kvctl_home: Path) -> Kvctl:
    return Kvctl(kvctl_home)
