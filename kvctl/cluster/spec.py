"""Cluster spec: what to launch, validated, with the defaults filled in. Starts nothing.

`build_1p1d_spec` turns the inputs of `kvctl launch 1p1d` or a scenario into a
ClusterSpec (`build_pd_spec`: the same with N prefill and M decode instances,
`kvctl launch pd`): the model dir, each role's kv-transfer-config (validated through
connectors.config), ports, environment, the shared store, the runtime and its
options, and each role's engine (v0 or v1: the rig it runs from and the
vLLM arguments it gets). Errors name the field at fault (`model`, `prefill_config`, `timeout`,
...); each front end spells it its own way. Where the cluster's state lives
is kvctl.cluster.state; parsing typed values is kvctl.cluster.parse.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from connectors.config.topology import LMCACHE_V1_CONNECTOR, named_connectors, transfer_store
from connectors.config.validate import (LMCACHE_V1_ON_CPU, LMCACHE_V1_ON_CPU_FIX, ConfigError,
                                        registered_v0_connectors, validate_kv_transfer_config)
from kvctl.cluster import nixl
from kvctl.cluster.lmcache import LMCacheOptions, check_lmcache_options
from kvctl.cluster.state import DEFAULT_NAME, check_api_key, check_store_keys, cluster_dir, validate_cluster_name
from kvctl.errors import BadInput
from kvctl.provision import model_catalog, model_get
from kvctl.provision.tiny_model import ensure_default_model
from kvctl.router.config import DEFAULT_HOST as ROUTER_HOST  # the router binds loopback unless told otherwise
from kvctl.runtime import DEFAULT_RUNTIME, runtime_class
from kvctl.runtime.base import BLOCK_SIZE, DEFAULT_ENGINE, ENGINES, MAX_MODEL_LEN
from kvctl.runtime.docker_options import DockerOptions, gpu_lists

DEFAULT_TIMEOUT_S = 300.0  # launch: both servers healthy within this
DEFAULT_WORKER_CLS = "connectors.v0.cpu_worker.KVTransferCPUWorker"  # adds the V0 KV hooks on CPU
_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
           "float16": "float16", "half": "float16"}


class DefaultConfig:
    """The type of DEFAULT_CONFIG: "use the default FSConnector config for this role"."""

    def __repr__(self) -> str:
        return "DEFAULT_CONFIG"


DEFAULT_CONFIG = DefaultConfig()


@dataclass(frozen=True)
class RoleSpec:
    kv_transfer_config: dict | None  # None: start the server without a connector
    port: int = 0  # 0: a free loopback port chosen at launch
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND
    extra_args: tuple[str, ...] = ()  # extra vLLM arguments, verbatim
    env: Mapping[str, str] = field(default_factory=dict)
    engine: str = DEFAULT_ENGINE  # "v0" | "v1"
    cpu_binds: tuple[str, ...] = ()  # one per instance of a pool (the first is cpu_bind)


@dataclass(frozen=True)
class ClusterSpec:
    """A validated 1P1D cluster to launch (build it with `build_1p1d_spec`)."""

    name: str
    runtime: str  # concrete: a name of kvctl.runtime.RUNTIMES that starts servers
    model: Path  # absolute HF model dir
    served_model_name: str
    dtype: str
    store: Path  # absolute shared store dir
    prefill: RoleSpec
    decode: RoleSpec
    worker_cls: str | None = DEFAULT_WORKER_CLS  # V0 roles only; None: vLLM's default worker
    block_size: int = BLOCK_SIZE  # V0 roles only; V1 roles keep vLLM's default (extra args may set it)
    max_model_len: int = MAX_MODEL_LEN
    timeout_s: float = DEFAULT_TIMEOUT_S
    docker: DockerOptions | None = None  # image, GPUs, bind address, engines (docker runtime only)
    router: bool = True  # start kvctl's router: one endpoint in front of P and D
    router_host: str = ROUTER_HOST  # the address the router binds (0.0.0.0: every interface)
    router_port: int = 0  # 0: a free port chosen at launch
    # xPyD pools: how many instances of each role (one RoleSpec each: same config, store,
    # args, env and engine). `pooled` names them prefill-0, decode-0, ...; else (1P1D)
    # the one instance of each role is named after it.
    prefill_count: int = 1
    decode_count: int = 1
    pooled: bool = False
    # When set, every server and the router require `Authorization: Bearer <api_key>` on /v1/*
    # (kvctl.cluster.lifecycle passes it in their environment, never on a command line).
    api_key: str | None = field(default=None, repr=False)
    # Instance name -> its NIXL side-channel port (kvctl.cluster.nixl), for every instance whose
    # config runs a NIXL connector; 0: a free one chosen at launch.
    side_channel_ports: Mapping[str, int] = field(default_factory=dict)
    # Store keys (first signs): every server signs its entries and serves only signed ones;
    # kept in CLUSTER_DIR/store_key (0600), passed in the servers' environment. (): unkeyed.
    store_keys: tuple[str, ...] = field(default=(), repr=False)
    # The LMCache servers of the instances whose config names LMCacheMPConnector: one per
    # instance (P-local) or one shared, their cache size and chunk (kvctl.cluster.lmcache).
    lmcache: LMCacheOptions = field(default_factory=LMCacheOptions)

    def role(self, role: str) -> RoleSpec:
        return {"prefill": self.prefill, "decode": self.decode}[role]

    def count(self, role: str) -> int:
        return {"prefill": self.prefill_count, "decode": self.decode_count}[role]

    def instances(self) -> tuple[PlannedInstance, ...]:
        """Every server to start, prefills first: its name, role, port and CPU bind."""
        planned = []
        names = iter(instance_names(self.prefill_count, self.decode_count, self.pooled))
        for role in ("prefill", "decode"):
            rs, n = self.role(role), self.count(role)
            for i in range(n):
                planned.append(PlannedInstance(
                    name=next(names), role=role, port=rs.port + i if rs.port else 0,
                    cpu_bind=rs.cpu_binds[i] if i < len(rs.cpu_binds) else rs.cpu_bind))
        return tuple(planned)

    def instance_names(self) -> tuple[str, ...]:
        """Every instance's name, in launch order (a runtime's LaunchPlan)."""
        return tuple(p.name for p in self.instances())

    def role_engines(self) -> dict[str, str]:
        """Each role's vLLM engine (a runtime's LaunchPlan)."""
        return {"prefill": self.prefill.engine, "decode": self.decode.engine}


def instance_names(prefill: int, decode: int, pooled: bool) -> tuple[str, ...]:
    """The instances' names, prefills first: `prefill`, `decode` for 1P1D (not `pooled`),
    else (or for a role with several) prefill-0, ..., decode-0, ..."""
    return tuple(f"{role}-{i}" if pooled or n > 1 else role
                 for role, n in (("prefill", prefill), ("decode", decode)) for i in range(n))


@dataclass(frozen=True)
class PlannedInstance:
    """One server of a ClusterSpec (its role's RoleSpec holds the rest)."""

    name: str  # its key in cluster.json: "prefill" (1P1D) or "prefill-0", ...
    role: str  # "prefill" | "decode"
    port: int  # 0: a free loopback port chosen at launch
    cpu_bind: str | None  # VLLM_CPU_OMP_THREADS_BIND


# --- building a spec from user input ---

def default_kv_config(role: str, store: Path, transfer: str = nixl.DEFAULT_TRANSFER) -> dict:
    """The transfer's default config of `role`. fs (the seed's shape): FSConnector, producer on
    P, consumer on D, one shared store; nixl: vLLM's NixlConnector (kvctl.cluster.nixl)."""
    if transfer == "nixl":
        return nixl.default_config(role, len(available_cores()))
    return {"kv_connector": "FSConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": {"fs_storage_path": str(store)}}


def check_transfer(transfer: str, engines: Mapping[str, str]) -> str:
    """`transfer` when it is one of nixl.TRANSFERS and runs on the roles' engines; else BadInput
    naming `transfer`."""
    if transfer not in nixl.TRANSFERS:
        raise BadInput(f"unknown transfer {transfer!r}", field="transfer",
                       fix=f"use one of: {', '.join(nixl.TRANSFERS)} (default {nixl.DEFAULT_TRANSFER})")
    if transfer == "nixl" and set(engines.values()) != {"v1"}:
        raise BadInput("NIXL (vLLM's NixlConnector) runs on vLLM V1 only, not on engine v0",
                       field="transfer", fix="launch both roles on engine v1")
    return transfer


def side_channel_ports(planned: tuple[PlannedInstance, ...], configs: Mapping[str, object],
                       envs: Mapping[str, Mapping[str, str]]) -> dict[str, int]:
    """Each NIXL instance's side-channel port: the role's given one plus the instance's index
    in its pool, checked free now; 0 (a free one at launch) when none is given.

    Raises BadInput naming the role's env and the instance when a given port is taken.
    """
    ports: dict[str, int] = {}
    index = {"prefill": 0, "decode": 0}
    for p in planned:
        i, index[p.role] = index[p.role], index[p.role] + 1
        if not nixl.runs_nixl(configs[p.role]):
            continue
        field = f"{p.role}_env"
        base = nixl.given_port(envs[p.role], field)
        if base is None:
            ports[p.name] = 0
            continue
        port = base + i
        error = _bind_error(nixl.SIDE_CHANNEL_HOST, port) if port < 65536 else OSError(0, "out of range")
        if error is not None:
            raise BadInput(f"the NIXL side-channel port {port} of {p.name} is not available: {error.strerror}",
                           field=field, fix=f"give {p.role} another {nixl.SIDE_CHANNEL_PORT_ENV} (each of its "
                                            "instances takes the next one), or leave it out for free ones")
        ports[p.name] = port
    taken = [port for port in ports.values() if port]
    if len(taken) != len(set(taken)):
        raise BadInput(f"two instances would share a NIXL side-channel port ({sorted(taken)})",
                       field=("prefill_env", "decode_env"),
                       fix=f"give P and D {nixl.SIDE_CHANNEL_PORT_ENV} values further apart than their pool sizes")
    return ports


def check_engine(engine: str, field: str) -> str:
    """`engine` when it is one of ENGINES; else BadInput naming `field`."""
    if engine not in ENGINES:
        raise BadInput(f"unknown engine {engine!r}", field=field,
                       fix=f"use one of: {', '.join(ENGINES)} (default {DEFAULT_ENGINE})")
    return engine


def validate_kv_config(cfg: dict, role: str, env: Mapping[str, str], engine: str = DEFAULT_ENGINE) -> None:
    """Validate `role`'s config with connectors.config.validate, for `engine`.

    Raises BadInput (field `<role>_config`) listing every problem. `env` is
    the server's environment: KVCTL_EXTRA_CONNECTORS there adds names.
    """
    try:
        registered = registered_v0_connectors({**os.environ, **env})
        validate_kv_transfer_config(cfg, registered=registered, engine=engine)
    except ValueError as e:  # ConfigError, or a malformed KVCTL_EXTRA_CONNECTORS
        problems = e.problems if isinstance(e, ConfigError) else []
        lines = [f"  {p.path}: {p.message} (fix: {p.fix})" for p in problems]
        raise BadInput(f"invalid kv-transfer-config for the {role} server", field=f"{role}_config",
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
    """An absolute HF model dir: `model`, a catalog name (`kvctl model list`: fetched and
    converted on first use), else the default tiny model.

    Raises BadInput for a missing dir or one without config.json; what
    model_get.get raises for a catalog model that cannot be fetched.
    """
    if model is None:
        return Path(ensure_default_model()).resolve()
    if not model.expanduser().exists() and model_catalog.find(str(model)) is not None:
        return model_get.get(str(model)).path
    model = model.expanduser().resolve()
    if model.exists() and not model.is_dir():
        raise BadInput(f"{model} is a file, not a model directory", field="model",
                       fix="pass the Hugging Face model directory that holds config.json and the weights")
    if not model.is_dir():
        raise BadInput(f"model directory not found: {model}", field="model",
                       fix="pass an existing Hugging Face model directory "
                           "(`kvctl model tiny` makes a tiny one)")
    if not (model / "config.json").is_file():
        raise BadInput(f"{model} has no config.json, so it is not a Hugging Face model directory",
                       field="model", fix="pass the directory that holds config.json and the weights")
    return model


def check_port_free(port: int, field: str, host: str = "127.0.0.1") -> None:
    """Raises BadInput naming `field` when `port` on `host` cannot be bound (in use, or privileged)."""
    if not 0 < port < 65536:
        raise BadInput(f"port {port} is out of range", field=field,
                       fix="use 1024-65535, or leave it out for a free one")
    error = _bind_error(host, port)
    if error is not None:
        raise BadInput(f"port {port} is not available: {error.strerror}", field=field,
                       fix="pick another port, or leave it out for a free one")


def _bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on (`host`, `port`) now (port 0: any port), or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def check_router_address(host: str, port: int, router: bool, taken: set[int]) -> None:
    """The router's bind address and port: an IP address of this host, a free port not given to a server.

    Raises BadInput naming `router_host` or `router_port`.
    """
    given = [f for f, v in (("router_host", host != ROUTER_HOST), ("router_port", port != 0)) if v]
    if given and not router:
        raise BadInput("the router's address is set but no router is started", field=tuple(given),
                       fix="drop the router's address, or start the router")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise BadInput(f"{host!r} is not an IP address", field="router_host",
                       fix="give an address of this host, e.g. 127.0.0.1 (the default) or 0.0.0.0 for every "
                           "interface") from None
    if port in taken:
        raise BadInput(f"the router and a server cannot both use port {port}", field="router_port",
                       fix="give the router another port, or leave it out for a free one")
    if port:
        check_port_free(port, "router_port", host)
    elif (error := _bind_error(host, 0)) is not None:
        raise BadInput(f"cannot listen on {host}: {error.strerror}", field="router_host",
                       fix="give an address of this host (ip addr lists them), or 0.0.0.0")


_SIDES = {"prefill": "send", "decode": "recv"}


def shared_store(configs: Mapping[str, object], store: Path | None, cdir: Path) -> Path:
    """The one directory P's transfer child writes and D's reads: the cluster's store.

    A given config names it through its transfer child's `fs_storage_path`
    (relative paths resolve against the servers' cwd, `cdir`); `store` names
    it explicitly; otherwise it is `cdir/store`. When only one side names a
    path, the other side's default config uses it. Raises BadInput when two
    of them name different directories: P and D would never meet.
    """
    named: dict[str, Path] = {}
    for role, cfg in configs.items():
        path = transfer_store(cfg, _SIDES[role]) if isinstance(cfg, dict) else None
        if path:
            named[f"{role}_config"] = (cdir / Path(path).expanduser()).resolve()
    if store is not None:
        store_dir = store.expanduser().resolve()
        if store_dir.exists() and not store_dir.is_dir():
            raise BadInput(f"the store {store_dir} is a file, not a directory", field="store",
                           fix="name a directory (it is created when missing)")
        named = {"store": store_dir, **named}
    if len(set(named.values())) > 1:
        listed = "; ".join(f"{f} uses {p}" for f, p in named.items())
        raise BadInput(f"prefill and decode would never meet: {listed}", field=tuple(named),
                       fix="point every fs_storage_path of the transfer connectors (and the store, if "
                           "given) at one shared directory, or name it on one side only")
    return next(iter(named.values()), cdir / "store")


def available_cores() -> list[int]:
    """The cores this process may run on, sorted."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]


def spread_cpu_binds(count: int, cores: list[int] | None = None) -> list[str]:
    """One core per server, round robin over `cores` (default: the available ones).

    Servers share a core only when there are more servers than cores (OMP
    threads of two servers on one core slow both).
    """
    cores = cores if cores else available_cores()
    return [str(cores[i % len(cores)]) for i in range(count)]


MAX_POOL = 64  # instances of one role: far beyond one host, low enough to catch a typo


def check_pool_sizes(prefill: int, decode: int) -> None:
    """Raises BadInput naming the field (`prefill`, `decode`) for a pool size below 1 or too large."""
    for n, role in ((prefill, "prefill"), (decode, "decode")):
        if not 1 <= n <= MAX_POOL:
            raise BadInput(f"the {role} pool needs 1 to {MAX_POOL} instances, got {n}", field=role,
                           fix=f"give the number of {role} instances, e.g. 2")


def build_1p1d_spec(*, name: str = DEFAULT_NAME, runtime: str = DEFAULT_RUNTIME, model: Path | None = None,
                    served_model_name: str | None = None,
                    prefill_config: dict | None | DefaultConfig = DEFAULT_CONFIG,
                    decode_config: dict | None | DefaultConfig = DEFAULT_CONFIG,
                    store: Path | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                    prefill_port: int = 0, decode_port: int = 0,
                    prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (),
                    prefill_env: Mapping[str, str] | None = None,
                    decode_env: Mapping[str, str] | None = None,
                    worker_cls: str | None = DEFAULT_WORKER_CLS,
                    docker: DockerOptions | None = None, router: bool = True,
                    prefill_engine: str = DEFAULT_ENGINE, decode_engine: str = DEFAULT_ENGINE,
                    prefill_count: int = 1, decode_count: int = 1, pooled: bool = False,
                    api_key: str | None = None, router_host: str = ROUTER_HOST,
                    router_port: int = 0, transfer: str = nixl.DEFAULT_TRANSFER,
                    store_keys: Sequence[str] = (), lmcache: LMCacheOptions | None = None) -> ClusterSpec:
    """A validated ClusterSpec with the defaults filled in. Starts nothing.

    `prefill_count`/`decode_count` instances of each role (`pooled` names them
    prefill-0, ...; build_pd_spec sets it): each role's instances share its
    config (so all share the one store), args, env and engine; each gets its
    own port (a given port is the first of consecutive ones) and core.

    `api_key`: every server and the router require it (None: no key).
    `transfer`: what the default configs carry KV with: fs (FSConnector, one shared store)
    or nixl (vLLM's NixlConnector, engine v1; kvctl.cluster.nixl). Every instance whose
    config runs NIXL, given or default, gets its own side-channel port.
    `store_keys`: the servers sign entries with the first and serve only entries
    signed with one of them (connectors.store.auth; (): an unkeyed store).
    `lmcache`: how the LMCache servers run, for configs naming LMCacheMPConnector
    (default: one per instance that names it, P-local: the seed's shape).
    `router_host`/`router_port`: where the router listens (default 127.0.0.1, a free port).

    On the docker runtime every instance is a container (pools included);
    `docker.gpus` must give each instance its device list (docker_options.gpu_lists).

    Raises BadInput naming the field for: a bad name, a missing model dir, an
    invalid config, a port in use, equal ports, a non-positive timeout, docker
    options for another runtime, an unknown engine, GPU lists that do not
    match the instances, an empty API key. Fields: `name`, `model`, `prefill_config`,
    `decode_config`, `prefill_port`, `decode_port`, `timeout`, `runtime`,
    `prefill_engine`, `decode_engine`, `prefill`, `decode` (pool sizes), `gpus`,
    `api_key`, `router_host`, `router_port`, `transfer`, `prefill_env`/`decode_env` (a NIXL
    side-channel port that is taken: the message names the instance and the port),
    `lmcache_sharing` (and the other `lmcache_*` options).
    """
    validate_cluster_name(name)
    lmcache = check_lmcache_options(lmcache or LMCacheOptions())
    if api_key is not None:
        check_api_key(api_key)
    check_pool_sizes(prefill_count, decode_count)
    engines = {"prefill": check_engine(prefill_engine, "prefill_engine"),
               "decode": check_engine(decode_engine, "decode_engine")}
    check_transfer(transfer, engines)
    if docker is not None and not runtime_class(runtime).docker_options:
        raise BadInput(f"the image, gpus, bind address and docker hosts need the docker runtime, "
                       f"not {runtime}", field="runtime",
                       fix="choose the docker runtime, or drop the docker options")
    if docker is not None and docker.gpus:  # one device list per instance, by name or in order
        gpu_lists(docker.gpus, instance_names(prefill_count, decode_count, pooled))
    if timeout_s <= 0:
        raise BadInput(f"timeout must be positive, got {timeout_s}", field="timeout",
                       fix="pass seconds, e.g. 300")
    cdir = cluster_dir(name)
    configs = {"prefill": prefill_config, "decode": decode_config}
    store_dir = shared_store(configs, store, cdir)
    model_dir = resolve_model(model)
    for role in ("prefill", "decode"):
        if isinstance(configs[role], DefaultConfig):
            configs[role] = default_kv_config(role, store_dir, transfer)
        elif configs[role] is not None:
            validate_kv_config(configs[role], role, (prefill_env if role == "prefill" else decode_env) or {},
                               engines[role])
    p_ports = range(prefill_port, prefill_port + prefill_count) if prefill_port else range(0)
    d_ports = range(decode_port, decode_port + decode_count) if decode_port else range(0)
    for ports, port_field in ((p_ports, "prefill_port"), (d_ports, "decode_port")):
        for port in ports:
            check_port_free(port, port_field)
    if set(p_ports) & set(d_ports):
        raise BadInput(f"prefill and decode cannot both use port {min(set(p_ports) & set(d_ports))}",
                       field=("prefill_port", "decode_port"), fix="give them different ports")
    check_router_address(router_host, router_port, router, set(p_ports) | set(d_ports))
    binds = spread_cpu_binds(prefill_count + decode_count)  # 1P1D: one core for P, another for D
    p_binds, d_binds = tuple(binds[:prefill_count]), tuple(binds[prefill_count:])
    p_bind, d_bind = p_binds[0], d_binds[0]
    names = instance_names(prefill_count, decode_count, pooled)
    planned = tuple(PlannedInstance(n, "prefill" if n.startswith("prefill") else "decode", 0, None) for n in names)
    side_ports = side_channel_ports(planned, configs, {"prefill": prefill_env or {}, "decode": decode_env or {}})
    return ClusterSpec(
        name=name, runtime=runtime, model=model_dir,
        served_model_name=served_model_name or model_dir.name,
        dtype=model_dtype(model_dir), store=store_dir,
        prefill=RoleSpec(configs["prefill"], prefill_port, p_bind, tuple(prefill_args),
                         dict(prefill_env or {}), engines["prefill"], p_binds),
        decode=RoleSpec(configs["decode"], decode_port, d_bind, tuple(decode_args),
                        dict(decode_env or {}), engines["decode"], d_binds),
        worker_cls=worker_cls, timeout_s=timeout_s, docker=docker, router=router,
        router_host=router_host, router_port=router_port,
        prefill_count=prefill_count, decode_count=decode_count, pooled=pooled, api_key=api_key,
        side_channel_ports=side_ports, store_keys=check_store_keys(store_keys), lmcache=lmcache)


def launch_warnings(spec: ClusterSpec) -> list[str]:
    """What a valid spec will not do as its user may expect (shown before the launch)."""
    warnings = []
    if (spec.prefill.engine, spec.decode.engine) == ("v1", "v0") and spec.decode.kv_transfer_config is not None:
        warnings.append("a V1 prefill in front of a V0 decode: V1 entries carry no hidden state, which V0 "
                        "needs, so D recomputes every prompt (the migration path is a V0 prefill in front "
                        "of a V1 decode)")
    on_cpu = spec.docker is None or not spec.docker.gpus  # the rigs and the CPU image have no GPU
    for role in ("prefill", "decode"):
        rs = spec.role(role)
        if on_cpu and rs.engine == "v1" and named_connectors(rs.kv_transfer_config, LMCACHE_V1_CONNECTOR):
            warnings.append(f"the {role} config names {LMCACHE_V1_CONNECTOR}: {LMCACHE_V1_ON_CPU} "
                            f"(fix: {LMCACHE_V1_ON_CPU_FIX})")
    return warnings


def build_pd_spec(*, prefill: int, decode: int, **options: object) -> ClusterSpec:
    """An xPyD ClusterSpec: `prefill` instances named prefill-0, ..., `decode` named decode-0, ...

    `options` are build_1p1d_spec's (each role's config, args, env and engine
    go to every instance of that role), `runtime` included: on docker each
    instance is a container with its own GPU list (`docker.gpus`: one per
    instance, in this order or by name). Raises BadInput as it does, and
    naming `prefill`/`decode` for a bad pool size.
    """
    return build_1p1d_spec(prefill_count=prefill, decode_count=decode, pooled=True, **options)  # type: ignore[arg-type]
