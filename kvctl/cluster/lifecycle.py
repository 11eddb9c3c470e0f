"""Cluster lifecycle: launch a 1P1D or xPyD cluster, report its status, tear it down.

`launch_1p1d` starts every instance of the spec (P and D, or the prefill-0,
..., decode-0, ... pools of `kvctl launch pd`; processes or containers, per the
runtime), writes cluster.json before the first one and records each as soon as
it exists (so a `kvctl down` can always find them, even if the launching
kvctl is killed; on docker it also removes containers made but not yet
recorded, by their labels), then waits for both `/health` endpoints while watching for
process death. Any failure, Ctrl-C, SIGTERM or SIGHUP stops everything it
started and removes the state (the logs stay, for reading) before the error
propagates; a cluster dir the launch made and left empty (it failed before any
server wrote a log) is removed too. With an API key (`ClusterSpec.api_key`) every
server and the router require it: it goes to them in their environment and into
the cluster's `api_key` file (mode 0600), never into cluster.json or a command
line. `running_cluster` wraps launch and `down` for callers that must always
tear down (scenarios, tests).

A cluster kvctl did not start (`managed: false`, written by kvctl.attach) is on
the attached runtime (kvctl.runtime.attached), which starts no servers: its status
is its instances' /health answers, its logs are its log files, and `down` refuses
it (`kvctl detach` forgets it). Everything here asks the runtime, never its name.

Library code: nothing here prints; progress goes to an optional callback.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from connectors.config.topology import handshake_connector
from kvctl.cluster import nixl
from kvctl.cluster.spec import ClusterSpec
from kvctl.cluster.state import (
    STATE_FILE,
    ClusterState,
    InstanceRecord,
    cluster_dir,
    clusters_root,
    list_clusters,
    load_cluster,
    remove_state,
    save_api_key,
    save_store_keys,
    save_cluster,
    utc_now,
)
from kvctl.errors import BadInput, KvctlError, RuntimeFailure
from kvctl.net import NotHealthy, answers_health, free_ports, wait_healthy
from kvctl.runtime import get_runtime, runtime_class, stray_instances
from kvctl.runtime.base import (
    Instance,
    InstanceSpec,
    StopResult,
    last_log_line,
    read_log_tail,
)
from kvctl.cluster.lmcache import READY_S as LMCACHE_READY_S
from kvctl.cluster.lmcache_process import (answers_healthcheck, plan_for_launch, server_instance,
                                           start_server, wait_servers_ready)
from kvctl.cluster.router_process import router_instance, start_router
from kvctl.signals import run_to_completion, signals_interrupt
from kvctl.subprocesses import TAIL_LINES

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # SIGTERM → SIGKILL


# --- progress reporting (the CLI renders it; scenarios may log it) ---

@dataclass
class RoleProgress:
    role: str
    state: str = "starting"  # starting | healthy | failed
    ready_s: float | None = None  # seconds from launch to healthy
    last_line: str = ""  # the server's latest log line


@dataclass
class LaunchProgress:
    cluster: str
    elapsed_s: float = 0.0
    roles: dict[str, RoleProgress] = field(default_factory=dict)


ProgressFn = Callable[[LaunchProgress], None]


# --- launch ---

@contextlib.contextmanager
def _launch_lock(name: str) -> Iterator[None]:
    """One launch per cluster name at a time (two would race for the state)."""
    root = clusters_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BadInput(f"another `kvctl launch` of cluster {name!r} is in progress",
                           where=str(cluster_dir(name)),
                           fix="wait for it, or launch under another cluster name") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _attach_all(state: ClusterState) -> dict[str, Instance]:
    runtime = get_runtime(state.runtime)
    return {name: runtime.attach(name, rec.role, rec.url, Path(rec.log_path), rec.runtime_fields)
            for name, rec in state.instances.items()}


def _starts_servers(state: ClusterState) -> bool:
    return runtime_class(state.runtime).starts_servers


def _not_ours(state: ClusterState, doing: str) -> BadInput:
    """`down` (or a launch under its name) of a cluster kvctl did not start."""
    return BadInput(f"cluster {state.name!r} was attached, not started by kvctl: {doing}",
                    where=str(cluster_dir(state.name) / STATE_FILE),
                    fix=f"`kvctl detach {state.name}` forgets it (its servers keep running); "
                        "stop the servers where they were started")


def _stop_all(instances: dict[str, Instance], grace_s: float = STOP_GRACE_S) -> list[StopResult]:
    """Stop every instance in parallel; tries all, then raises the first failure."""
    if not instances:
        return []
    with ThreadPoolExecutor(max_workers=len(instances)) as pool:
        futures = {role: pool.submit(inst.stop, grace_s) for role, inst in instances.items()}
    results, errors = [], []
    for role, fut in futures.items():
        try:
            results.append(fut.result())
        except KvctlError as e:
            log.error("stopping the %s server failed: %s", role, e.what)
            errors.append(e)
    if errors:
        raise errors[0]
    return results


def _ensure_name_free(name: str) -> None:
    """BadInput if cluster `name` is running; clean up its state if it is stale."""
    if not (cluster_dir(name) / STATE_FILE).exists():
        return
    state = load_cluster(name)
    if not _starts_servers(state):
        raise _not_ours(state, "a launch under its name would replace it")
    instances = _attach_all(state)
    running = [r for r, i in instances.items() if i.status().running]
    if running:
        raise BadInput(f"cluster {name!r} already exists and is running ({', '.join(running)})",
                       where=str(cluster_dir(name)),
                       fix=f"tear cluster {name!r} down first (`kvctl down`), or launch under another name")
    log.info("cluster %r has state but no running server; cleaning it up (store kept)", name)
    _stop_all(instances | {n: server_instance(r) for n, r in state.lmcache.items()})  # strays of a dead leader
    _remove_leftovers(state)
    remove_state(name)


def instance_specs(spec: ClusterSpec) -> dict[str, InstanceSpec]:
    """Each server's InstanceSpec, by instance name (`prefill`, or `prefill-0`, ...).

    Instances of a role share its config (so its store), args, env and
    engine; each has its own port (a free one unless given), core and log
    (`logs/NAME.log`).
    """
    cdir = cluster_dir(spec.name)
    planned = spec.instances()
    # HTTP and NIXL side-channel ports chosen together: all distinct.
    free = iter(free_ports(sum(1 for p in planned if not p.port)
                           + sum(1 for port in spec.side_channel_ports.values() if not port)))
    logging_config = nixl.write_logging_config(cdir) if spec.side_channel_ports else None
    specs = {}
    for p in planned:
        rs = spec.role(p.role)
        env = dict(rs.env)
        if p.name in spec.side_channel_ports:
            env.pop(nixl.SIDE_CHANNEL_PORT_ENV, None)  # the role's first port: each instance has its own
            env = {**nixl.server_env(rs.kv_transfer_config, spec.side_channel_ports[p.name] or next(free),
                                     logging_config), **env}
        specs[p.name] = InstanceSpec(
            cluster=spec.name, role=p.role, model=spec.model,
            served_model_name=spec.served_model_name, dtype=spec.dtype,
            port=p.port or next(free), cwd=cdir, log_path=cdir / "logs" / f"{p.name}.log",
            kv_transfer_config=rs.kv_transfer_config,
            worker_cls=spec.worker_cls if rs.engine == "v0" else None,  # V1 has no --worker-cls hooks
            block_size=spec.block_size if rs.engine == "v0" else None, max_model_len=spec.max_model_len,
            engine=rs.engine, cpu_bind=p.cpu_bind, extra_args=rs.extra_args, env=env, name=p.name,
            api_key=spec.api_key, store_keys=spec.store_keys)
    return specs


def _startup_failure(role: str, inst: Instance, what: str, fix: str) -> RuntimeFailure:
    tail = read_log_tail(inst.log_path, TAIL_LINES)
    details = f"last {len(tail)} lines of the {role} log ({inst.log_path}):\n" + "\n".join(tail)
    return RuntimeFailure(what, where=str(inst.log_path), fix=fix, details=details)


def wait_instances_healthy(instances: dict[str, Instance], timeout_s: float, t0: float,
                           progress: ProgressFn | None, cluster: str = "") -> LaunchProgress:
    """Poll /health and the processes until every instance is healthy.

    Raises RuntimeFailure ("the NAME server ... during start-up", "the NAME
    server was not healthy after N s", with its log tail) when a server exits
    or `timeout_s` after `t0` passes. `progress` gets the report after each poll.
    """
    report = LaunchProgress(cluster, roles={r: RoleProgress(r) for r in instances})

    def update(elapsed_s: float, ready: dict[str, float]) -> None:
        report.elapsed_s = elapsed_s
        for role, inst in instances.items():
            rp = report.roles[role]
            rp.last_line = last_log_line(inst.log_path)
            if role in ready and rp.state != "healthy":
                rp.state, rp.ready_s = "healthy", ready[role]
                log.info("%s server healthy after %.1f s", role, rp.ready_s)

    def on_poll(elapsed_s: float, ready: dict[str, float]) -> None:
        update(elapsed_s, ready)
        if progress:
            progress(report)

    servers = {r: (inst.url, _exited(inst)) for r, inst in instances.items()}
    try:
        wait_healthy(servers, timeout_s, t0=t0, on_poll=on_poll)
    except NotHealthy as e:
        update(time.monotonic() - t0, e.ready)
        report.roles[e.name].state = "failed"
        if progress:
            progress(report)
        if e.exited is not None:
            raise _startup_failure(
                e.name, instances[e.name], f"the {e.name} server {e.exited} during start-up",
                fix="read the log tail below; correct the model, config or arguments it "
                    "names, then launch again") from None
        raise _startup_failure(
            e.name, instances[e.name], f"the {e.name} server was not healthy after {timeout_s:g} s",
            fix="read the log tail below; if it was still loading, raise the timeout") from None
    return report


def _exited(inst: Instance) -> Callable[[], str | None]:
    """None while `inst` runs, else its status detail (e.g. "exited with code 1")."""
    def exited() -> str | None:
        status = inst.status()
        return None if status.running else status.detail
    return exited


def launch_1p1d(spec: ClusterSpec, progress: ProgressFn | None = None) -> ClusterState:
    """Start every instance of `spec` (P and D, or the pools) and wait until all answer /health.

    Returns the saved ClusterState. Raises BadInput (name in use, rig
    missing) before starting anything; RuntimeFailure when a server dies or
    times out during start-up; KeyboardInterrupt on Ctrl-C, SIGTERM or SIGHUP.
    On every failure everything started is stopped and the state removed.
    """
    runtime = get_runtime(spec.runtime, spec)
    runtime.check()  # e.g. the rig is installed, the image exists: fail before touching anything
    cdir = cluster_dir(spec.name)
    started: dict[str, Instance] = {}
    made_store = not spec.store.exists()
    made_cdir = not cdir.exists()
    state: ClusterState | None = None

    def cleanup() -> None:
        _stop_all(started)
        if state is not None:
            _stop_all({n: server_instance(r) for n, r in state.lmcache.items()}, STOP_GRACE_S)
        if state is not None and state.router is not None:
            router_instance(state.router).stop(STOP_GRACE_S)
        runtime.remove_leftovers(spec.name)  # docker: a container made but not yet recorded
        remove_state(spec.name)
        if made_store and spec.store.is_dir() and not any(spec.store.iterdir()):
            spec.store.rmdir()
        if made_cdir:
            _remove_if_empty(cdir)

    with _launch_lock(spec.name), signals_interrupt():
        _ensure_name_free(spec.name)
        t0 = time.monotonic()
        try:
            spec.store.mkdir(parents=True, exist_ok=True)
            state = ClusterState(name=spec.name, runtime=spec.runtime, model=str(spec.model),
                                 served_model_name=spec.served_model_name,
                                 store=str(spec.store), created=utc_now(),
                                 api_key_required=spec.api_key is not None,
                                 store_signed=bool(spec.store_keys))
            if spec.api_key is not None:
                save_api_key(spec.name, spec.api_key)
            if spec.store_keys:
                save_store_keys(spec.name, spec.store_keys)
            save_cluster(state)  # before any server: `kvctl down` finds the runtime's leftovers
            ispecs = instance_specs(spec)
            for ispec in ispecs.values():
                runtime.check_instance(ispec)  # local: each engine's rig
            # LMCache servers first (ports checked, configs pointed at them), healthy before any vLLM
            ispecs, servers = plan_for_launch(spec, ispecs, runtime, cdir)
            if servers:
                for server, service in servers:
                    state.lmcache[server.name] = start_server(server, service, runtime)
                    save_cluster(state)  # at once: `kvctl down` must find it if we die
                ready = wait_servers_ready(state.lmcache, min(LMCACHE_READY_S, spec.timeout_s))
                log.info("LMCache servers ready: %s", ", ".join(f"{n} {s:.1f} s" for n, s in ready.items()))
            for iname, ispec in ispecs.items():
                inst = runtime.start(ispec)
                started[iname] = inst
                state.instances[iname] = InstanceRecord(
                    role=ispec.role, url=inst.url, log_path=str(inst.log_path),
                    kv_transfer_config=ispec.kv_transfer_config, cwd=str(cdir),
                    runtime_fields={**inst.record(), "vllm_engine": ispec.engine})
                save_cluster(state)  # at once: `kvctl down` must find it if we die
            wait_instances_healthy(started, spec.timeout_s, t0, progress, spec.name)
            if spec.router:
                state.router = start_router({n: (r.role, r.url) for n, r in state.instances.items()},
                                            cdir, spec.router_port or free_ports(1)[0],
                                            host=spec.router_host, api_key=spec.api_key,
                                            kv_transfer_params=handshake_connector(
                                                spec.prefill.kv_transfer_config) is not None)
                state.endpoint = state.router["url"]
                save_cluster(state)
            return state
        except BaseException:
            run_to_completion(cleanup)
            raise


def restart_instances(spec: ClusterSpec, names: list[str], progress: ProgressFn | None = None) -> ClusterState:
    """Stop instances `names` of the running cluster `spec` launched and start them again as they
    were (same port, config, engine and log file), waiting until they answer /health.

    Their LMCache servers and the other instances keep running: what a restarted prefill finds
    again is what lives outside it (the store, its LMCache server). Returns the saved state.
    Raises BadInput for an unknown instance; RuntimeFailure when one does not come back (its
    log tail included; the cluster stays, for `kvctl down`).
    """
    state = load_cluster(spec.name)
    unknown = [n for n in names if n not in state.instances]
    if unknown:
        raise BadInput(f"cluster {spec.name!r} has no instance {unknown[0]!r}", field="restart",
                       fix=f"name one of: {', '.join(state.instances)}")
    runtime = get_runtime(spec.runtime, spec)
    planned = instance_specs(spec)
    _stop_all({n: inst for n, inst in _attach_all(state).items() if n in names})
    t0 = time.monotonic()
    started: dict[str, Instance] = {}
    for n in names:
        rec = state.instances[n]
        ispec = replace(planned[n], port=int(rec.url.rsplit(":", 1)[1]), kv_transfer_config=rec.kv_transfer_config)
        inst = runtime.start(ispec)
        started[n] = inst
        state.instances[n] = InstanceRecord(role=rec.role, url=inst.url, log_path=str(inst.log_path),
                                            kv_transfer_config=rec.kv_transfer_config, cwd=rec.cwd,
                                            runtime_fields={**inst.record(), "vllm_engine": ispec.engine})
        save_cluster(state)
    wait_instances_healthy(started, spec.timeout_s, t0, progress, spec.name)
    if state.endpoint:  # the router takes them back at its next health check, not at once
        try:
            wait_healthy({"router": (state.endpoint, lambda: None)}, spec.timeout_s, t0=t0)
        except NotHealthy:
            raise RuntimeFailure(f"the router of cluster {spec.name!r} did not take the restarted "
                                 f"{', '.join(names)} back within {spec.timeout_s:.0f} s",
                                 fix=f"`kvctl status` of cluster {spec.name!r} shows which instance is still unhealthy") from None
    return state


def _remove_if_empty(directory: Path) -> None:
    """Remove `directory` and the empty directories under it, when nothing else is there
    (a failed launch's cluster dir: its logs, if any, stay for reading)."""
    if not directory.is_dir() or directory.is_symlink():
        return
    for sub in sorted((p for p in directory.rglob("*") if p.is_dir() and not p.is_symlink()),
                      key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            sub.rmdir()  # fails, as it should, on a directory that holds anything
    with contextlib.suppress(OSError):
        directory.rmdir()


# --- status ---

@dataclass
class InstanceHealth:
    role: str
    running: bool
    healthy: bool
    detail: str


@dataclass
class ClusterStatus:
    state: ClusterState
    instances: dict[str, InstanceHealth]
    endpoint_healthy: bool | None = None  # the router's /health; None without an endpoint
    lmcache: dict[str, InstanceHealth] = field(default_factory=dict)  # its LMCache servers' /healthcheck

    @property
    def healthy(self) -> bool:
        return (bool(self.instances) and all(i.healthy for i in self.instances.values())
                and all(h.healthy for h in self.lmcache.values()) and self.endpoint_healthy is not False)

    def to_json(self) -> dict[str, Any]:
        data = self.state.to_json()
        data["healthy"] = self.healthy
        if self.endpoint_healthy is not None:
            data["endpoint_healthy"] = self.endpoint_healthy
        for role, h in self.instances.items():
            data["instances"][role].update(running=h.running, healthy=h.healthy, detail=h.detail)
        for name, h in self.lmcache.items():
            data["lmcache"][name] = {**data["lmcache"][name], "running": h.running, "healthy": h.healthy,
                                     "detail": h.detail}
        return data


def cluster_status(name: str) -> ClusterStatus:
    """Process and /health state of each instance. Raises BadInput for an unknown cluster.

    An attached cluster's instances have no process kvctl knows: running and
    healthy both mean /health answered (their status asks it).
    """
    state = load_cluster(name)
    health = {}
    with httpx.Client() as client:
        for role, inst in _attach_all(state).items():
            st = inst.status()
            ok = st.running and (st.healthy if st.healthy is not None else answers_health(client, inst.url))
            health[role] = InstanceHealth(role, st.running, ok, st.detail)
        endpoint_ok = answers_health(client, state.endpoint) if state.endpoint else None
        lmcache = {}
        for server, rec in state.lmcache.items():
            st = server_instance(rec).status()
            lmcache[server] = InstanceHealth("lmcache", st.running,
                                             st.running and answers_healthcheck(client, rec["url"]), st.detail)
    return ClusterStatus(state, health, endpoint_ok, lmcache)


@dataclass
class DamagedCluster:
    """A cluster whose cluster.json cannot be read: listed, never hidden; `down` removes it."""

    name: str
    error: str
    path: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "error": self.error, "path": self.path}


def all_cluster_status() -> tuple[list[ClusterStatus], list[DamagedCluster]]:
    """Every cluster's status; one with unreadable state is reported, not fatal to the rest."""
    statuses, damaged = [], []
    for name in list_clusters():
        try:
            statuses.append(cluster_status(name))
        except BadInput as e:
            damaged.append(DamagedCluster(name, e.what, e.where or str(cluster_dir(name) / STATE_FILE)))
    return statuses, damaged


def instance(name: str, instance_name: str) -> Instance:
    """Instance `instance_name` of cluster `name` (for logs), its router (`router`), or one of its
    LMCache servers (by name, e.g. `lmcache-prefill`; `lmcache` when it has one).

    A role (`prefill`, `decode`) names the role's only instance, so it works
    on pools of one too, and `prefill-0`/`decode-0` name a 1P1D's `prefill`/
    `decode` (the pools' names work on every cluster). Raises BadInput for an
    unknown name or a role with several instances, listing the names.
    """
    state = load_cluster(name)
    if instance_name == "router" and state.router is not None and "router" not in state.instances:
        return router_instance(state.router)
    lmcache = state.lmcache.get(instance_name) or (  # `lmcache`: the cluster's only LMCache server
        next(iter(state.lmcache.values())) if instance_name == "lmcache" and len(state.lmcache) == 1 else None)
    if lmcache is not None and instance_name not in state.instances:
        return server_instance(lmcache)
    names = list(state.instances) + (["router"] if state.router is not None else []) + list(state.lmcache)
    key = instance_name
    role, _, index = key.rpartition("-")
    if key not in state.instances and index == "0" and role in state.instances:
        key = role  # a 1P1D's one instance of the role, by its pool name
    if key not in state.instances:
        of_role = list(state.by_role(key))
        if len(of_role) != 1:
            what = f"{len(of_role)} {key} instances" if of_role else f"no {key!r} instance"
            raise BadInput(f"cluster {name!r} has {what}", where="INSTANCE",
                           fix=f"name one of: {', '.join(names)}")
        key = of_role[0]
    return _attach_all(state)[key]


# --- down ---

@dataclass
class DownReport:
    name: str
    found: bool  # False: there was nothing to tear down
    stopped: list[StopResult] = field(default_factory=list)
    removed: str | None = None  # the directory removed (or emptied, with keep_store)
    kept_store: str | None = None
    damaged_state: str | None = None  # why cluster.json could not be read (then removed anyway)
    roles: dict[str, str] = field(default_factory=dict)  # instance name -> its role ("router" for the router)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "found": self.found, "removed": self.removed,
                "kept_store": self.kept_store, "damaged_state": self.damaged_state,
                "stopped": [{"instance": s.name, "role": self.roles.get(s.name, s.name),
                             "was_running": s.was_running, "signal": s.signal,
                             "seconds": round(s.seconds, 2)} for s in self.stopped]}


def down(name: str, keep_store: bool = False, grace_s: float = STOP_GRACE_S) -> DownReport:
    """Stop cluster `name`'s servers and remove its directory. Idempotent.

    Servers get SIGTERM, then SIGKILL after `grace_s` seconds.
    With `keep_store` the store dir (when it lives in the cluster dir) stays.
    A store outside the cluster dir is never removed. Also cleans up clusters
    whose servers already died. Raises RuntimeFailure if a server survives
    SIGKILL, BadInput for an invalid name or unreadable state, and for a
    cluster kvctl did not start (attached: nothing is stopped or removed).
    """
    cdir = cluster_dir(name)
    report = DownReport(name, found=cdir.exists())
    if not report.found:
        return report
    store: Path | None = None
    if (cdir / STATE_FILE).exists():
        try:
            state = load_cluster(name)
        except BadInput as e:  # unreadable state: stop what still runs there, then remove it
            report.damaged_state = e.what
            report.stopped = _stop_strays(cdir, grace_s)
        else:
            if not _starts_servers(state):
                raise _not_ours(state, "down stops only servers kvctl started")
            store = Path(state.store) if state.store is not None else None
            instances = _attach_all(state)
            if state.router is not None:
                instances["router"] = router_instance(state.router)
            instances |= {n: server_instance(r) for n, r in state.lmcache.items()}
            report.roles = ({n: rec.role for n, rec in state.instances.items()} | {"router": "router"}
                            | {n: "lmcache" for n in state.lmcache})
            report.stopped = _stop_all(instances, grace_s)
            _remove_leftovers(state)
        remove_state(name)
    keep = keep_store and store is not None and store.is_dir() and store.is_relative_to(cdir)
    if keep:
        for child in cdir.iterdir():
            if child != store and not store.is_relative_to(child):
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        report.kept_store = str(store)
    else:
        shutil.rmtree(cdir, ignore_errors=False)
        if keep_store and store is not None:
            report.kept_store = str(store)  # outside the cluster dir: never ours to remove
    report.removed = str(cdir)
    return report


def _remove_leftovers(state: ClusterState) -> None:
    """What the runtime made for this cluster but never recorded (docker: a container created
    just before the launching kvctl was killed), found by the runtime's own marks."""
    removed = get_runtime(state.runtime).remove_leftovers(
        state.name, [r.runtime_fields for r in state.instances.values()])
    if removed:
        log.warning("removed unrecorded leftovers of cluster %r: %s", state.name, ", ".join(removed))


def _stop_strays(cdir: Path, grace_s: float) -> list[StopResult]:
    """Stop the vLLM servers still running in `cdir` when the state naming them is lost.

    The runtimes find them (kvctl.runtime.stray_instances: local servers, each
    leading its own process group in the cluster dir); each is stopped as its
    runtime stops its instances.
    """
    return _stop_all(stray_instances(cdir), grace_s)


@contextlib.contextmanager
def running_cluster(spec: ClusterSpec, progress: ProgressFn | None = None,
                    keep_store: bool = False) -> Iterator[ClusterState]:
    """Launch, yield the state, and always tear down (also on errors and Ctrl-C)."""
    state = launch_1p1d(spec, progress)
    try:
        yield state
    finally:
        run_to_completion(lambda: down(spec.name, keep_store=keep_store))
