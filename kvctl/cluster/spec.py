"""Cluster spec (what to launch) and cluster state (what is running), and where state lives.

State is one JSON file per cluster, `$KVCTL_HOME/clusters/<name>/cluster.json`:

    {"name": str, "runtime": "local"|"docker", "model": abs path,
     "served_model_name": str, "store": abs host path of the shared store dir,
     "created": ISO-8601 UTC,
     "instances": {"prefill": {...}, "decode": {...}}}

Each instance: `role`, `url`, `pid` (local) or `container_id` (docker) plus
runtime extras (`start_ticks`, `command`), `log_path`, `kv_transfer_config`
(dict, or null for a server without a connector), `cwd`. Other kvctl modules
(verify, inspect-store, scenarios) read these fields: they are a contract.
The cluster dir also holds the servers' cwd, their logs under `logs/`, and
the default store `store/`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from connectors.config.validate import (ConfigError, fs_storage_paths, registered_v0_connectors,
                               validate_kv_transfer_config)
from kvctl.errors import BadInput
from kvctl.paths import kvctl_home
from kvctl.runtime.base import BLOCK_SIZE, MAX_MODEL_LEN
from kvctl.runtime.docker import DockerOptions

log = logging.getLogger(__name__)

DEFAULT_NAME = "default"
DEFAULT_TIMEOUT_S = 300.0  # launch: both servers healthy within this
DEFAULT_WORKER_CLS = "connectors.v0.cpu_worker.KVTransferCPUWorker"  # adds the V0 KV hooks on CPU
STATE_FILE = "cluster.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
           "float16": "float16", "half": "float16"}


class _Default:
    """Marker: "use the default FSConnector config for this role"."""

    def __repr__(self) -> str:
        return "DEFAULT_CONFIG"


DEFAULT_CONFIG = _Default()


@dataclass(frozen=True)
class RoleSpec:
    kv_transfer_config: dict | None  # None: start the server without a connector
    port: int = 0  # 0: a free loopback port chosen at launch
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND
    extra_args: tuple[str, ...] = ()  # extra vLLM arguments, verbatim
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterSpec:
    """A validated 1P1D cluster to launch (build it with `build_1p1d_spec`)."""

    name: str
    runtime: str  # concrete: "local" | "docker"
    model: Path  # absolute HF model dir
    served_model_name: str
    dtype: str
    store: Path  # absolute shared store dir
    prefill: RoleSpec
    decode: RoleSpec
    worker_cls: str | None = DEFAULT_WORKER_CLS  # None: vLLM's default worker
    block_size: int = BLOCK_SIZE
    max_model_len: int = MAX_MODEL_LEN
    timeout_s: float = DEFAULT_TIMEOUT_S
    docker: DockerOptions | None = None  # image, GPUs, bind address, engines (docker runtime only)

    def role(self, role: str) -> RoleSpec:
        return {"prefill": self.prefill, "decode": self.decode}[role]


@dataclass
class InstanceRecord:
    role: str
    url: str
    log_path: str
    kv_transfer_config: dict | None
    cwd: str
    runtime_fields: dict[str, Any]  # `pid`, `start_ticks`, `command` / `container_id`

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "url": self.url, **self.runtime_fields,
                "log_path": self.log_path, "kv_transfer_config": self.kv_transfer_config,
                "cwd": self.cwd}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> InstanceRecord:
        known = {"role", "url", "log_path", "kv_transfer_config", "cwd"}
        return cls(role=d["role"], url=d["url"], log_path=d["log_path"],
                   kv_transfer_config=d.get("kv_transfer_config"), cwd=d["cwd"],
                   runtime_fields={k: v for k, v in d.items() if k not in known})


@dataclass
class ClusterState:
    name: str
    runtime: str
    model: str
    served_model_name: str
    store: str
    created: str
    instances: dict[str, InstanceRecord] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "runtime": self.runtime, "model": self.model,
                "served_model_name": self.served_model_name, "store": self.store,
                "created": self.created,
                "instances": {r: i.to_json() for r, i in self.instances.items()}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ClusterState:
        return cls(name=d["name"], runtime=d["runtime"], model=d["model"],
                   served_model_name=d["served_model_name"], store=d["store"],
                   created=d["created"],
                   instances={r: InstanceRecord.from_json(i) for r, i in d["instances"].items()})


# --- where state lives ---

def validate_cluster_name(name: str) -> str:
    if not _NAME_RE.match(name or ""):
        raise BadInput(f"invalid cluster name {name!r}", where="--name",
                       fix="use letters, digits, '.', '_' or '-' (at most 63, not starting with '.' or '-')")
    return name


def clusters_root() -> Path:
    return kvctl_home() / "clusters"


def cluster_dir(name: str) -> Path:
    return clusters_root() / validate_cluster_name(name)


def list_clusters() -> list[str]:
    """Names of clusters that have state (a cluster.json), sorted."""
    root = clusters_root()
    if not root.is_dir():
        return []
    return sorted(p.parent.name for p in root.glob(f"*/{STATE_FILE}"))


def save_cluster(state: ClusterState) -> Path:
    """Write cluster.json atomically (temp file + rename): readers never see half a file."""
    path = cluster_dir(state.name) / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(state.to_json(), indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def remove_state(name: str) -> None:
    (cluster_dir(name) / STATE_FILE).unlink(missing_ok=True)


def _unknown_cluster(name: str, where: Path) -> BadInput:
    existing = list_clusters()
    fix = (f"use --name with one of: {', '.join(existing)}" if existing
           else f"launch one with `kvctl launch 1p1d --name {name}`")
    return BadInput(f"no cluster named {name!r}", where=str(where), fix=fix)


def load_cluster(name: str) -> ClusterState:
    """The state of cluster `name`.

    Raises BadInput naming the cluster and the existing ones when there is no
    such cluster or its cluster.json is unreadable.
    """
    path = cluster_dir(name) / STATE_FILE
    try:
        data = json.loads(path.read_text())
        return ClusterState.from_json(data)
    except FileNotFoundError:
        raise _unknown_cluster(name, path) from None
    except (ValueError, KeyError, TypeError) as e:
        raise BadInput(f"the state of cluster {name!r} is unreadable: {e}", where=str(path),
                       fix=f"remove it with `kvctl down --name {name}`") from None


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --- building a spec from user input ---

def parse_config_option(value: str | None, option: str) -> dict | None | _Default:
    """A --prefill-config/--decode-config value: JSON, @file, `none` or `default`.

    Raises BadInput naming the option for unreadable files and invalid JSON.
    """
    if value is None or value.strip().lower() == "default":
        return DEFAULT_CONFIG
    if value.strip().lower() == "none":
        return None
    text, where = value, option
    if value.startswith("@"):
        path = Path(value[1:]).expanduser()
        where = f"{option} {path}"
        try:
            text = path.read_text()
        except OSError as e:
            raise BadInput(f"cannot read {path}: {e.strerror}", where=option,
                           fix="pass an existing JSON file as @PATH, or the JSON itself") from None
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise BadInput(f"not valid JSON: {e}", where=where,
                       fix="pass a kv-transfer-config JSON object, e.g. "
                           '\'{"kv_connector":"FSConnector","kv_role":"kv_producer",...}\'') from None
    if not isinstance(cfg, dict):
        raise BadInput(f"a kv-transfer-config must be a JSON object, got {type(cfg).__name__}",
                       where=where, fix='pass an object like {"kv_connector": ..., "kv_role": ...}')
    return cfg


def default_kv_config(role: str, store: Path) -> dict:
    """The seed's shape: FSConnector, producer on P, consumer on D, one shared store."""
    return {"kv_connector": "FSConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": {"fs_storage_path": str(store)}}


def validate_kv_config(cfg: dict, option: str, env: Mapping[str, str]) -> None:
    """Validate with connectors.config.validate; raises BadInput listing every problem.

    `env` is the server's environment: KVCTL_EXTRA_CONNECTORS there adds names.
    """
    try:
        registered = registered_v0_connectors({**os.environ, **env})
        validate_kv_transfer_config(cfg, registered=registered)
    except ValueError as e:  # ConfigError, or a malformed KVCTL_EXTRA_CONNECTORS
        problems = e.problems if isinstance(e, ConfigError) else []
        lines = [f"  {p.path}: {p.message} (fix: {p.fix})" for p in problems]
        raise BadInput(f"invalid kv-transfer-config in {option}", where=option,
                       fix="correct the fields listed below (`kvctl validate` checks a config file)",
                       details="\n".join(lines) or str(e)) from None


def model_dtype(model: Path) -> str:
    """The vLLM --dtype for a HF model dir, from its config.json (`auto` if unknown)."""
    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    return _DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or ""), "auto")


def resolve_model(model: Path | None) -> Path:
    """An absolute HF model dir: `model`, else the default tiny model.

    Raises BadInput for a missing dir or one without config.json.
    """
    if model is None:
        try:
            from kvctl.provision.tiny_model import ensure_default_model
        except ModuleNotFoundError as e:
            if e.name != "kvctl.provision.tiny_model":
                raise
            raise BadInput("no default model in this kvctl yet", where="--model",
                           fix="pass --model PATH (a Hugging Face model directory)") from None
        return Path(ensure_default_model()).resolve()
    model = model.expanduser().resolve()
    if not model.is_dir():
        raise BadInput(f"model directory not found: {model}", where="--model",
                       fix="pass an existing Hugging Face model directory "
                           "(`kvctl model tiny --out DIR` makes a tiny one)")
    if not (model / "config.json").is_file():
        raise BadInput(f"{model} has no config.json, so it is not a Hugging Face model directory",
                       where="--model", fix="pass the directory that holds config.json and the weights")
    return model


def check_port_free(port: int, option: str) -> None:
    """Raises BadInput when `port` on 127.0.0.1 cannot be bound (in use, or privileged)."""
    if not 0 < port < 65536:
        raise BadInput(f"port {port} is out of range", where=option, fix="use 1024-65535, or omit it")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise BadInput(f"port {port} is not available: {e.strerror}", where=option,
                           fix="pick another port, or omit the option to use a free one") from None


def default_cpu_binds() -> tuple[str, str]:
    """One core for P, another for D (OMP threads of two servers must not share)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return str(cores[0]), str(cores[1 % len(cores)])


def parse_env_items(items: list[str] | tuple[str, ...], option: str) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BadInput(f"expected KEY=VALUE, got {item!r}", where=option,
                           fix=f"write it as {option} NAME=VALUE")
        env[key] = value
    return env


def build_1p1d_spec(*, name: str = DEFAULT_NAME, runtime: str = "local", model: Path | None = None,
                    served_model_name: str | None = None,
                    prefill_config: dict | None | _Default = DEFAULT_CONFIG,
                    decode_config: dict | None | _Default = DEFAULT_CONFIG,
                    store: Path | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                    prefill_port: int = 0, decode_port: int = 0,
                    prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (),
                    prefill_env: Mapping[str, str] | None = None,
                    decode_env: Mapping[str, str] | None = None,
                    worker_cls: str | None = DEFAULT_WORKER_CLS,
                    docker: DockerOptions | None = None) -> ClusterSpec:
    """A validated ClusterSpec with the defaults filled in. Starts nothing.

    Raises BadInput naming the field for: a bad name, a missing model dir, an
    invalid config, a port in use, equal ports, a non-positive timeout, docker
    options for another runtime.
    """
    validate_cluster_name(name)
    if docker is not None and runtime != "docker":
        raise BadInput(f"--image, --gpus, --bind and the docker hosts need --runtime docker, "
                       f"not {runtime}", where="--runtime", fix="add --runtime docker, or drop them")
    if timeout_s <= 0:
        raise BadInput(f"timeout must be positive, got {timeout_s}", where="--timeout",
                       fix="pass seconds, e.g. --timeout 300")
    model_dir = resolve_model(model)
    cdir = cluster_dir(name)
    configs = {"prefill": prefill_config, "decode": decode_config}
    user_paths = {str((cdir / p).resolve()) for c in configs.values()
                  if isinstance(c, dict) for p in fs_storage_paths(c)}  # relative to the servers' cwd
    if store is not None:
        store_dir = store.expanduser().resolve()
        if user_paths - {str(store_dir)}:
            log.warning("--store %s differs from fs_storage_path in the given configs (%s)",
                        store_dir, ", ".join(sorted(user_paths)))
    elif len(user_paths) == 1:
        store_dir = Path(user_paths.pop())  # the configs say where the store is
    else:
        store_dir = cdir / "store"
    for role, option in (("prefill", "--prefill-config"), ("decode", "--decode-config")):
        if isinstance(configs[role], _Default):
            configs[role] = default_kv_config(role, store_dir)
        elif configs[role] is not None:
            validate_kv_config(configs[role], option, (prefill_env if role == "prefill" else decode_env) or {})
    for port, option in ((prefill_port, "--prefill-port"), (decode_port, "--decode-port")):
        if port:
            check_port_free(port, option)
    if prefill_port and prefill_port == decode_port:
        raise BadInput(f"prefill and decode cannot both use port {prefill_port}",
                       where="--prefill-port, --decode-port", fix="give them different ports")
    p_bind, d_bind = default_cpu_binds()
    return ClusterSpec(
        name=name, runtime=runtime, model=model_dir,
        served_model_name=served_model_name or model_dir.name,
        dtype=model_dtype(model_dir), store=store_dir,
        prefill=RoleSpec(configs["prefill"], prefill_port, p_bind, tuple(prefill_args),
                         dict(prefill_env or {})),
        decode=RoleSpec(configs["decode"], decode_port, d_bind, tuple(decode_args),
                        dict(decode_env or {})),
        worker_cls=worker_cls, timeout_s=timeout_s, docker=docker)
