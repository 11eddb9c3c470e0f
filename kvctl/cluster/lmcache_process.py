"""The LMCache servers of a launch as processes: plan their ports, start them, wait until ready.

What they are and why is kvctl.cluster.lmcache; this module runs them, as
kvctl.cluster.router_process runs the router: each in its own session with its log in
the cluster's `logs/`, re-attached from its cluster.json record through the local
runtime (status, logs, stop). Library code: nothing here prints.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from kvctl.cluster.lmcache import (HEALTH_PATH, HOST, METRICS_PATH, READY_S, SERVER_ENV, SERVER_MODULE, LMCacheOptions,
                                   LMCacheServer, given_port, point_at_server, server_args, server_name,
                                   uses_lmcache_server)
from kvctl.cluster.spec import ClusterSpec, check_port_free
from kvctl.errors import BadInput, RuntimeFailure
from kvctl.net import free_ports
from kvctl.runtime.base import Instance, InstanceSpec, read_log_tail
from kvctl.runtime.local import LocalRuntime
from kvctl.provision.extras import LMCACHE, ExtraVenv
from kvctl.provision.rig import default_spec
from kvctl.runtime.processes import process_start_ticks
from kvctl.subprocesses import TAIL_LINES


def plan_for_launch(spec: ClusterSpec, ispecs: Mapping[str, InstanceSpec]
                    ) -> tuple[dict[str, InstanceSpec], list[LMCacheServer]]:
    """The LMCache servers `spec`'s instances need, and their InstanceSpecs with every
    LMCacheMPConnector pointed at its server (unchanged without any). Raises BadInput as
    `plan_servers`."""
    configs = {n: s.kv_transfer_config for n, s in ispecs.items()}
    users = [n for n, cfg in configs.items() if uses_lmcache_server(cfg)]
    if not users:
        return dict(ispecs), []
    taken = {s.port for s in ispecs.values()}
    free = (p for p in free_ports(2 * len(users) + len(taken)) if p not in taken)
    servers = plan_servers(configs, spec.lmcache, free)
    port_of = {n: srv.port for srv in servers for n in srv.serves}
    return {n: (replace(s, kv_transfer_config=point_at_server(s.kv_transfer_config, port_of[n]))
                if n in port_of else s) for n, s in ispecs.items()}, servers


def lmcache_python() -> Path:
    """The interpreter LMCache servers run with: the lmcache extra's venv (layered on the V1 rig).

    Raises BadInput when the extra is not installed, with the command that installs it.
    """
    venv = ExtraVenv(LMCACHE, default_spec(LMCACHE.engine))
    if venv.unfinished():
        raise BadInput(f"LMCacheMPConnector needs an LMCache server, and the extra {LMCACHE.name!r} "
                       f"({LMCACHE.summary}) is not installed", where=str(venv.dir),
                       fix=f"run `{venv.install_command()}` (once; it keeps the steps done)")
    return venv.python


def plan_servers(configs: Mapping[str, object], options: LMCacheOptions,
                 free: Iterable[int]) -> list[LMCacheServer]:
    """The servers a launch runs for these instances ({name: kv-transfer-config}), in that order.

    `free` yields free ports for whatever the configs leave open. Raises BadInput (field
    `lmcache_port`) when configs give one server two ports, or two servers one port, or a
    given port is not free.
    """
    free = iter(free)
    users = [n for n, cfg in configs.items() if uses_lmcache_server(cfg)]
    groups = [[n] for n in users] if options.sharing == "per-instance" else ([users] if users else [])
    servers, taken = [], set()
    for group in groups:
        ports = {p for n in group if (p := given_port(configs[n])) is not None}
        name = server_name(group[0], options.sharing)
        if len(ports) > 1:
            raise BadInput(f"the instances sharing {name} name different lmcache.mp.port values "
                           f"({', '.join(map(str, sorted(ports)))})", field="lmcache_port",
                           fix="give them one port, or leave lmcache.mp.port out for a free one")
        given = bool(ports)
        port = ports.pop() if given else next(free)
        if port in taken:
            raise BadInput(f"two LMCache servers cannot both use port {port}", field="lmcache_port",
                           fix="leave lmcache.mp.port out of the configs (each server then gets a free "
                               "one), or use lmcache sharing `shared` for one server")
        if given:  # a port the config names: checked before anything starts
            check_port_free(port, "lmcache_port", HOST)
        taken.add(port)
        servers.append(LMCacheServer(name, tuple(group), port, next(free), options))
    return servers


def start_server(server: LMCacheServer, python: Path, cdir: Path) -> dict[str, Any]:
    """Start `server` with `python` (the lmcache extra's) in its own session, logging to
    `cdir/logs/<name>.log`; returns at once with its record (for cluster.json's `lmcache`).

    Raises RuntimeFailure when it cannot be spawned.
    """
    argv = [str(python), "-m", SERVER_MODULE, *server_args(server)]
    log_path = cdir / "logs" / f"{server.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **SERVER_ENV}
    env.pop("PYTHONPATH", None)  # the extra's venv sees its own packages and the rig's: nothing else
    with open(log_path, "ab") as log:
        log.write(f"kvctl: starting LMCache server {server.name} for {', '.join(server.serves)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=cdir, start_new_session=True, env=env)
        except OSError as e:
            raise RuntimeFailure(f"could not start the LMCache server {server.name}: {e}", where=str(python),
                                 fix="install LMCache beside the V1 rig (its lmcache extra)") from e
    return {"name": server.name, "serves": list(server.serves), "sharing": server.options.sharing,
            "url": server.url, "port": server.port, "http_port": server.http_port,
            "metrics": server.url + METRICS_PATH, "options": server.options.to_json(),
            "pid": proc.pid, "start_ticks": process_start_ticks(proc.pid), "command": argv,
            "log_path": str(log_path), "started": time.time()}


def server_instance(record: Mapping[str, Any]) -> Instance:
    """An LMCache server of a cluster as an Instance (status, logs, stop), from its record."""
    # A process of this host whatever runs the servers: the local runtime's kind, as the router.
    return LocalRuntime().attach(record["name"], "lmcache", record["url"], Path(record["log_path"]),
                                 {k: record[k] for k in ("pid", "start_ticks", "command")})


def answers_healthcheck(client: httpx.Client, url: str, timeout_s: float = 2.0) -> bool:
    """True when the server's /healthcheck answers 200 (its engine is up)."""
    try:
        return client.get(f"{url}{HEALTH_PATH}", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_servers_ready(records: Mapping[str, Mapping[str, Any]], timeout_s: float = READY_S,
                       poll_s: float = 0.25) -> dict[str, float]:
    """Wait until every server answers /healthcheck; seconds each took from its start.

    Raises RuntimeFailure naming the server (and its log tail) when one exits or is not
    ready within `timeout_s`.
    """
    t0 = time.monotonic()
    ready: dict[str, float] = {}
    instances = {name: server_instance(rec) for name, rec in records.items()}
    with httpx.Client() as client:
        while len(ready) < len(records):
            for name, rec in records.items():
                if name in ready:
                    continue
                status = instances[name].status()
                if not status.running:
                    raise _not_ready(rec, f"the LMCache server {name} exited during start-up ({status.detail})",
                                     "read its log tail below; correct the flags or the lmcache extra")
                if answers_healthcheck(client, rec["url"]):
                    ready[name] = time.time() - rec["started"]
            if len(ready) < len(records):
                if time.monotonic() - t0 > timeout_s:
                    name = next(n for n in records if n not in ready)
                    raise _not_ready(records[name], f"the LMCache server {name} did not answer "
                                                    f"{HEALTH_PATH} within {timeout_s:g} s",
                                     "read its log tail below; the vLLM servers were not started")
                time.sleep(poll_s)
    return ready


def _not_ready(record: Mapping[str, Any], what: str, fix: str) -> RuntimeFailure:
    log_path = Path(record["log_path"])
    tail = read_log_tail(log_path, TAIL_LINES)
    return RuntimeFailure(what, where=str(log_path), fix=fix,
                          details=f"last {len(tail)} lines of {log_path}:\n" + "\n".join(tail))
