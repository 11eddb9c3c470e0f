"""The router beside a launched cluster: one OpenAI endpoint in front of its instances.

`start_router` runs `python -m kvctl.router` (kvctl's own interpreter: the
router needs aiohttp, not vLLM) in its own session, on a free loopback port,
with every prefill and decode instance named as in cluster.json, and waits
for its /health (200 only once a P and a D answer). With an API key, the router
requires it on /v1/* and gets it in its environment ($KVCTL_ROUTER_API_KEY), never
on its command line (so `ps` and cluster.json's "command" never show it). The returned record goes
into cluster.json under "router"; `router_instance` turns it back into an
Instance (status, logs, stop) through the local runtime, as for a server.
A Ctrl-C while it waits stops the router before it propagates.

The router is a local process for every runtime, docker included: it reaches
containers through the ports they publish (on 127.0.0.1 by default, or the
docker `bind` address), which needs no docker network, works across two
engines, and keeps one way to start, log and stop it. (Running it as a
container would only move this process into the image; kvctl.runtime.docker
says why that buys nothing here.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from kvctl.errors import RuntimeFailure
from kvctl.router.config import API_KEY_ENV as ROUTER_API_KEY_ENV
from kvctl.router.config import DEFAULT_HOST
from kvctl.runtime.local import LocalRuntime
from kvctl.runtime.base import Instance, read_log_tail
from kvctl.runtime.processes import process_start_ticks
from kvctl.subprocesses import TAIL_LINES

ROUTER_MODULE = "kvctl.router"
ROUTER_READY_S = 60.0  # the router is up in about a second; its /health waits for P and D


def start_router(instances: Mapping[str, tuple[str, str]], cdir: Path, port: int,
                 host: str = DEFAULT_HOST, api_key: str | None = None,
                 kv_transfer_params: bool = False,
                 health_interval_s: float | None = None) -> dict[str, Any]:
    """Start the router for `instances` ({name: (role, url)}) and wait until it is healthy.

    `api_key`: the router requires `Authorization: Bearer KEY` on /v1/* (None: no key,
    even when kvctl's own environment has a $KVCTL_ROUTER_API_KEY).
    `kv_transfer_params`: the handshake NIXL needs (`--kv-transfer-params`; the caller
    asks connectors.config.topology.handshake_connector).
    `health_interval_s`: seconds between its /health checks (None: the router's default).

    Returns its record: url, pid, start_ticks, command, log_path. Raises
    RuntimeFailure (with the router's log tail) when it exits or stays
    unhealthy; the process is stopped first.
    """
    argv = [sys.executable, "-m", ROUTER_MODULE, "--host", host, "--port", str(port)]
    if kv_transfer_params:
        argv.append("--kv-transfer-params")
    if health_interval_s is not None:
        argv += ["--health-interval", f"{health_interval_s:g}"]
    for name, (role, url) in sorted(instances.items()):
        argv += [f"--{role}", f"{name}={url}"]
    log_path = cdir / "logs" / "router.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != ROUTER_API_KEY_ENV}
    if api_key is not None:
        env[ROUTER_API_KEY_ENV] = api_key
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                cwd=cdir, start_new_session=True, env=env)
    url = f"http://{_reachable(host)}:{port}"
    record = {"url": url, "pid": proc.pid, "start_ticks": process_start_ticks(proc.pid),
              "command": argv, "log_path": str(log_path)}
    deadline = time.monotonic() + ROUTER_READY_S
    try:
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    break
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        return record
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
    except BaseException:  # Ctrl-C while waiting: the caller has no record of it yet
        router_instance(record).stop(5.0)
        raise
    router_instance(record).stop(5.0)
    proc.wait(timeout=10)
    tail = "\n".join(read_log_tail(log_path, TAIL_LINES))
    raise RuntimeFailure(f"the router at {url} did not become healthy (exit code {proc.returncode})",
                         where=str(log_path), fix="read the router's log tail below",
                         details=tail)


def _reachable(host: str) -> str:
    """The address clients on this host use for a server bound to `host` (a wildcard: loopback)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if ":" in host:
        return "[::1]" if host == "::" else f"[{host}]"
    return host


def router_instance(record: Mapping[str, Any]) -> Instance:
    """The router process of a cluster as an Instance (status, logs, stop)."""
    # The router is a process of this host whatever runs the servers: the local runtime's kind.
    return LocalRuntime().attach("router", "router", record["url"], Path(record["log_path"]),
                                 {k: record[k] for k in ("pid", "start_ticks", "command")})
