"""What kvctl gives a server that runs vLLM's NixlConnector (`launch --transfer nixl`).

NIXL moves KV from P's paged cache to D's: D pulls P's blocks over UCX after a
handshake on P's side channel (a ZMQ socket at VLLM_NIXL_SIDE_CHANNEL_HOST:PORT,
which P's answer names in its kv_transfer_params). So every such server gets:

- its own side-channel port on 127.0.0.1 (each instance of a pool too), chosen
  free or given (VLLM_NIXL_SIDE_CHANNEL_PORT in a role's env: the first of
  consecutive ones), checked free before anything starts;
- `UCX_TLS=tcp,cma` when its KV buffer is host memory: the transports that
  work between processes of a CPU-only host (shared memory alone fails);
- P kv_producer and D kv_consumer (vLLM wants them; kv_both is deprecated);
- a `kv_lease_duration` sized for the host: P frees blocks no D has read after
  the lease, and D's reads (and its heartbeats) wait behind its other work,
  which on a few CPU cores takes far longer than on a GPU;
- DEBUG for the two vLLM loggers that print the per-request lines verify
  reads (`Finished sending/recving KV transfer for request`,
  `update_state_after_alloc: num_external_tokens=`), every other logger as it
  was (a vLLM logging config file, VLLM_LOGGING_CONFIG_PATH).

Pure but for the port checks: the spec calls it, the runtimes pass the env on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from connectors.config.topology import handshake_connector
from kvctl.errors import BadInput
from kvctl.provision.extras import UCX_TLS

TRANSFERS = ("fs", "nixl")  # launch --transfer: our FSConnector (default) or vLLM's NixlConnector
DEFAULT_TRANSFER = "fs"
NIXL_CONNECTOR = "NixlConnector"
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
SIDE_CHANNEL_HOST = "127.0.0.1"  # every local server's side channel (NIXL's default is `localhost`)
POD_SIDE_CHANNEL_PORT = 5600  # in a Kubernetes pod (its own IP: one port for every pod)
LOGGING_CONFIG_ENV = "VLLM_LOGGING_CONFIG_PATH"
LOGGING_CONFIG_FILE = "vllm-logging.json"  # in the cluster dir
VLLM_LEASE_S = 30  # vLLM's kv_lease_duration default, sized for GPUs
LEASE_REFERENCE_CORES = 8  # at or above this many cores the GPU default holds
# The vLLM 0.32 loggers of the lines verify reads (their DEBUG only; the rest stays INFO).
DEBUG_LOGGERS = ("vllm.v1.core.sched.scheduler",
                 "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler")
# vLLM 0.32's own logging config (vllm/logger.py DEFAULT_LOGGING_CONFIG) with those loggers
# at DEBUG: the handler lets DEBUG through, the `vllm` logger keeps INFO for everything else.
_VLLM_FORMAT = "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"


def lease_duration_s(cores: int) -> int:
    """kv_lease_duration for a CPU host with `cores` cores: vLLM's 30 s scaled by how far the
    host falls short of LEASE_REFERENCE_CORES (2 cores: 120 s)."""
    return VLLM_LEASE_S * max(1, math.ceil(LEASE_REFERENCE_CORES / max(1, cores)))


def default_config(role: str, cores: int, device: str = "cpu") -> dict:
    """The NixlConnector config of `role`: producer P, consumer D, KV buffer on `device`."""
    lease = lease_duration_s(cores) if device == "cpu" else VLLM_LEASE_S
    return {"kv_connector": NIXL_CONNECTOR,
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_buffer_device": device,
            "kv_connector_extra_config": {"kv_lease_duration": lease}}


def runs_nixl(cfg: object) -> bool:
    """Whether a server with this kv-transfer config runs a NIXL connector (itself or a child)."""
    return handshake_connector(cfg) is not None


def _host_buffer(cfg: object) -> bool:
    """Whether the config's NIXL connector keeps KV in host memory (kv_buffer_device cpu)."""
    if not isinstance(cfg, Mapping):
        return False
    if cfg.get("kv_connector") == handshake_connector(cfg):
        return cfg.get("kv_buffer_device") == "cpu"
    extra = cfg.get("kv_connector_extra_config")
    listed = extra.get("connectors") if isinstance(extra, Mapping) else None
    return any(_host_buffer(c) for c in listed or () if isinstance(c, Mapping))


def server_env(cfg: object, side_channel_port: int, logging_config: Path | None) -> dict[str, str]:
    """The environment a NIXL server gets from kvctl (its role's own env goes on top)."""
    env = {SIDE_CHANNEL_HOST_ENV: SIDE_CHANNEL_HOST, SIDE_CHANNEL_PORT_ENV: str(side_channel_port)}
    if _host_buffer(cfg):
        env["UCX_TLS"] = UCX_TLS
    if logging_config is not None:
        env[LOGGING_CONFIG_ENV] = str(logging_config)
    return env


def pod_env(cfg: object) -> list[dict]:
    """A Kubernetes pod's NIXL env (container env entries): the side channel on the pod's own
    IP (the downward API), POD_SIDE_CHANNEL_PORT, UCX_TLS for a host buffer."""
    env = [{"name": SIDE_CHANNEL_HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": SIDE_CHANNEL_PORT_ENV, "value": str(POD_SIDE_CHANNEL_PORT)}]
    if _host_buffer(cfg):
        env.append({"name": "UCX_TLS", "value": UCX_TLS})
    return env


def logging_config() -> dict:
    """vLLM's logging config with DEBUG_LOGGERS at DEBUG (see the module docstring)."""
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"vllm": {"()": "vllm.logging_utils.NewLineFormatter", "datefmt": "%m-%d %H:%M:%S",
                                "format": _VLLM_FORMAT, "log_level": "INFO"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "DEBUG",
                              "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
                    **{name: {"level": "DEBUG"} for name in DEBUG_LOGGERS}},
    }


def write_logging_config(cdir: Path) -> Path:
    path = cdir / LOGGING_CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(logging_config(), indent=1) + "\n")
    return path


def given_port(env: Mapping[str, str], field: str) -> int | None:
    """The side-channel port a role's env names (the first of its instances'), or None.

    Raises BadInput naming `field` for a value that is not a port number.
    """
    text = env.get(SIDE_CHANNEL_PORT_ENV)
    if text is None:
        return None
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise BadInput(f"{SIDE_CHANNEL_PORT_ENV}={text!r} is not a port", field=field,
                       fix="give a port number (1024-65535), or leave it out for a free one per instance")
    return port
