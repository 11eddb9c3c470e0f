"""The LMCache servers of a launch: plan their ports, start them on the cluster's runtime, wait until ready.

What they are and why is kvctl.cluster.lmcache; this module runs them as the runtime's
services (kvctl.runtime.base.ServiceSpec): a process of the lmcache extra's venv on the
local runtime, a container of the CPU V1 image on the docker runtime. Each logs to the
cluster's `logs/` and is re-attached from its cluster.json record through the runtime that
started it (status, logs, stop, kill). Library code: nothing here prints.
"""

from __future__ import annotations

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
from kvctl.provision.extras import LMCACHE
from kvctl.runtime import Runtime, get_runtime
from kvctl.runtime.base import Instance, InstanceSpec, ServiceSpec, read_log_tail
from kvctl.subprocesses import TAIL_LINES


def plan_for_launch(spec: ClusterSpec, ispecs: Mapping[str, InstanceSpec], runtime: Runtime, cdir: Path
                    ) -> tuple[dict[str, InstanceSpec], list[tuple[LMCacheServer, ServiceSpec]]]:
    """The LMCache servers `spec`'s instances need, each with its service for `runtime` (logging
    in `cdir`), and the InstanceSpecs with every LMCacheMPConnector pointed at its server where
    `runtime` says the instance reaches it (unchanged without any). Raises BadInput as
    `plan_servers` and `runtime.service_host`."""
    configs = {n: s.kv_transfer_config for n, s in ispecs.items()}
    users = [n for n, cfg in configs.items() if uses_lmcache_server(cfg)]
    if not users:
        return dict(ispecs), []
    taken = {s.port for s in ispecs.values()}
    free = (p for p in free_ports(2 * len(users) + len(taken)) if p not in taken)
    planned, servers = dict(ispecs), []
    for server in plan_servers(configs, spec.lmcache, free):
        service = service_spec(server, spec.name, ispecs[server.serves[0]].role, cdir)
        servers.append((server, service))
        for n in server.serves:
            host = runtime.service_host(service, ispecs[n])
            planned[n] = replace(ispecs[n], kv_transfer_config=point_at_server(
                ispecs[n].kv_transfer_config, server.port, f"tcp://{host}"))
    return planned, servers


def service_spec(server: LMCacheServer, cluster: str, serves_role: str, cdir: Path) -> ServiceSpec:
    """`server` as a service of the cluster's runtime: `lmcache server` from the lmcache extra."""
    return ServiceSpec(cluster=cluster, name=server.name, role="lmcache", extra=LMCACHE.name,
                       module=SERVER_MODULE, arguments=lambda host: server_args(server, host),
                       ports=(server.port, server.http_port), url_port=server.http_port,
                       serves=server.serves, serves_role=serves_role, cwd=cdir,
                       log_path=cdir / "logs" / f"{server.name}.log", env=SERVER_ENV)


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


def start_server(server: LMCacheServer, service: ServiceSpec, runtime: Runtime) -> dict[str, Any]:
    """Start `server` as `runtime`'s service `service`; returns at once with its record (for
    cluster.json's `lmcache`: the plan, the runtime's name and its instance record).

    Raises BadInput (its extra missing here or in the image), RuntimeFailure (it cannot start).
    """
    inst = runtime.start_service(service)
    return {"name": server.name, "serves": list(server.serves), "sharing": server.options.sharing,
            "url": inst.url, "port": server.port, "http_port": server.http_port,
            "metrics": inst.url + METRICS_PATH, "options": server.options.to_json(),
            "runtime": runtime.name, **inst.record(), "log_path": str(inst.log_path), "started": time.time()}


def server_instance(record: Mapping[str, Any]) -> Instance:
    """An LMCache server of a cluster as an Instance (status, logs, stop, kill), from its record,
    through the runtime that started it (local for records without one)."""
    return get_runtime(record.get("runtime", "local")).attach(
        record["name"], "lmcache", record["url"], Path(record["log_path"]), record)


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
