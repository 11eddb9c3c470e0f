"""The runtime contract: start a vLLM OpenAI server for one role, get an Instance.

A `Runtime` turns an `InstanceSpec` (everything one server needs, as explicit
fields) into a running `Instance`, and re-attaches to one from its record in
cluster.json (`attach`), so `kvctl status`/`down` work from another process.
An `Instance` is a thin model object in the docker-py manner: attributes
(name, role, url, log_path, and `pid` or `container_id`) plus `status()`,
`logs()`, `stop()` and `kill()`. Every runtime writes the server's output to
`log_path` on this host, so log tails, markers and `kvctl logs` never depend
on the runtime.

What callers may ask of a runtime is declared here, on `Runtime`: its
methods, and its capabilities as class attributes (`starts_servers`,
`host_rigs`, `docker_options`), so no caller compares a runtime's name or
probes for a method (kvctl.runtime's registry maps names to classes).

The vLLM command line and environment are built here, once, so the local and
docker runtimes start identical servers (they differ only in the python, the
model path and the bind address they pass in). Each instance names its engine
(`v0`: vLLM 0.9.x with VLLM_USE_V1=0 and our worker; `v1`: vLLM 0.11+ with
V1's defaults, prefix caching and chunked prefill on), which picks its
arguments here and its interpreter in the runtime.
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from connectors.config.names import DEFAULT_ENGINE, ENGINES, ROLES  # noqa: F401 - re-exported

# Start-up flags every V0 server gets (BRIEF section 4: the CPU V0 rig needs block
# size 16, eager mode and no prefix caching / chunked prefill, which break
# full-prompt keyed transfer). All were checked against vLLM 0.9.2's --help.
# V1 servers (BRIEF section 8) keep vLLM's defaults: prefix caching and chunked
# prefill on, block size 128 on CPU (multiples of 32 only); they get eager mode
# and no --disable-frontend-multiprocessing.
ENTRYPOINT_MODULE = "vllm.entrypoints.openai.api_server"
BLOCK_SIZE = 16  # tokens; the only size the CPU backend supports without IPEX
MAX_MODEL_LEN = 2048  # tokens; the tiny model's max positions
KV_CACHE_SPACE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE: caps each server's KV cache
STORE_KEY_ENVS = ("KVCTL_STORE_KEY", "KVCTL_STORE_KEY_FILE")  # connectors.store.auth reads these
STORE_KEY_ENV = STORE_KEY_ENVS[0]
API_KEY_ENV = "VLLM_API_KEY"  # vLLM (0.9 and V1) requires `Authorization: Bearer $VLLM_API_KEY` on /v1/*


@dataclass(frozen=True)
class InstanceSpec:
    """Everything one vLLM server needs. Paths are host paths."""

    cluster: str
    role: str  # "prefill" | "decode"
    model: Path  # HF model directory
    served_model_name: str
    dtype: str  # vLLM --dtype value, e.g. "float32"
    port: int  # host port the server listens on
    cwd: Path  # server working directory: relative fs_storage_path resolves here
    log_path: Path  # stdout+stderr of the server
    kv_transfer_config: dict | None = None  # None: no --kv-transfer-config
    worker_cls: str | None = None  # None: vLLM's default worker
    host: str = "127.0.0.1"
    block_size: int | None = BLOCK_SIZE  # None: vLLM's default (V1)
    max_model_len: int = MAX_MODEL_LEN
    engine: str = DEFAULT_ENGINE  # "v0" | "v1"
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0"
    extra_args: tuple[str, ...] = ()  # appended verbatim to the vLLM command line
    env: Mapping[str, str] = field(default_factory=dict)  # overrides ours
    name: str = ""  # the instance's name in its cluster (prefill-0, ...); "": its role
    # When set, the server requires `Authorization: Bearer <api_key>` on /v1/* (vLLM reads
    # VLLM_API_KEY from its environment: the key never appears on its command line or in `ps`).
    api_key: str | None = field(default=None, repr=False)
    # Store keys (first signs): the connector signs its entries and serves only signed ones.
    # Passed as $KVCTL_STORE_KEY (connectors.store.auth), like the API key never on a command line.
    store_keys: tuple[str, ...] = field(default=(), repr=False)

    @property
    def instance(self) -> str:
        """The instance's name: `name`, or its role for an unnamed one (1P1D, tests)."""
        return self.name or self.role


@dataclass(frozen=True)
class ServiceSpec:
    """A helper server a launch runs beside its vLLM servers (an LMCache server): `python -m
    module ARGS` from the environment of the extra `extra` (kvctl.provision.extras), which the
    instances named in `serves` reach at its `ports`. Paths are host paths."""

    cluster: str
    name: str  # its name in the cluster, e.g. lmcache-prefill
    role: str  # what it is: "lmcache"
    extra: str  # the extra whose packages run it
    module: str
    arguments: Callable[[str], list[str]]  # the module's arguments, given the address it binds
    ports: tuple[int, ...]  # every port it listens on (the same inside a container and out)
    url_port: int  # the port of its HTTP endpoint (health, metrics): its Instance's url
    serves: tuple[str, ...]  # instance names that talk to it
    serves_role: str  # their role ("prefill", "decode"): a docker runtime runs it on that role's engine
    cwd: Path
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)


def vllm_server_args(spec: InstanceSpec, *, model: str, host: str) -> list[str]:
    """The api_server arguments (after `python -m <module>`) for `spec`, per its engine.

    `model` and `host` are passed in because they differ per runtime (a
    container sees the model at its mount point and binds 0.0.0.0).
    """
    args = [
        "--model", model,
        "--served-model-name", spec.served_model_name,
        "--host", host,
        "--port", str(spec.port),
        "--dtype", spec.dtype,
    ]
    if spec.block_size is not None:
        args += ["--block-size", str(spec.block_size)]
    args += ["--max-model-len", str(spec.max_model_len), "--enforce-eager"]
    if spec.engine == "v0":
        args += ["--disable-frontend-multiprocessing",
                 "--no-enable-prefix-caching",
                 "--no-enable-chunked-prefill"]
    if spec.worker_cls:
        args += ["--worker-cls", spec.worker_cls]
    if spec.kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(spec.kv_transfer_config, separators=(",", ":"))]
    return args + list(spec.extra_args)


def vllm_server_env(spec: InstanceSpec) -> dict[str, str]:
    """Environment variables the server needs on top of the base environment (its API key
    included, as VLLM_API_KEY, when the spec has one)."""
    env = {
        # our V0 connectors need the V0 engine of vLLM 0.9.x (first: the key's old place)
        **({"VLLM_USE_V1": "0"} if spec.engine == "v0" else {}),
        # Every marker verify and the benches read (KV send DONE, skip/redo model
        # forwarding, sent to connector, Received request) is an INFO line or
        # above. A role's own env (the launch options, a scenario's env) overrides it.
        "VLLM_LOGGING_LEVEL": "INFO",
        "VLLM_HOST_IP": "127.0.0.1",  # else gloo binds the external interface
        "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_SPACE_GIB,
        "HF_HUB_OFFLINE": "1",  # models are local dirs; never wait on a hub
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",  # log lines reach the file as they happen
    }
    if spec.cpu_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_bind
    env.update(spec.env)
    if spec.api_key is not None:
        env[API_KEY_ENV] = spec.api_key
    if spec.store_keys:
        env[STORE_KEY_ENV] = ",".join(spec.store_keys)
    return env


@dataclass(frozen=True)
class InstanceStatus:
    """What the runtime knows about a server's process or container."""

    running: bool
    exit_code: int | None = None  # when known (our own child, or a container)
    detail: str = ""  # e.g. "exited with code 2", "process 123 is gone"
    healthy: bool | None = None  # set when the status itself asked /health (attached); None: not asked


@dataclass(frozen=True)
class StopResult:
    name: str  # the instance's name (prefill-0, router, ...)
    was_running: bool
    signal: str | None  # the strongest signal needed: "SIGTERM", "SIGKILL" or None
    seconds: float


@runtime_checkable
class Instance(Protocol):
    """One running (or formerly running) server."""

    name: str  # its name in the cluster: prefill, decode (1P1D), prefill-0, ... (pools), router
    role: str  # what it does: prefill, decode (router for the router, bench-plain for bench serve's plain server)
    url: str  # base URL reachable from this host, e.g. http://127.0.0.1:8100
    log_path: Path

    def status(self) -> InstanceStatus:
        """Whether the server's process/container is running. Never raises for a gone one."""

    def stop(self, grace_s: float = 10.0) -> StopResult:
        """Stop it (SIGTERM, then SIGKILL after `grace_s`); idempotent."""

    def kill(self) -> None:
        """SIGKILL it at once, no grace, no cleanup (fault injection: what a crash looks like).

        Raises BadInput for a server kvctl did not start. A gone one is not an error.
        """

    def logs(self, tail: int | None = None, follow: bool = False) -> Iterator[str]:
        """Lines of its log file (the last `tail` ones), then new ones while it runs if `follow`."""

    def record(self) -> dict[str, Any]:
        """Runtime-specific fields for its cluster.json record (`pid` or `container_id`, ...)."""


class LaunchPlan(Protocol):
    """What a runtime reads of the cluster it launches (kvctl.cluster.spec.ClusterSpec is one)."""

    @property
    def store(self) -> Path: ...

    @property
    def docker(self) -> DockerOptions | None:  # noqa: F821 - kvctl.runtime.docker_options imports this module
        """The docker options (image, GPUs, bind, engines), for a runtime that takes them."""

    def instance_names(self) -> tuple[str, ...]:
        """Every instance, in launch order (prefill, decode; or prefill-0, ..., decode-0, ...)."""

    def role_engines(self) -> dict[str, str]:
        """The vLLM engine of each role (`prefill`, `decode`)."""


class Runtime(Protocol):
    """Starts servers and re-attaches to them.

    Capabilities, read from the class (kvctl.runtime.runtime_class) before any is built:
    """

    name: ClassVar[str]  # its value of cluster.json's `runtime`: "local", "docker", "attached"
    # False: its clusters run elsewhere, kvctl did not start them (attached): never launched
    # under, stopped by `down`, killed by the fault bench or given a plain server.
    starts_servers: ClassVar[bool]
    # Its servers run from this host's rigs (`kvctl rig install`): launch makes sure the V0 rig
    # is there, `scenario list` reports a missing V1 rig, bench serve starts its plain server here.
    host_rigs: ClassVar[bool]
    # It takes DockerOptions (image, GPUs, bind address, docker hosts); for another runtime they
    # are refused (launch) or warned about as ignored (scenario files).
    docker_options: ClassVar[bool]

    @classmethod
    def for_cluster(cls, plan: LaunchPlan) -> Runtime:
        """The runtime that launches `plan` (its options, store and instances)."""

    def check(self) -> None:
        """Raise BadInput (with the fix) if this runtime cannot start servers here."""

    def check_instance(self, spec: InstanceSpec) -> None:
        """Raise BadInput if this runtime cannot start `spec` here (e.g. its engine's rig is
        missing); called for every instance before the first one starts."""

    def start(self, spec: InstanceSpec) -> Instance:
        """Start the server for `spec`; returns at once (health is the caller's wait).

        Raises BadInput for a spec this runtime cannot run, RuntimeFailure when
        starting fails.
        """

    def start_service(self, spec: ServiceSpec) -> Instance:
        """Start the helper server `spec` (before the instances it serves); returns at once.

        Raises BadInput when this runtime cannot run it here (its extra missing),
        RuntimeFailure when starting fails.
        """

    def service_host(self, service: ServiceSpec, client: InstanceSpec) -> str:
        """The address instance `client` reaches `service` at (what goes in its config)."""

    def attach(self, name: str, role: str, url: str, log_path: Path, record: Mapping[str, Any]) -> Instance:
        """The Instance for a cluster.json record written by `Instance.record()`."""

    def remove_leftovers(self, cluster: str, records: Iterable[Mapping[str, Any]] = ()) -> list[str]:
        """Remove what it made for `cluster` but never recorded (docker: a container created just
        before the launching kvctl was killed), found by its own marks; what it removed.
        `records`: cluster.json's instance records (their `runtime_fields`)."""


# --- log helpers shared by every runtime (logs always land in a host file) ---

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def read_log_tail(path: Path, lines: int, end: int | None = None) -> list[str]:
    """The last `lines` lines of a log file (before byte `end`), ANSI colours stripped; [] if missing."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2) if end is None else end
            # Read backwards in chunks until we have enough newlines.
            chunk, data = 8192, b""
            pos = size
            while pos > 0 and data.count(b"\n") <= lines:
                step = min(chunk, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    except FileNotFoundError:
        return []
    text = _ANSI.sub("", data.decode("utf-8", errors="replace"))
    return list(deque(text.splitlines(), maxlen=lines))


def last_log_line(path: Path) -> str:
    """The last non-empty line of a log (progress displays show it)."""
    for line in reversed(read_log_tail(path, 5)):
        if line.strip():
            return line.strip()
    return ""


def instance_logs(instance: Instance, tail: int | None, follow: bool) -> Iterator[str]:
    """`Instance.logs` for every runtime: its log file, followed while it runs if `follow`."""
    running = (lambda: instance.status().running) if follow else (lambda: False)
    return follow_log(instance.log_path, tail, running)


def follow_log(path: Path, tail: int | None, is_running: Callable[[], bool],
               poll_s: float = 0.25) -> Iterator[str]:
    """Yield the last `tail` lines (all if None), then new lines while `is_running()`.

    Stops once the server is no longer running and the file has no more data,
    like `docker logs --follow` does when a container exits.
    """
    offset = 0
    if tail is not None:
        offset = path.stat().st_size  # before yielding: lines written meanwhile come next
        yield from read_log_tail(path, tail, end=offset)
    pending = b""
    while True:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
            offset = f.tell()
        if data:
            pending += data
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield _ANSI.sub("", line.decode("utf-8", errors="replace"))
            continue
        if not is_running():
            if pending:
                yield _ANSI.sub("", pending.decode("utf-8", errors="replace"))
            return
        time.sleep(poll_s)
