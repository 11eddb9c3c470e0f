"""LocalRuntime: vLLM servers as processes of the CPU rig's python on this host.

Each instance runs the rig of its engine (`engine_python`): v0 the vLLM 0.9.2
rig (or $KVCTL_RIG_PYTHON), v1 the vLLM 0.32 rig (or $KVCTL_RIG_V1_PYTHON), so
one cluster may mix them (a V0 prefill feeding a V1 decode through one store).

The rig is read-only and holds no kvctl: the servers import our connectors
(and find their vLLM plugin entry point) in this kvctl's overlay, put first on
their PYTHONPATH (kvctl.provision.overlay), followed by the site-packages of
the extras their connectors need (NIXL for NixlConnector: kvctl.provision.extras). Clusters launched by two kvctl
installations (two checkouts, a wheel) run side by side, each with its own.

Each server runs in its own session and process group (start_new_session), so
a Ctrl-C in the terminal reaches only kvctl, which then stops the servers in
order, and `stop()` can signal the server and every child it forked at once
(SIGTERM to the group, SIGKILL after a grace period). stdout and stderr go to
the instance's log file.

vLLM puts its ZMQ IPC sockets and its torch.distributed file store in the
system temp dir, where a stopped server's files stay forever. Each local
server gets a temp dir of its own instead (`server_tmp_dir`, its TMPDIR),
removed once it is stopped; torch's compile cache stays the shared one.

A server outlives the `kvctl launch` that started it; other kvctl processes
re-attach by pid. The record also keeps the process start time from
/proc/<pid>/stat, so a recycled pid is never mistaken for our server.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

from kvctl.errors import BadInput, RuntimeFailure
from kvctl.provision.extras import extra_python, server_sites
from kvctl.provision.overlay import Overlay, ensure_overlay, pythonpath
from kvctl.provision.rig import default_spec, rig_python
from kvctl.runtime.base import (
    API_KEY_ENV,
    STORE_KEY_ENVS,
    DEFAULT_ENGINE,
    ENTRYPOINT_MODULE,
    InstanceSpec,
    InstanceStatus,
    LaunchPlan,
    ServiceSpec,
    StopResult,
    instance_logs,
    vllm_server_args,
    vllm_server_env,
)
from kvctl.runtime.processes import group_members, is_alive, process_start_ticks, server_groups_in

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"  # what helper servers bind and clients reach them at

KILL_WAIT_S = 5.0  # after SIGKILL: how long to wait for the kernel to reap
POLL_S = 0.1


COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# vLLM V1 torch.compiles a sampler op (batched_count_greater_than) the first time a server returns
# logprobs, even with --enforce-eager: an inductor C++ build that held a 2P2D cluster's first request
# for minutes on 2 busy cores (faulthandler: P's worker in torch._dynamo under gather_logprobs while
# its engine logged "No available shared memory broadcast block found in 60 seconds").
# Local servers are CPU servers: they run torch.compile'd functions eagerly.
NO_COMPILE_ENV = {"TORCH_COMPILE_DISABLE": "1"}


def server_tmp_dir(log_path: Path) -> Path:
    """The temp dir (TMPDIR) of the server logging to `log_path`.

    In the system temp dir and short: vLLM's IPC socket paths must fit in 107 bytes,
    and a cluster dir can be deep. Named by the log path, which every kvctl that attaches knows.
    """
    digest = hashlib.sha256(str(log_path.absolute()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"kvctl-tmp-{digest}"


def tmp_env(log_path: Path) -> dict[str, str]:
    """TMPDIR for the server logging to `log_path` (created), and torch's default compile cache
    (under the system temp dir, shared by every server)."""
    tmp = server_tmp_dir(log_path)
    tmp.mkdir(mode=0o700, exist_ok=True)
    return {"TMPDIR": str(tmp),
            COMPILE_CACHE_ENV: str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")}


def engine_python(engine: str) -> Path:
    """The interpreter that runs `engine`'s servers: the installed rig of that engine, or
    the interpreter its override names (v0: $KVCTL_RIG_PYTHON, v1: $KVCTL_RIG_V1_PYTHON).

    Raises BadInput for an unknown engine, an override that is not a file, or a
    rig that is not installed.
    """
    return rig_python(default_spec(engine))


class LocalInstance:
    """A vLLM server process (and its process group) on this host."""

    def __init__(self, name: str, role: str, url: str, log_path: Path, pid: int,
                 start_ticks: int | None, command: list[str] | None = None,
                 popen: subprocess.Popen | None = None, overlay: str | None = None):
        self.name = name
        self.role = role
        self.url = url
        self.log_path = log_path
        self.pid = pid  # also the process group id (start_new_session)
        self.start_ticks = start_ticks
        self.command = command or []
        self._popen = popen  # set only in the process that started it
        self.overlay = overlay  # the overlay dir its connectors come from

    def __repr__(self) -> str:
        return f"<LocalInstance {self.name} pid={self.pid} {self.url}>"

    def _is_ours(self) -> bool:
        """False when the pid now belongs to another process (ours is long gone)."""
        if self.start_ticks is None:
            return True
        ticks = process_start_ticks(self.pid)
        return ticks is None or ticks == self.start_ticks

    def status(self) -> InstanceStatus:
        if self._popen is not None:
            code = self._popen.poll()
            if code is not None:
                return InstanceStatus(False, code, f"exited with code {code}")
            return InstanceStatus(True, None, f"pid {self.pid} running")
        if not is_alive(self.pid) or not self._is_ours():
            return InstanceStatus(False, None, f"process {self.pid} is gone")
        return InstanceStatus(True, None, f"pid {self.pid} running")

    def _members(self) -> list[int]:
        if self._popen is not None:
            self._popen.poll()  # reap the leader so it stops counting
        if not self._is_ours():
            return []
        return group_members(self.pid)

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def _wait_gone(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self._members():
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def stop(self, grace_s: float = 10.0) -> StopResult:
        """SIGTERM the process group, SIGKILL it after `grace_s`. Idempotent.

        Raises RuntimeFailure if processes survive SIGKILL (never seen; it
        would mean an unkillable process in D state).
        """
        t0 = time.monotonic()
        if not self._members():
            self._remove_tmp_dir()  # a server that died on its own left its files
            return StopResult(self.name, False, None, 0.0)
        log.debug("stopping %s server (process group %d) with SIGTERM", self.name, self.pid)
        self._signal_group(signal.SIGTERM)
        used = "SIGTERM"
        if not self._wait_gone(grace_s):
            log.warning("%s server (process group %d) ignored SIGTERM for %.0f s; sending SIGKILL",
                        self.name, self.pid, grace_s)
            self._signal_group(signal.SIGKILL)
            used = "SIGKILL"
            if not self._wait_gone(KILL_WAIT_S):
                raise RuntimeFailure(
                    f"the {self.name} server's processes survived SIGKILL: {self._members()}",
                    where=f"process group {self.pid}",
                    fix="check them with `ps -o pid,stat,cmd -g PGID` and kill them by hand")
        if self._popen is not None:
            self._popen.wait(timeout=KILL_WAIT_S)
        self._remove_tmp_dir()
        return StopResult(self.name, True, used, time.monotonic() - t0)

    def _remove_tmp_dir(self) -> None:
        """Remove the temp dir of this server, once its processes are gone."""
        shutil.rmtree(server_tmp_dir(self.log_path), ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (the leader alone if the group is gone)."""
        if not self._is_ours():
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def logs(self, tail: int | None = None, follow: bool = False) -> Iterator[str]:
        return instance_logs(self, tail, follow)

    def record(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_ticks": self.start_ticks, "command": self.command,
                "overlay": self.overlay}


class LocalRuntime:
    """Runs servers as subprocesses of the rig python (or `python` if given)."""

    name: ClassVar[str] = "local"
    starts_servers: ClassVar[bool] = True
    host_rigs: ClassVar[bool] = True
    docker_options: ClassVar[bool] = False

    def __init__(self, python: Path | None = None):
        self._given = python  # one interpreter for every engine (tests)
        self._pythons: dict[str, Path] = {}
        self._overlay: Overlay | None = None

    def python_for(self, engine: str) -> Path:
        """The interpreter for `engine`'s servers (see `engine_python`)."""
        if self._given is not None:
            return self._given
        if engine not in self._pythons:
            self._pythons[engine] = engine_python(engine)
        return self._pythons[engine]

    @classmethod
    def for_cluster(cls, plan: LaunchPlan) -> LocalRuntime:
        """Every cluster runs on the same rigs: nothing of `plan` is needed up front."""
        return cls()

    @property
    def python(self) -> Path:
        return self.python_for(DEFAULT_ENGINE)

    @property
    def overlay(self) -> Overlay:
        """This kvctl's overlay (built on first use)."""
        if self._overlay is None:
            self._overlay = ensure_overlay()
        return self._overlay

    def check(self) -> None:
        """Raises BadInput if this kvctl's code cannot be found (each engine's rig: `check_instance`)."""
        _ = self.overlay

    def check_instance(self, spec: InstanceSpec) -> None:
        """Raises BadInput if the rig of `spec`'s engine, or an extra its connector needs, is
        missing (before anything starts)."""
        self.python_for(spec.engine)
        server_sites(spec.kv_transfer_config, spec.engine)

    def command(self, spec: InstanceSpec) -> list[str]:
        host = spec.host
        return [str(self.python_for(spec.engine)), "-m", ENTRYPOINT_MODULE,
                *vllm_server_args(spec, model=str(spec.model), host=host)]

    def start(self, spec: InstanceSpec) -> LocalInstance:
        """Start the server; returns at once. Raises RuntimeFailure if it cannot be spawned."""
        argv = self.command(spec)
        # A VLLM_API_KEY kvctl inherited is not this cluster's key (that comes with the spec):
        # a server requiring it would refuse kvctl's own requests.
        # So are store keys: an unkeyed cluster's servers must not pick one up from kvctl's shell.
        # kvctl's own defaults go under the server's env, so a role's env may set them back.
        env = {**{k: v for k, v in os.environ.items() if k != API_KEY_ENV and k not in STORE_KEY_ENVS},
               **tmp_env(spec.log_path), **NO_COMPILE_ENV, **vllm_server_env(spec)}
        env["PYTHONPATH"] = pythonpath(self.overlay, env.get("PYTHONPATH"),
                                       server_sites(spec.kv_transfer_config, spec.engine))
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        spec.cwd.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "wb") as logf:
            # One header line, so a log read alone says what produced it.
            logf.write(f"kvctl: starting {spec.instance} server: {shlex.join(argv)}\n"
                       f"kvctl: its connectors: overlay {self.overlay.key} "
                       f"(PYTHONPATH={env['PYTHONPATH']})\n".encode())
            logf.flush()
            try:
                popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=subprocess.STDOUT, cwd=spec.cwd, env=env,
                                         start_new_session=True, close_fds=True)
            except OSError as e:
                raise RuntimeFailure(f"could not start the {spec.instance} server: {e}",
                                     where=str(argv[0]),
                                     fix="check the rig with `kvctl rig install`") from e
        url_host = "127.0.0.1" if spec.host in ("0.0.0.0", "") else spec.host
        log.debug("started %s server pid %d: %s", spec.instance, popen.pid, shlex.join(argv))
        return LocalInstance(spec.instance, spec.role, f"http://{url_host}:{spec.port}", spec.log_path, popen.pid,
                             process_start_ticks(popen.pid), argv, popen, str(self.overlay.path))

    def start_service(self, spec: ServiceSpec) -> LocalInstance:
        """Start `spec` with its extra's interpreter, bound to loopback, in its own session.

        Raises BadInput when the extra is not installed, RuntimeFailure when it cannot be spawned.
        """
        python = extra_python(spec.extra, f"the {spec.role} server {spec.name}")
        argv = [str(python), "-m", spec.module, *spec.arguments(LOOPBACK)]
        env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, *STORE_KEY_ENVS)}
        env.pop("PYTHONPATH", None)  # the extra's venv sees its own packages and the rig's: nothing else
        env.update(spec.env)
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as logf:
            logf.write(f"kvctl: starting {spec.role} server {spec.name} for {', '.join(spec.serves)}: "
                       f"{shlex.join(argv)}\n".encode())
            logf.flush()
            try:
                popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         cwd=spec.cwd, env=env, start_new_session=True, close_fds=True)
            except OSError as e:
                raise RuntimeFailure(f"could not start the {spec.role} server {spec.name}: {e}",
                                     where=str(python), fix=f"reinstall the extra {spec.extra!r}") from e
        return LocalInstance(spec.name, spec.role, f"http://{LOOPBACK}:{spec.url_port}", spec.log_path, popen.pid,
                             process_start_ticks(popen.pid), argv, popen)

    def service_host(self, service: ServiceSpec, client: InstanceSpec) -> str:
        return LOOPBACK  # every process of this runtime shares the host's loopback

    def attach(self, name: str, role: str, url: str, log_path: Path,
               record: Mapping[str, Any]) -> LocalInstance:
        if not isinstance(record.get("pid"), int):
            raise BadInput(f"the {name} record of this cluster has no pid",
                           where="cluster.json", fix="remove the cluster with `kvctl down`")
        return LocalInstance(name, role, url, log_path, record["pid"], record.get("start_ticks"),
                             list(record.get("command") or []), overlay=record.get("overlay"))

    def remove_leftovers(self, cluster: str, records: Iterable[Mapping[str, Any]] = ()) -> list[str]:
        """Nothing: a server is recorded (by pid) the moment it exists."""
        return []

    def strays(self, cluster_dir: Path) -> dict[str, LocalInstance]:
        """The servers (and routers) still running in `cluster_dir` when the state naming them
        is lost: each leads its own process group there (processes.server_groups_in)."""
        return {f"process group {pgid}": self.attach(f"process group {pgid}", "", "", cluster_dir / "logs",
                                                     {"pid": pgid, "start_ticks": process_start_ticks(pgid)})
                for pgid in server_groups_in(cluster_dir)}
