"""DockerRuntime: each vLLM server in its own container, on one or two Docker engines.

One container per instance (P and D of 1P1D, or every prefill-i and decode-j
of an xPyD pool), made through the docker SDK (create → start), with
- labels `kvctl.cluster.spec`, `kvctl.role`, `kvctl.instance` and `kvctl.home`
  (our $KVCTL_HOME), by which teardown finds leftovers, and a name unique per
  cluster dir and instance (`kvctl-CLUSTER-INSTANCE-DIGEST`);
- the same server command as the local runtime (base.vllm_server_args and
  vllm_server_env), run by the image's python (its `kvctl.python` label), with
  the image's entrypoint reset and docker's init as PID 1 (SIGTERM reaches
  the server; its children are reaped);
- the model dir mounted read-only, and the shared store and every
  fs_storage_path of the role's config read-write, all at their host paths
  (relative ones resolved in the cluster dir, the containers' working dir as
  the local servers' cwd), so configs, logs and verify's store reads are the
  same as with the local runtime, and P and D share the same host dirs;
- the server's port published on `bind` (127.0.0.1 by default), same number
  inside and out; ipc=host, as vLLM's own docs run it; an instance running
  NIXL shares the host's network instead (D reaches P's side channel and UCX
  endpoints at 127.0.0.1, as between local servers; kvctl.cluster.nixl);
- on a GPU image (label `kvctl.device=gpu`) or with explicit `gpus`, one
  DeviceRequest per instance, with that instance's own device list
  (docker_options.gpu_lists; on a GPU image without a list, instance i gets
  device i): the container sees NVIDIA_VISIBLE_DEVICES = its GPUs. The cpu
  image with no list gets no device request at all (the CPU rig has no GPU).

Logs: a follower process (kvctl.runtime.log_follower), started detached after
the container, appends its output to the instance's log file. It ends when
the container stops; `status()` of a stopped container waits briefly for it,
so a start-up failure's log tail is complete.

Engines (kvctl.runtime.docker_engine) are DOCKER_HOST-style URLs, one per
role (every instance of a pool runs on its role's engine); the options (kvctl.runtime.docker_options) are validated before anything
starts. On a remote engine the model and store must exist at the same paths
(NFS for a store shared by two hosts), and ports must be published on a
non-loopback address (`bind`).

Services (an LMCache server beside the instances whose LMCacheMPConnector talks to
it, base.ServiceSpec) run as containers too, from the image of the role they serve
(the CPU V1 image holds the extras: `kvctl.sites` label), on a bridge network of
the cluster (`cluster_network`, made by the first service, removed with the
cluster's leftovers): bridged instances join it and reach a service by its
container name; its ports are also published on `bind`, where kvctl checks its
health and host-network (NIXL) instances reach it. Each role's image must run
the instance's engine (label `kvctl.engine`, v0 when absent) and hold the extras
its connectors need (`check_instance`).

The router in front of a docker cluster is not a container: it runs as a local
process (kvctl.cluster.router_process) talking to the ports the containers
publish, exactly as for local servers. That needs no docker network, works
unchanged when P and D run on two engines (a router container would have to
live on one of them and reach the other over the host network anyway), and
keeps one router code path, log and stop for both runtimes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

from connectors.config.topology import fs_storage_paths, handshake_connector
from kvctl.errors import BadInput, RuntimeFailure
from kvctl.paths import kvctl_home
from kvctl.provision import images
from kvctl.provision.extras import needed_extras
from kvctl.runtime.base import (
    ENTRYPOINT_MODULE,
    ROLES,
    InstanceSpec,
    InstanceStatus,
    LaunchPlan,
    ServiceSpec,
    StopResult,
    instance_logs,
    vllm_server_args,
    vllm_server_env,
)
from kvctl.runtime.docker_engine import connect, daemon_error, engine_hostname
from kvctl.runtime.docker_options import DockerOptions, default_gpu_lists, gpu_lists
from kvctl.runtime.log_follower import spawn_follower
from kvctl.runtime.processes import group_members, process_start_ticks
from kvctl.subprocesses import TAIL_LINES

log = logging.getLogger(__name__)

# ---- defaults ---------------------------------------------------------------------
FOLLOWER_DRAIN_S = 5.0  # after a container stops: wait this long for its log follower
CPU_WORKER_PREFIX = "connectors.v0.cpu_worker."  # CPU-only worker classes (dropped on GPU images)
LABEL_CLUSTER, LABEL_ROLE, LABEL_HOME = "kvctl.cluster.spec", "kvctl.role", "kvctl.home"
LABEL_INSTANCE = "kvctl.instance"  # prefill, decode (1P1D) or prefill-0, decode-1, ... (pools)
# -------------------------------------------------------------------------------------


# ---- containers -------------------------------------------------------------------

def container_name(cluster: str, instance: str, cluster_dir: Path) -> str:
    """Unique per cluster dir and instance: two KVCTL_HOMEs may both have a cluster `default`."""
    digest = hashlib.sha256(str(cluster_dir).encode()).hexdigest()[:8]
    return f"kvctl-{cluster}-{instance}-{digest}"


def service_container_name(spec: ServiceSpec) -> str:
    return container_name(spec.cluster, spec.name, spec.cwd)


def cluster_network(cluster: str, cluster_dir: Path) -> str:
    """The docker network of a cluster's services and the instances that reach them."""
    return container_name(cluster, "net", cluster_dir)


def _host_network(spec: InstanceSpec) -> bool:
    """NIXL: D pulls from P's side channel and UCX endpoints, which are not one published port:
    NIXL instances share the host's network (their ports are the host's, as local servers')."""
    return handshake_connector(spec.kv_transfer_config) is not None


def _find_network(client: Any, name: str) -> Any | None:
    found = [n for n in client.networks.list(names=[name]) if n.name == name]
    return found[0] if found else None


def _ensure_network(client: Any, name: str, labels: Mapping[str, str]) -> str:
    """The bridge network `name` on this engine (made, with `labels`, when missing)."""
    if _find_network(client, name) is None:
        client.networks.create(name, driver="bridge", labels=dict(labels))
    return name


def _remove_networks(client: Any, labels: Mapping[str, str]) -> None:
    import docker.errors

    for net in client.networks.list(filters={"label": [f"{k}={v}" for k, v in labels.items()]}):
        try:
            net.remove()
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:  # still in use: a container the caller keeps
            log.warning("kept network %s: %s", net.name, daemon_error(e))


def _url_host(engine: str, bind: str) -> str:
    remote = engine_hostname(engine)
    if bind not in ("0.0.0.0", "::"):
        return bind if ":" not in bind else f"[{bind}]"
    return remote or "127.0.0.1"


def _start_fix(error: str) -> str:
    if "could not select device driver" in error:
        return ("GPU requests need the NVIDIA Container Toolkit on the engine's host "
                "(nvidia-container-runtime-hook on dockerd's PATH, then restart dockerd); "
                "on a host without GPUs use the cpu image and no GPUs")
    if "already allocated" in error or "address already in use" in error:
        return ("a port is taken on the engine's host: choose free prefill and decode ports, "
                "or let kvctl pick them")
    if "bind source path does not exist" in error:
        return "the model and store dirs must exist at the same paths on the engine's host"
    return "read the engine's error below, correct the cause and launch again"


# ---- instances --------------------------------------------------------------------

class DockerInstance:
    """A vLLM server container (and the follower copying its log) ."""

    def __init__(self, name: str, role: str, url: str, log_path: Path, engine: str, container_id: str,
                 container_name: str, image: str, follower_pid: int | None = None,
                 follower_ticks: int | None = None, command: list[str] | None = None,
                 labels: Mapping[str, str] | None = None,
                 follower: subprocess.Popen | None = None, gpus: list[str] | None = None):
        self.name = name  # the instance's (prefill-0, ...)
        self.role = role
        self.url = url
        self.log_path = log_path
        self.engine = engine
        self.container_id = container_id
        self.container_name = container_name
        self.image = image
        self.follower_pid = follower_pid
        self.follower_ticks = follower_ticks
        self.command = command or []
        self.labels = dict(labels or {})  # ours: cluster, role, instance, home
        self.gpus = list(gpus) if gpus else None  # its device ids; None: no device request
        self._follower = follower  # set only in the process that started it
        self._client: Any = None

    def __repr__(self) -> str:
        return f"<DockerInstance {self.name} {self.container_name} on {self.engine} {self.url}>"

    def client(self) -> Any:
        if self._client is None:
            self._client = connect(self.engine)
        return self._client

    def _container(self) -> Any | None:
        import docker.errors

        try:
            return self.client().containers.get(self.container_id)
        except docker.errors.NotFound:
            return None

    def _follower_alive(self) -> bool:
        if self.follower_pid is None:
            return False
        if self._follower is not None:
            return self._follower.poll() is None
        ticks = process_start_ticks(self.follower_pid)
        if self.follower_ticks is not None and ticks != self.follower_ticks:
            return False  # gone, and the pid reused
        return bool(group_members(self.follower_pid))  # its own session: pgid == pid

    def _end_follower(self, wait_s: float = FOLLOWER_DRAIN_S) -> None:
        """Wait for the follower to copy the last lines and exit; stop it after `wait_s`."""
        deadline = time.monotonic() + wait_s
        while self._follower_alive():
            if time.monotonic() >= deadline:
                log.warning("log follower %s of %s did not exit; stopping it",
                            self.follower_pid, self.container_name)
                try:
                    os.killpg(self.follower_pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            time.sleep(0.05)
        if self._follower is not None:
            self._follower.poll()

    def status(self) -> InstanceStatus:
        try:
            c = self._container()
        except BadInput as e:
            return InstanceStatus(False, None, f"engine unreachable: {e.what}")
        if c is None:
            self._end_follower(0.5)
            return InstanceStatus(False, None, f"container {self.container_name} is gone")
        state = c.attrs.get("State", {})
        if state.get("Running"):
            return InstanceStatus(True, None, f"container {self.container_name} running")
        self._end_follower()  # the log file is complete once status says "stopped"
        code = state.get("ExitCode")
        what = (f"exited with code {code}" if state.get("Status") == "exited"
                else f"is {state.get('Status', 'not running')}")
        if state.get("OOMKilled"):
            what += " (out of memory)"
        return InstanceStatus(False, code, f"container {self.container_name} {what}")

    def stop(self, grace_s: float = 10.0) -> StopResult:
        """Stop (SIGTERM, SIGKILL after `grace_s`, both by the engine) and remove the container,
        its anonymous volumes and any other container of this role left by a failed launch.
        Idempotent. Raises RuntimeFailure when the engine cannot be reached.
        """
        import docker.errors

        t0 = time.monotonic()
        try:
            c = self._container()
        except BadInput as e:
            raise RuntimeFailure(f"cannot stop the {self.name} container: {e.what}",
                                 where=f"engine {self.engine}, container {self.container_name}",
                                 fix="start that engine (its containers may still run), then "
                                     "run `kvctl down` again") from None
        was_running, used = False, None
        if c is not None:
            was_running = bool(c.attrs.get("State", {}).get("Running"))
            try:
                if was_running:
                    c.stop(timeout=max(1, math.ceil(grace_s)))
                    c.reload()
                    used = "SIGKILL" if c.attrs["State"].get("ExitCode") == 137 else "SIGTERM"
                c.remove(v=True, force=True)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as e:
                raise RuntimeFailure(f"the engine could not remove the {self.name} container: "
                                     f"{daemon_error(e)}", where=f"engine {self.engine}, "
                                     f"container {self.container_name}",
                                     fix=f"remove it by hand: docker rm -f {self.container_name}") from None
        self._end_follower()
        if {LABEL_CLUSTER, LABEL_ROLE, LABEL_HOME} <= self.labels.keys():
            _remove_labelled(self.client(), self.labels)  # a twin a failed launch left behind
        return StopResult(self.name, was_running, used, time.monotonic() - t0)

    def kill(self) -> None:
        """SIGKILL the server (the engine kills the container; it stays, for its logs, until stop).
        Raises RuntimeFailure when the engine cannot be reached."""
        import docker.errors

        try:
            c = self._container()
            if c is not None:
                c.kill(signal="SIGKILL")
        except BadInput as e:
            raise RuntimeFailure(f"cannot kill the {self.name} container: {e.what}",
                                 where=f"engine {self.engine}, container {self.container_name}") from None
        except docker.errors.APIError as e:
            if "is not running" not in daemon_error(e):
                raise RuntimeFailure(f"the engine could not kill the {self.name} container: {daemon_error(e)}",
                                     where=f"engine {self.engine}, container {self.container_name}") from None

    def logs(self, tail: int | None = None, follow: bool = False) -> Iterator[str]:
        return instance_logs(self, tail, follow)

    def record(self) -> dict[str, Any]:
        return {"container_id": self.container_id, "container_name": self.container_name,
                "engine": self.engine, "image": self.image,
                "log_follower_pid": self.follower_pid,
                "log_follower_start_ticks": self.follower_ticks, "command": self.command,
                "labels": self.labels, "gpus": self.gpus}


def _remove_labelled(client: Any, labels: Mapping[str, str]) -> list[str]:
    """Remove (force, with anonymous volumes) every container carrying all `labels`."""
    import docker.errors

    removed = []
    filters = {"label": [f"{k}={v}" for k, v in labels.items()]}
    for c in client.containers.list(all=True, filters=filters, ignore_removed=True):
        try:
            c.remove(v=True, force=True)
            removed.append(c.name)
        except docker.errors.NotFound:
            pass
    return removed


# ---- the runtime ------------------------------------------------------------------

class DockerRuntime:
    """Starts servers as containers; see the module docstring."""

    name: ClassVar[str] = "docker"
    starts_servers: ClassVar[bool] = True
    host_rigs: ClassVar[bool] = False  # the image holds the servers' vLLM
    docker_options: ClassVar[bool] = True

    def __init__(self, options: DockerOptions | None = None, store: Path | None = None,
                 names: tuple[str, ...] = ROLES, engines: Mapping[str, str] | None = None):
        self.options = options or DockerOptions()
        self.engines = dict(engines or {})  # role -> vLLM engine (v0 when absent): picks the default image
        self.store = store
        self.names = names  # the cluster's instances in order: GPU lists are matched to them
        self._clients: dict[str, Any] = {}
        self._images: dict[str, tuple[str, dict[str, str]]] = {}  # role -> (ref, labels)

    @classmethod
    def for_cluster(cls, plan: LaunchPlan) -> DockerRuntime:
        """The runtime for a cluster (a ClusterSpec): its docker options, its store and its instances."""
        return cls(plan.docker, plan.store, plan.instance_names(), plan.role_engines())

    def client(self, role: str) -> Any:
        url = self.options.host(role)
        if url not in self._clients:
            self._clients[url] = connect(url)
        return self._clients[url]

    def image_ref(self, role: str = "prefill") -> str:
        """The image of `role`: the options' image, else the default for its engine (images.default_image)."""
        if self.options.image:
            return self.options.image
        engine = self.engines.get(role, "v0")
        try:
            return images.default_image("gpu" if self.options.gpus else "cpu", engine)
        except BadInput as e:
            raise BadInput(f"no default image: {e.what}", field="image",
                           fix="name the image (a tag `kvctl image build` printed)") from None

    def _image(self, role: str) -> tuple[str, dict[str, str]]:
        """(ref, labels) of the image on `role`'s engine. Raises BadInput when it is missing."""
        if role not in self._images:
            import docker.errors

            ref = self.image_ref(role)
            try:
                img = self.client(role).images.get(ref)
            except docker.errors.ImageNotFound:
                kind = "gpu" if ref.startswith("kvctl-gpu") or self.options.gpus else "cpu"
                raise BadInput(f"image {ref} is not on the engine at {self.options.host(role)}",
                               field="image",
                               fix=f"build it with `kvctl image build {kind}`"
                                   + (f" for engine {self.engines[role]}" if self.engines.get(role, "v0") != "v0"
                                      else "") + " (on that engine: "
                                   f"DOCKER_HOST={self.options.host(role)}), or choose an image "
                                   "that engine has") from None
            self._images[role] = (ref, dict(img.labels or {}))
        return self._images[role]

    def gpus(self, spec: InstanceSpec, image_labels: Mapping[str, str]) -> list[str] | None:
        """Device ids of instance `spec`: its list in the options' gpus, else (on a GPU image)
        default_gpu_lists, else None (the cpu image: no device request)."""
        if self.options.gpus:
            return gpu_lists(self.options.gpus, self.names)[spec.instance]
        if image_labels.get("kvctl.device") == "gpu":
            return default_gpu_lists(self.names).get(spec.instance, ["0"])
        return None

    def check(self) -> None:
        """Each role's engine answers and has the image. Raises BadInput."""
        for role in ROLES:
            self._image(role)

    def check_instance(self, spec: InstanceSpec) -> None:
        """Raises BadInput (before anything starts) when the role's image is one of kvctl's and runs
        another vLLM engine than `spec`'s (label `kvctl.engine`; the V0 CPU image has none), or
        lacks an extra its connectors need (label `kvctl.extras` of the CPU images; a GPU image
        keeps the official image's packages plus LMCache, and any other image is taken as it is)."""
        ref, labels = self._image(spec.role)
        engine = labels.get("kvctl.engine") or ("v0" if labels.get("kvctl.device") == "cpu" else None)
        if engine is not None and engine != spec.engine:
            raise BadInput(f"image {ref} runs vLLM engine {engine}, the {spec.instance} server engine "
                           f"{spec.engine}", field="image",
                           fix=f"leave the image out (kvctl picks the engine's own), or build it with "
                               f"`kvctl image build cpu` for engine {spec.engine}")
        if labels.get("kvctl.device") != "cpu":
            return
        has = set(labels.get("kvctl.extras", "").split())
        for extra in needed_extras(spec.kv_transfer_config):
            if extra.name not in has:
                raise BadInput(f"the {spec.instance} config needs the extra {extra.name!r} ({extra.summary}), "
                               f"which image {ref} does not hold", field="image",
                               fix=f"use the engine's cpu image (`kvctl image build cpu` for engine {extra.engine})")

    def command(self, spec: InstanceSpec,
                image_labels: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
        """The container's argv and environment: the local runtime's, in the image's python
        (`image_labels`: the image's labels; None: asks the role's engine)."""
        labels = image_labels if image_labels is not None else self._image(spec.role)[1]
        if labels.get("kvctl.device") == "gpu" and (spec.worker_cls or "").startswith(CPU_WORKER_PREFIX):
            # The GPU model runner has the V0 KV hooks itself; the CPU worker would break it.
            log.info("%s: %s is a CPU worker; the GPU image uses vLLM's own", spec.instance, spec.worker_cls)
            spec = dataclasses.replace(spec, worker_cls=None)
        python = labels.get("kvctl.python", "python3")
        argv = [python, "-m", ENTRYPOINT_MODULE,
                *vllm_server_args(spec, model=str(spec.model), host="0.0.0.0")]
        env = vllm_server_env(spec)
        sites = [f"{labels['kvctl.sites']}/{e.name}" for e in needed_extras(spec.kv_transfer_config)
                 if "kvctl.sites" in labels]
        if sites:  # after the overlay, as the local runtime orders them
            env["PYTHONPATH"] = ":".join([images.IMAGE_OVERLAY, *sites])
        return argv, env

    def _mounts(self, spec: InstanceSpec) -> list[Any]:
        """The model (read-only), the cluster's store and every fs_storage_path the role's
        config names (relative ones resolved in its working dir), each at its host path."""
        from docker.types import Mount

        mounts = []
        if spec.model.is_absolute():  # a hub id is passed through to vLLM as it is
            mounts.append(Mount(target=str(spec.model), source=str(spec.model), type="bind",
                                read_only=True))
        stores = [self.store] if self.store is not None else []
        stores += [spec.cwd / p for p in fs_storage_paths(spec.kv_transfer_config)]
        for path in dict.fromkeys(Path(os.path.normpath(p)) for p in stores):
            path.mkdir(parents=True, exist_ok=True)
            mounts.append(Mount(target=str(path), source=str(path), type="bind"))
        return mounts

    def container_config(self, spec: InstanceSpec, ref: str,
                         image_labels: Mapping[str, str], network: str | None = None) -> dict[str, Any]:
        """The docker SDK's `containers.create` arguments for instance `spec` on image `ref`
        (whose labels are `image_labels`): name, labels, command, environment, mounts,
        published port, the cluster's `network` (when its services run) and device requests.
        Touches no engine (it creates the store dirs)."""
        from docker.types import DeviceRequest

        argv, env = self.command(spec, image_labels)
        gpus = self.gpus(spec, image_labels)
        networking = ({"network_mode": "host"} if _host_network(spec)
                      else {"ports": {f"{spec.port}/tcp": (self.options.bind, spec.port)},
                            **({"network": network} if network else {})})
        return {"image": ref, "command": argv, "entrypoint": [],
                "name": container_name(spec.cluster, spec.instance, spec.cwd),
                "labels": {LABEL_CLUSTER: spec.cluster, LABEL_ROLE: spec.role,
                           LABEL_INSTANCE: spec.instance, LABEL_HOME: str(kvctl_home().absolute())},
                "environment": env, "mounts": self._mounts(spec), "working_dir": str(spec.cwd),
                **networking, "ipc_mode": "host", "init": True, "detach": True,
                "device_requests": ([DeviceRequest(device_ids=gpus, capabilities=[["gpu"]])]
                                    if gpus else None)}

    def start(self, spec: InstanceSpec) -> DockerInstance:
        """Create and start the container; returns at once (health is the caller's wait).

        Raises BadInput (image missing, a running container of that name),
        RuntimeFailure (the engine refused to create or start it: a GPU request
        without the NVIDIA toolkit, a port in use), with the engine's error and
        the container's log tail. A container it made is removed on any failure.
        """
        client = self.client(spec.role)
        ref, image_labels = self._image(spec.role)
        net = cluster_network(spec.cluster, spec.cwd)
        config = self.container_config(spec, ref, image_labels,
                                       network=net if _find_network(client, net) is not None else None)
        gpus = self.gpus(spec, image_labels)
        return self._run(spec.role, config, spec.instance, spec.role, spec.log_path, spec.port,
                         f"{spec.instance} container", gpus)

    def _run(self, engine_role: str, config: dict[str, Any], name: str, role: str, log_path: Path,
             url_port: int, what: str, gpus: list[str] | None = None) -> DockerInstance:
        """Create and start the container `config` on `engine_role`'s engine with its log follower."""
        import docker.errors

        client = self.client(engine_role)
        engine = self.options.host(engine_role)
        ref, cname, argv, labels = config["image"], config["name"], config["command"], config["labels"]
        _remove_stopped_namesake(client, cname)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as f:  # one header line, as the local runtime writes
            f.write(f"kvctl: starting {what} {cname} ({ref} on {engine}"
                    f"{', GPUs ' + ','.join(gpus) if gpus else ''}): {shlex.join(argv)}\n".encode())
        container = None
        try:
            container = client.containers.create(**config)
            container.start()
            follower = spawn_follower(engine, container.id, log_path)
        except docker.errors.APIError as e:
            error = daemon_error(e)
            tail = _container_tail(container)
            _discard(container)
            raise RuntimeFailure(
                f"the {what} did not start: {error}",
                where=f"engine {engine}, image {ref}, container {cname}", fix=_start_fix(error),
                details=(f"engine error: {error}"
                         + (f"\nlast {len(tail)} lines of the container's output:\n" + "\n".join(tail)
                            if tail else ""))) from None
        except BaseException:
            _discard(container)  # Ctrl-C between create and start must not leave it behind
            raise
        url = f"http://{_url_host(engine, self.options.bind)}:{url_port}"
        log.debug("started %s %s on %s: %s", what, cname, engine, shlex.join(argv))
        return DockerInstance(name, role, url, log_path, engine, container.id, cname, ref,
                              follower.pid, process_start_ticks(follower.pid), argv, labels,
                              follower, gpus)

    def start_service(self, spec: ServiceSpec) -> DockerInstance:
        """Run `spec` as its own container on the engine of the role it serves, from that role's
        image (its extra's site-packages on PYTHONPATH), bound to 0.0.0.0 inside, on the cluster's
        network (made here when missing): bridged instances reach it by its container name, and
        its ports are published on `bind` for kvctl and for host-network (NIXL) instances.

        Raises BadInput (the image lacks the extra), RuntimeFailure (as `start`).
        """
        ref, labels = self._image(spec.serves_role)
        if spec.extra not in labels.get("kvctl.extras", "").split() or "kvctl.sites" not in labels:
            raise BadInput(f"the {spec.role} server {spec.name} runs from the extra {spec.extra!r}, which image "
                           f"{ref} does not hold", field="image",
                           fix="use the engine's cpu image (`kvctl image build cpu` for engine v1)")
        net = _ensure_network(self.client(spec.serves_role), cluster_network(spec.cluster, spec.cwd),
                              {LABEL_CLUSTER: spec.cluster, LABEL_HOME: str(kvctl_home().absolute())})
        cname = service_container_name(spec)
        config = {"image": ref, "entrypoint": [], "name": cname, "hostname": cname,
                  "command": [labels.get("kvctl.python", "python3"), "-m", spec.module, *spec.arguments("0.0.0.0")],
                  "labels": {LABEL_CLUSTER: spec.cluster, LABEL_ROLE: spec.role, LABEL_INSTANCE: spec.name,
                             LABEL_HOME: str(kvctl_home().absolute())},
                  "environment": {**spec.env, "PYTHONPATH": f"{labels['kvctl.sites']}/{spec.extra}"},
                  "network": net, "ports": {f"{p}/tcp": (self.options.bind, p) for p in spec.ports},
                  "init": True, "detach": True}
        return self._run(spec.serves_role, config, spec.name, spec.role, spec.log_path, spec.url_port,
                         f"{spec.role} server {spec.name} for {', '.join(spec.serves)}:")

    def service_host(self, service: ServiceSpec, client: InstanceSpec) -> str:
        """Its container name on the cluster's network, or (for a host-network instance) the
        address its ports are published on. Raises BadInput when `client` runs on another engine."""
        if self.options.host(client.role) != self.options.host(service.serves_role):
            raise BadInput(f"{client.instance} runs on engine {self.options.host(client.role)} and its "
                           f"{service.role} server {service.name} on {self.options.host(service.serves_role)}",
                           field="lmcache_sharing", fix="run the instances that share one server on one engine, "
                                                         "or give each its own (sharing per-instance)")
        if _host_network(client):
            return "127.0.0.1" if self.options.bind in ("0.0.0.0", "::") else self.options.bind
        return service_container_name(service)

    def attach(self, name: str, role: str, url: str, log_path: Path,
               record: Mapping[str, Any]) -> DockerInstance:
        if not isinstance(record.get("container_id"), str) or not isinstance(record.get("engine"), str):
            raise BadInput(f"the {name} record of this cluster has no container_id/engine",
                           where="cluster.json", fix="remove the cluster with `kvctl down`")
        inst = DockerInstance(name, role, url, log_path, record["engine"], record["container_id"],
                              str(record.get("container_name") or record["container_id"][:12]),
                              str(record.get("image") or ""), record.get("log_follower_pid"),
                              record.get("log_follower_start_ticks"),
                              list(record.get("command") or []), record.get("labels"),
                              gpus=record.get("gpus"))
        return inst

    def remove_leftovers(self, cluster: str, records: Iterable[Mapping[str, Any]] = ()) -> list[str]:
        """Remove this cluster's containers (by label) on its engines; the names removed.

        The engines are the options' and those named by `records` (cluster.json's
        instance records, for `down`). Catches what a launch interrupted between
        create and record (or killed by SIGKILL) left behind.
        """
        removed = []
        labels = {LABEL_CLUSTER: cluster, LABEL_HOME: str(kvctl_home().absolute())}
        engines = [self.options.host(r) for r in ROLES]
        engines += [r["engine"] for r in records if isinstance(r.get("engine"), str)]
        for url in dict.fromkeys(engines):
            try:
                client = self._clients.get(url) or connect(url)
            except BadInput as e:
                log.warning("cannot look for leftover containers on %s: %s", url, e.what)
                continue
            removed += _remove_labelled(client, labels)
            _remove_networks(client, labels)  # the services' network: made by the launch, never recorded
        return removed


def _container_tail(container: Any) -> list[str]:
    if container is None:
        return []
    try:
        text = container.logs(tail=TAIL_LINES).decode("utf-8", errors="replace")
    except Exception:  # noqa: BLE001 - best effort: the start error is what matters
        return []
    return text.splitlines()[-TAIL_LINES:]


def _discard(container: Any) -> None:
    """Remove a container we made (also one left in Created by a refused GPU request)."""
    import docker.errors

    if container is None:
        return
    try:
        container.remove(v=True, force=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:
        log.error("could not remove container %s: %s", container.name, daemon_error(e))


def _remove_stopped_namesake(client: Any, name: str) -> None:
    """A stopped container with our name is a leftover of this cluster dir: remove it.

    Raises BadInput if it is running (then it is not ours to kill silently).
    """
    import docker.errors

    try:
        old = client.containers.get(name)
    except docker.errors.NotFound:
        return
    if old.attrs.get("State", {}).get("Running"):
        raise BadInput(f"container {name} is running but not recorded in this cluster's state",
                       where=f"container {name}",
                       fix=f"stop it with `docker rm -f {name}`, then launch again")
    _discard(old)
