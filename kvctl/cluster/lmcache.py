"""LMCache servers beside a launched cluster: LMCache's multi-process mode, run by kvctl.

An instance whose kv-transfer-config names `LMCacheMPConnector` (itself, or as a
MultiConnector child: the seed's offload child on vLLM V1) is a client of a separate
`lmcache server` process, reached over ZMQ at `lmcache.mp.host`:`lmcache.mp.port`. A
launch runs that server as part of the cluster, in one of two shapes (`LMCacheOptions.sharing`,
named in the spec):

- `per-instance` (the default; the seed's shape): one server per instance that names the
  connector, local to it (`lmcache-prefill`, `lmcache-prefill-0`, ...);
- `shared`: one server (`lmcache`) for every such instance: LMCache's cross-instance
  sharing (what one prefill stored, another retrieves).

Each server gets its own loopback ports, checked free before anything starts: its ZMQ
port (a config's own `lmcache.mp.port` is kept and checked; else a free one, written
into the instance's config with `lmcache.mp.host` tcp://127.0.0.1) and `--http-port`:
its `/healthcheck` answers 200 once the engine is up (about 13 s after the start on 2
cores), and its `/metrics` serves LMCache's Prometheus counters (in this mode the server
opens no `--prometheus-port` of its own). Its log is `logs/<name>.log` in the cluster dir.
It starts before the vLLM servers and answers /healthcheck before they start: the
connector registers its KV caches with the server at start-up and a vLLM server whose
LMCache server is missing hangs for `lmcache.mp.mq_timeout` (LMCache's default 300 s; kvctl
writes MQ_TIMEOUT_S, see `point_at_server`) and dies. `down`
stops it with the servers, and so does a failed or interrupted launch. cluster.json
keeps each one's record under `lmcache` (`status` shows them, `kvctl logs lmcache`
reads one).

The flags kvctl passes are `server_args`' (checked against LMCache 0.5.6's parser):
`--supported-transfer-mode auto` is the one a CPU host cannot do without: the default
(`lmcache_driven`) has no CPU path, so the server answers the connector's registration
with `No handler registered for operation register_kv_cache_engine_driven_context` and
vLLM dies after 300 s.

Why the in-process `LMCacheConnectorV1` is not used on CPU: LMCache 0.5.6's in-process
engine has no CPU connector. On a CPU-only vLLM it logs `RuntimeError: No supported cpu
connector found.`, falls back to a degraded mode that recomputes every prompt and never
hits, while the server looks healthy (validate and launch warn: connectors.config.validate
LMCACHE_V1_ON_CPU). The multi-process connector works unchanged on CPU (its worker copies
KV through the engine-driven path). Switch when an LMCache release ships a CPU path for
the in-process connector (its CPU PR, LMCache #4268, was closed unmerged): then a
prefill needs no server beside it here either, as on GPUs.

The server runs from the `lmcache` extra's venv (kvctl.provision.extras: lmcache 0.5.6
installed --no-deps beside the V1 rig), whose site-packages the vLLM servers that use
the connector get too. Servers are local processes on every runtime kvctl runs them
itself (as the router is): kvctl.cluster.lmcache_process plans, starts and waits for
them. This module is what a spec needs: the options, which configs use a server, and the
server's command line. Library code: nothing here prints.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from connectors.config.topology import LMCACHE_MP_CONNECTOR, named_connectors
from kvctl.errors import BadInput

# ---- defaults ----------------------------------------------------------------------------
SHARING = ("per-instance", "shared")  # one server per instance that names the connector | one for all
DEFAULT_SHARING = "per-instance"
L1_SIZE_GB = 1.0  # --l1-size-gb: the server's in-memory (L1) cache, GB
CHUNK_SIZE = 256  # --chunk-size: tokens per stored chunk (LMCache stores and retrieves whole chunks)
EVICTION_POLICIES = ("LRU", "ARC", "IsolatedLRU", "noop")  # --eviction-policy choices (0.5.6)
EVICTION_POLICY = "LRU"
TRANSFER_MODE = "auto"  # --supported-transfer-mode: auto serves the engine-driven (CPU) path too
HOST = "127.0.0.1"  # both ports bind loopback
MP_HOST = f"tcp://{HOST}"  # what the connector's lmcache.mp.host gets
READY_S = 120.0  # a server answers /healthcheck ~13 s after its start on 2 cores; this bounds a hung one
MQ_TIMEOUT_S = 20.0  # lmcache.mp.mq_timeout kvctl writes when a config names none: see point_at_server
HEALTH_PATH = "/healthcheck"  # 200 {"status": "healthy"} once the engine is up (503 before)
METRICS_PATH = "/metrics"  # LMCache's Prometheus text, on the same HTTP port
SERVER_MODULE = "lmcache.cli.main"  # `python -m lmcache.cli.main server ...` = the `lmcache server` command
SERVER_ENV = {"PYTHONUNBUFFERED": "1",  # its log lines reach the file as they happen
              "LMCACHE_TRACK_USAGE": "false"}  # no usage telemetry (nothing outside is reachable)
SECTION = "lmcache"  # cluster.json's key for the servers' records
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LMCacheOptions:
    """How a launch runs the LMCache servers of the instances that name LMCacheMPConnector."""

    sharing: str = DEFAULT_SHARING  # "per-instance" (P-local, the seed's shape) | "shared"
    l1_size_gb: float = L1_SIZE_GB
    chunk_size: int = CHUNK_SIZE
    eviction_policy: str = EVICTION_POLICY

    def to_json(self) -> dict[str, Any]:
        return {"sharing": self.sharing, "l1_size_gb": self.l1_size_gb, "chunk_size": self.chunk_size,
                "eviction_policy": self.eviction_policy}


def check_lmcache_options(options: LMCacheOptions) -> LMCacheOptions:
    """`options`, checked. Raises BadInput naming the field (`lmcache_sharing`, `lmcache_l1_size_gb`,
    `lmcache_chunk_size`, `lmcache_eviction_policy`)."""
    if options.sharing not in SHARING:
        raise BadInput(f"unknown LMCache sharing {options.sharing!r}", field="lmcache_sharing",
                       fix=f"use one of: {', '.join(SHARING)} (default {DEFAULT_SHARING}: one server per "
                           "instance; shared: one server every instance uses)")
    if not options.l1_size_gb > 0:
        raise BadInput(f"the LMCache L1 size must be positive, got {options.l1_size_gb}",
                       field="lmcache_l1_size_gb", fix=f"give gigabytes, e.g. {L1_SIZE_GB}")
    if options.chunk_size < 1:
        raise BadInput(f"the LMCache chunk size must be at least 1 token, got {options.chunk_size}",
                       field="lmcache_chunk_size", fix=f"give tokens per chunk, e.g. {CHUNK_SIZE}")
    if options.eviction_policy not in EVICTION_POLICIES:
        raise BadInput(f"unknown LMCache eviction policy {options.eviction_policy!r}",
                       field="lmcache_eviction_policy", fix=f"use one of: {', '.join(EVICTION_POLICIES)}")
    return options


def uses_lmcache_server(kv_transfer_config: object) -> bool:
    """Whether a server with this config talks to an LMCache server (names LMCacheMPConnector)."""
    return bool(named_connectors(kv_transfer_config, LMCACHE_MP_CONNECTOR))


def given_port(kv_transfer_config: object) -> int | None:
    """The `lmcache.mp.port` a config names itself (its first LMCacheMPConnector's), or None."""
    for _, cfg in named_connectors(kv_transfer_config, LMCACHE_MP_CONNECTOR):
        extra = cfg.get("kv_connector_extra_config")
        port = extra.get("lmcache.mp.port") if isinstance(extra, Mapping) else None
        if isinstance(port, int) and not isinstance(port, bool):
            return port
    return None


def point_at_server(kv_transfer_config: dict, port: int, host: str = MP_HOST) -> dict:
    """A copy of the config whose every LMCacheMPConnector talks to the server at `host`:`port`
    (default tcp://127.0.0.1), waiting at most MQ_TIMEOUT_S for each blocking request unless the
    config names its own `lmcache.mp.mq_timeout`.

    Why the bound: LMCache 0.5.6 notices a dead server only by its heartbeat (a ping every 10 s),
    and a store submitted before that waits `mq_timeout` twice in vLLM's worker (PREPARE_STORE,
    then COMMIT_STORE), the whole engine stalled. With LMCache's default (300 s) a server killed
    mid-run hung P's next request past the router's 300 s prefill timeout; with 20 s P recomputes
    after at most a few tens of seconds and serves on. The same timeout bounds the connector's
    start-up registration, which a server kvctl has seen answer /healthcheck answers at once.
    """
    cfg = copy.deepcopy(kv_transfer_config)
    targets = [cfg] if cfg.get("kv_connector") == LMCACHE_MP_CONNECTOR else [
        c for c in (cfg.get("kv_connector_extra_config") or {}).get("connectors") or []
        if isinstance(c, dict) and c.get("kv_connector") == LMCACHE_MP_CONNECTOR]
    for target in targets:
        extra = target.get("kv_connector_extra_config")
        target["kv_connector_extra_config"] = {"lmcache.mp.mq_timeout": MQ_TIMEOUT_S,
                                               **(extra if isinstance(extra, dict) else {}),
                                               "lmcache.mp.host": host, "lmcache.mp.port": port}
    return cfg


@dataclass(frozen=True)
class LMCacheServer:
    """One LMCache server of a launch: its name, the instances it serves, its ports."""

    name: str  # "lmcache" (shared) or "lmcache-<instance>"
    serves: tuple[str, ...]  # instance names whose LMCacheMPConnector talks to it
    port: int  # ZMQ (the connector's lmcache.mp.port)
    http_port: int  # /healthcheck and /metrics
    options: LMCacheOptions = field(default_factory=LMCacheOptions)


def server_name(instance: str, sharing: str) -> str:
    return "lmcache" if sharing == "shared" else f"lmcache-{instance}"


def server_args(server: LMCacheServer, host: str = HOST) -> list[str]:
    """`lmcache server` arguments for `server` (LMCache 0.5.6's flags), both ports bound to `host`."""
    o = server.options
    return ["server", "--host", host, "--port", str(server.port),
            "--chunk-size", str(o.chunk_size), "--l1-size-gb", f"{o.l1_size_gb:g}",
            "--eviction-policy", o.eviction_policy, "--supported-transfer-mode", TRANSFER_MODE,
            "--http-host", host, "--http-port", str(server.http_port)]
