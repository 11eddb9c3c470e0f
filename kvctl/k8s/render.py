"""Render a P/D deployment for Kubernetes: manifests plus the attach file, nothing applied.

Layout written by `write_rendered(rendered, DIR)`:

    DIR/manifests/store-pvc.yaml   the store's ReadWriteMany PersistentVolumeClaim (not with
                                   an existing claim: `store_pvc`)
    DIR/manifests/prefill.yaml     per prefill instance, a Deployment and a ClusterIP Service,
                                   both NAME-prefill-I
    DIR/manifests/decode.yaml      the same for the decode instances (NAME-decode-I)
    DIR/manifests/router.yaml      the router's Deployment and Service
    DIR/attach.yaml                `kvctl attach --from-k8s DIR`: URLs, `kubectl logs` sources
    DIR/port-forward.sh            forwards the router and every instance to this host (the URLs
                                   attach.yaml names, unless rendered for in-cluster use)

Why a Deployment per instance, not LeaderWorkerSets: a LeaderWorkerSet is for
one instance spread over several pods (a leader and its workers: tensor or
pipeline parallel across nodes). Every P/D instance here is one pod (one vLLM
server on `gpus_per_pod` GPUs of one node), so a LeaderWorkerSet would add a
CRD and its controller as a dependency and buy nothing. The router takes a
fixed list of instance URLs and the attach file follows each instance's log,
so each instance needs a stable name: one Deployment per instance
(`NAME-prefill-0`, `-1`, ..., `NAME-decode-0`, ...) with its own Service of the
same name gives the stable DNS name `NAME-prefill-0:8000` for the router's
`--prefill`/`--decode` URLs and plain `kubectl logs -f deploy/NAME-prefill-0`
for the log. Each has `replicas: 1` and strategy `Recreate`: the router
addresses the instance as one server, so two copies of it must never run at
once, and a rolling update would briefly run the new pod beside the old one.
The Services set `publishNotReadyAddresses`: the router's own /health checks
decide whether an instance takes requests, and a readiness probe that times
out under load does not cut the router off from it.

An instance whose config names LMCacheMPConnector (LMCache's multi-process mode, the
offload child of `v1-seed-replica`) needs an `lmcache server`, rendered as the scenario's
`lmcache.sharing` says. `per-instance` (the seed's shape): a native sidecar in the
instance's pod (an init container with `restartPolicy: Always`, Kubernetes 1.29+), so it
starts first, its startupProbe on /healthcheck holds the vLLM container back until it
serves, and the connector reaches it on the pod's loopback. `shared`: one Deployment and
Service `NAME-lmcache` every instance reaches by DNS. LMCache's Kubernetes docs run the
server per node (a DaemonSet from their operator), because on GPUs the server maps the
engine's memory through CUDA IPC, which needs the same node; over TCP (the engine-driven
transfer CPUs use) that constraint is gone, and a sidecar is the per-instance equivalent.

Every vLLM pod mounts the store claim at the transfer store's path (the same
path in every pod), gets `gpus_per_pod` `nvidia.com/gpu` (requests = limits),
probes `/health` (startup: up to STARTUP_S for loading the model; readiness;
liveness), and runs kvctl.runtime.base's command line and environment with the
scenario's kv-transfer-config, args and env (default: the seed's multi-connector
shape, scenarios/seed-replica-gpu.yaml).
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from connectors.config.topology import fs_storage_paths, handshake_connector, transfer_store
from kvctl.attach.file import AttachFile, AttachFileInstance, dump_attach_file
from kvctl.cluster import nixl
from kvctl.cluster.lmcache import (HEALTH_PATH as LMCACHE_HEALTH, SERVER_ENV as LMCACHE_ENV,
                                   SERVER_MODULE as LMCACHE_MODULE, LMCacheOptions, LMCacheServer,
                                   point_at_server, server_args, uses_lmcache_server)
from kvctl.errors import BadInput
from kvctl.runtime.base import ENTRYPOINT_MODULE, InstanceSpec, vllm_server_args, vllm_server_env
from kvctl.scenario.schema import Scenario, load_scenario

# --- defaults, in one place ---
DEFAULT_SCENARIO = "seed-replica-gpu"  # the seed's multi-connector P and FSConnector D
DEFAULT_MODEL = "deepseek-ai/DeepSeek-V2-Lite-Chat"  # the seed's model, as a hub id
DEFAULT_IMAGE = "kvctl-gpu:latest"  # `kvctl image build gpu`; push it where the cluster pulls from
DEFAULT_STORE_SIZE = "200Gi"
PORT = 8000  # every pod's server port, and the router's
WORKDIR = "/workspace"  # the servers' working dir: relative fs_storage_paths resolve here
STORE_MOUNT = "/kv-store"  # `${store}` in a scenario's configs
INSTANCE_DIR = "/instance"  # `${instance_dir}`: a per-pod emptyDir
HF_CACHE = "/root/.cache/huggingface"  # hub downloads (an emptyDir unless model_cache_pvc)
MODEL_MOUNT = "/models"  # model_pvc, read-only: absolute model paths live under it
SHM_SIZE = "8Gi"  # /dev/shm (an in-memory emptyDir): vLLM's workers share tensors through it
STARTUP_S = 1800  # longest a server may take to answer /health (pulling and loading a model)
PROBE_PERIOD_S = 10
LOCAL_PORTS = {"router": 18000, "prefill": 18100, "decode": 18200}  # port-forward.sh: base + index
MAX_POOL = 99  # instances per pool (local ports stay distinct)
ROUTER_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
LMCACHE_PORT = 5555  # the LMCache server's ZMQ port in its pod (LMCache's default)
LMCACHE_HTTP_PORT = 8080  # its /healthcheck (LMCache's default)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # a namespace (RFC 1123 label)
_SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # NAME prefixes Service names (RFC 1035 label)
MAX_NAME = 40  # "NAME-prefill-99" and its ReplicaSet's "-HASH" (up to 11 more) stay within 63 characters


@dataclass(frozen=True)
class K8sSpec:
    """What to render. Field names are the CLI's option names in snake case."""

    name: str
    prefill: int = 1
    decode: int = 1
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None  # None: the scenario's, else the model's
    image: str = DEFAULT_IMAGE
    router_image: str | None = None  # None: `image` (it has kvctl, and the router needs only aiohttp)
    scenario: str = DEFAULT_SCENARIO  # whose kv-transfer-configs, args and env the pools run
    namespace: str | None = None  # None: whatever namespace `kubectl apply` uses
    store_pvc: str | None = None  # an existing ReadWriteMany claim; None: render one
    store_size: str = DEFAULT_STORE_SIZE
    storage_class: str | None = None  # None: the cluster's default class (it must offer RWX)
    gpus_per_pod: int = 1
    model_pvc: str | None = None  # a claim holding model dirs, mounted read-only at MODEL_MOUNT
    model_cache_pvc: str | None = None  # a claim for the hub cache, shared by the pods
    hf_token_secret: str | None = None  # a Secret with key `token`: HF_TOKEN for gated models
    in_cluster: bool = False  # attach.yaml with in-cluster DNS URLs instead of port-forwarded ones
    attach_store: str | None = None  # the store as mounted where kvctl runs, for attach.yaml


@dataclass
class RenderedDeployment:
    spec: K8sSpec
    manifests: dict[str, list[dict[str, Any]]]  # file name under manifests/ -> its documents
    attach: AttachFile
    port_forward: str  # the script's text
    configs: dict[str, dict]  # role -> its resolved kv-transfer-config
    store_path: str  # where every vLLM pod mounts the store
    notes: list[str] = field(default_factory=list)

    def documents(self) -> list[dict[str, Any]]:
        return [d for docs in self.manifests.values() for d in docs]


def _check_spec(spec: K8sSpec) -> None:
    if not _SERVICE_NAME.match(spec.name) or len(spec.name) > MAX_NAME:
        raise BadInput(f"{spec.name!r} cannot name Kubernetes objects", field="name",
                       fix=f"use lowercase letters, digits and '-' (at most {MAX_NAME}, starting with a "
                           "letter, ending with a letter or digit)")
    for field_name in ("prefill", "decode"):
        count = getattr(spec, field_name)
        if not 1 <= count <= MAX_POOL:
            raise BadInput(f"{field_name} pool size must be 1 to {MAX_POOL}, got {count}", field=field_name,
                           fix="give the number of pods in the pool, e.g. 2")
    if spec.gpus_per_pod < 0:
        raise BadInput(f"gpus per pod must be 0 or more, got {spec.gpus_per_pod}", field="gpus_per_pod",
                       fix="use 1 (tensor parallel: the server's -tp), or 0 for none")
    if spec.namespace is not None and not _DNS_LABEL.match(spec.namespace):
        raise BadInput(f"{spec.namespace!r} is not a namespace name", field="namespace",
                       fix="use lowercase letters, digits and '-'")
    if spec.model.startswith("/") and spec.model_pvc is None:
        raise BadInput(f"model {spec.model} is a path, but no claim holds it", field="model",
                       fix=f"give the claim with the model dirs (mounted at {MODEL_MOUNT}), or a hub id")
    if spec.model_pvc is not None and spec.model.startswith("/") and not spec.model.startswith(MODEL_MOUNT + "/"):
        raise BadInput(f"model {spec.model} is not under {MODEL_MOUNT}, where the model claim is mounted",
                       field="model", fix=f"give its path under {MODEL_MOUNT}/")


INSTANCE_LABEL = "kvctl/instance"  # an instance's name in the attach file and the router: prefill-0, ...


def _labels(spec: K8sSpec, component: str, instance: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "kvctl-pd", "app.kubernetes.io/instance": spec.name,
              "app.kubernetes.io/component": component, "app.kubernetes.io/managed-by": "kvctl"}
    if instance is not None:
        labels[INSTANCE_LABEL] = instance
    return labels


def _selector(spec: K8sSpec, component: str, instance: str | None = None) -> dict[str, str]:
    selector = {"app.kubernetes.io/instance": spec.name, "app.kubernetes.io/component": component}
    if instance is not None:
        selector[INSTANCE_LABEL] = instance
    return selector


def _meta(spec: K8sSpec, name: str, component: str, instance: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": _labels(spec, component, instance)}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    return meta


def instance_name(role: str, index: int) -> str:
    """The instance's name in the attach file and the router's URL list: prefill-0, decode-1, ..."""
    return f"{role}-{index}"


def object_name(spec: K8sSpec, role: str, index: int) -> str:
    """The instance's Deployment and Service: NAME-prefill-0, ..."""
    return f"{spec.name}-{instance_name(role, index)}"


def instance_url(spec: K8sSpec, role: str, index: int) -> str:
    """The instance's URL inside the cluster (its namespace): its Service's DNS name."""
    return f"http://{object_name(spec, role, index)}:{PORT}"


def _http_probe(period_s: int, failures: int, timeout_s: int = 5, path: str = "/health") -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period_s,
            "timeoutSeconds": timeout_s, "failureThreshold": failures}


def _store_volume(spec: K8sSpec) -> dict[str, Any]:
    return {"name": "kv-store", "persistentVolumeClaim": {"claimName": spec.store_pvc or f"{spec.name}-kv-store"}}


def _server_container(spec: K8sSpec, scenario: Scenario, role: str, config: dict,
                      store_path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The vLLM container of `role` and the pod's volumes."""
    overrides = dict(scenario.role(role).env)
    if not spec.model.startswith("/"):  # a hub id: the pod downloads it
        overrides.update({"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"})
    ispec = InstanceSpec(
        cluster=spec.name, role=role, model=Path(spec.model),
        served_model_name=served_name(spec, scenario), dtype="auto", port=PORT, cwd=Path(WORKDIR),
        log_path=Path("/dev/stdout"), kv_transfer_config=config, worker_cls=None, host="0.0.0.0",
        extra_args=tuple(scenario.role(role).args), env=overrides)
    env = [{"name": k, "value": v} for k, v in vllm_server_env(ispec).items()]
    ports = [{"name": "http", "containerPort": PORT, "protocol": "TCP"}]
    if nixl.runs_nixl(config):  # D pulls from this pod's own IP: its side channel and UCX
        given = {e["name"] for e in env}
        env += [e for e in nixl.pod_env(config) if e["name"] not in given]
        ports.append({"name": "nixl", "containerPort": nixl.POD_SIDE_CHANNEL_PORT, "protocol": "TCP"})
    if spec.hf_token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": spec.hf_token_secret,
                                                                         "key": "token"}}})
    mounts = [{"name": "kv-store", "mountPath": store_path}, {"name": "dshm", "mountPath": "/dev/shm"},
              {"name": "hf-cache", "mountPath": HF_CACHE}]
    volumes = [_store_volume(spec), {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
               {"name": "hf-cache", **({"persistentVolumeClaim": {"claimName": spec.model_cache_pvc}}
                                       if spec.model_cache_pvc else {"emptyDir": {}})}]
    private = sorted({posixpath.normpath(posixpath.join(WORKDIR, p)) for p in fs_storage_paths(config)} - {store_path})
    for i, path in enumerate(private):  # other FS stores (e.g. an offload child): private to the pod
        mounts.append({"name": f"fs-private-{i}", "mountPath": path})
        volumes.append({"name": f"fs-private-{i}", "emptyDir": {}})
    if INSTANCE_DIR in json.dumps(config) and not any(m["mountPath"] == INSTANCE_DIR for m in mounts):
        mounts.append({"name": "instance-dir", "mountPath": INSTANCE_DIR})
        volumes.append({"name": "instance-dir", "emptyDir": {}})
    if spec.model_pvc:
        mounts.append({"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True})
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": spec.model_pvc, "readOnly": True}})
    container: dict[str, Any] = {
        "name": "vllm",
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-m", ENTRYPOINT_MODULE],
        "args": vllm_server_args(ispec, model=spec.model, host="0.0.0.0"),
        "workingDir": WORKDIR,
        "env": env,
        "ports": ports,
        "startupProbe": _http_probe(PROBE_PERIOD_S, STARTUP_S // PROBE_PERIOD_S),
        "readinessProbe": _http_probe(PROBE_PERIOD_S, 3),
        "livenessProbe": _http_probe(30, 5),
        "volumeMounts": mounts,
    }
    if spec.gpus_per_pod:
        gpus = {"nvidia.com/gpu": str(spec.gpus_per_pod)}
        container["resources"] = {"requests": dict(gpus), "limits": dict(gpus)}
    return container, volumes


def _service(spec: K8sSpec, name: str, component: str, instance: str | None = None,
             **extra: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, name, component, instance),
            "spec": {"type": "ClusterIP", **extra, "selector": _selector(spec, component, instance),
                     "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}]}}


def _lmcache_server(options: LMCacheOptions, name: str = "lmcache") -> LMCacheServer:
    return LMCacheServer(name, (), LMCACHE_PORT, LMCACHE_HTTP_PORT, options)


def _lmcache_container(spec: K8sSpec, options: LMCacheOptions, host: str, name: str = "lmcache") -> dict[str, Any]:
    """An `lmcache server` container (kvctl.cluster.lmcache's flags), bound to `host`."""
    probe = {"httpGet": {"path": LMCACHE_HEALTH, "port": "lmcache-http"}, "periodSeconds": 2,
             "timeoutSeconds": 2}
    return {"name": name, "image": spec.image, "imagePullPolicy": "IfNotPresent",
            "command": ["python3", "-m", LMCACHE_MODULE], "args": server_args(_lmcache_server(options), host),
            "env": [{"name": k, "value": v} for k, v in LMCACHE_ENV.items()],
            "ports": [{"name": "lmcache-zmq", "containerPort": LMCACHE_PORT, "protocol": "TCP"},
                      {"name": "lmcache-http", "containerPort": LMCACHE_HTTP_PORT, "protocol": "TCP"}],
            "startupProbe": {**probe, "failureThreshold": 150}, "livenessProbe": {**probe, "periodSeconds": 30,
                                                                                   "failureThreshold": 5}}


def lmcache_options(scenario: Scenario) -> LMCacheOptions:
    return LMCacheOptions(**scenario.lmcache.model_dump())


def _shared_lmcache(spec: K8sSpec, scenario: Scenario) -> list[dict[str, Any]]:
    """`lmcache.sharing: shared`: one LMCache server (Deployment + Service NAME-lmcache)."""
    name = f"{spec.name}-lmcache"
    container = _lmcache_container(spec, lmcache_options(scenario), "0.0.0.0")
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, name, "lmcache"),
               "spec": {"type": "ClusterIP", "selector": _selector(spec, "lmcache"),
                        "ports": [{"name": "lmcache-zmq", "port": LMCACHE_PORT, "targetPort": "lmcache-zmq"},
                                  {"name": "lmcache-http", "port": LMCACHE_HTTP_PORT,
                                   "targetPort": "lmcache-http"}]}}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(spec, name, "lmcache"),
                  "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                           "selector": {"matchLabels": _selector(spec, "lmcache")},
                           "template": {"metadata": {"labels": _labels(spec, "lmcache")},
                                        "spec": {"containers": [container]}}}}
    return [service, deployment]


def _pool(spec: K8sSpec, scenario: Scenario, role: str, config: dict, store_path: str) -> list[dict[str, Any]]:
    """Per instance of `role`: its Service and its one-pod Deployment (see the module docstring)."""
    docs: list[dict[str, Any]] = []
    sidecar = uses_lmcache_server(config) and scenario.lmcache.sharing == "per-instance"
    if uses_lmcache_server(config):  # P-local: the pod's loopback; shared: the server's Service
        host = "tcp://127.0.0.1" if sidecar else f"tcp://{spec.name}-lmcache"
        config = point_at_server(config, LMCACHE_PORT, host)
    for i in range(getattr(spec, role)):
        container, volumes = _server_container(spec, scenario, role, config, store_path)  # each its own copy
        name, instance = object_name(spec, role, i), instance_name(role, i)
        deployment = {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(spec, name, role, instance),
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},  # never two copies of one instance, even during a rollout
                "selector": {"matchLabels": _selector(spec, role, instance)},
                "template": {
                    "metadata": {"labels": _labels(spec, role, instance)},
                    "spec": {"terminationGracePeriodSeconds": 60, "containers": [container], "volumes": volumes,
                             # a native sidecar: started, and serving, before the vLLM container starts
                             **({"initContainers": [{**_lmcache_container(spec, lmcache_options(scenario),
                                                                          "127.0.0.1"), "restartPolicy": "Always"}]}
                                if sidecar else {})},
                },
            },
        }
        docs += [_service(spec, name, role, instance, publishNotReadyAddresses=True), deployment]
    return docs


def _router(spec: K8sSpec, handshake: bool = False) -> list[dict[str, Any]]:
    """The router's Deployment and Service; `handshake`: it relays NIXL's kv_transfer_params."""
    name = f"{spec.name}-router"
    args: list[str] = ["--kv-transfer-params"] if handshake else []
    for role in ("prefill", "decode"):
        for i in range(getattr(spec, role)):
            args += [f"--{role}", f"{instance_name(role, i)}={instance_url(spec, role, i)}"]
    args += ["--host", "0.0.0.0", "--port", str(PORT)]
    container = {
        "name": "router", "image": spec.router_image or spec.image, "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-m", "kvctl.router"], "args": args,
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        # Readiness is /health (a P and a D answer); liveness is /live: a router whose
        # backends are down is not ready, but restarting it would not help.
        "readinessProbe": _http_probe(5, 3), "livenessProbe": _http_probe(30, 5, path="/live"),
        "resources": ROUTER_RESOURCES,
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(spec, name, "router"),
        "spec": {"replicas": 1, "selector": {"matchLabels": _selector(spec, "router")},
                 "template": {"metadata": {"labels": _labels(spec, "router")},
                              "spec": {"containers": [container]}}},
    }
    return [deployment, _service(spec, name, "router")]


def _store_claim(spec: K8sSpec) -> dict[str, Any]:
    claim: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": spec.store_size}}}
    if spec.storage_class:
        claim["storageClassName"] = spec.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _meta(spec, f"{spec.name}-kv-store", "store"), "spec": claim}


def served_name(spec: K8sSpec, scenario: Scenario) -> str:
    return spec.served_model_name or scenario.served_model_name or spec.model.rstrip("/").rsplit("/", 1)[-1]


def _kubectl(spec: K8sSpec) -> str:
    return "kubectl" + (f" -n {spec.namespace}" if spec.namespace else "")


def log_command(spec: K8sSpec, role: str, index: int) -> str:
    """The attach file's log source for an instance: `kubectl logs -f deploy/NAME-prefill-0 [-n NS]`,
    from now on (`--tail=0`: lines logged before verify started never count)."""
    namespace = f" -n {spec.namespace}" if spec.namespace else ""
    return f"cmd:kubectl logs -f deploy/{object_name(spec, role, index)}{namespace} --tail=0 -c vllm"


def _attach_file(spec: K8sSpec, scenario: Scenario, configs: dict[str, dict]) -> AttachFile:
    instances = []
    for role in ("prefill", "decode"):
        for i in range(getattr(spec, role)):
            url = instance_url(spec, role, i) if spec.in_cluster else f"http://127.0.0.1:{LOCAL_PORTS[role] + i}"
            instances.append(AttachFileInstance(instance_name(role, i), role, url, log_command(spec, role, i),
                                                configs[role]))
    endpoint = (f"http://{spec.name}-router:{PORT}" if spec.in_cluster
                else f"http://127.0.0.1:{LOCAL_PORTS['router']}")
    return AttachFile(name=spec.name, model=spec.model, served_model_name=served_name(spec, scenario),
                      endpoint=endpoint, store=spec.attach_store, instances=tuple(instances),
                      description=f"rendered by kvctl render k8s ({spec.prefill}P{spec.decode}D, scenario "
                                  f"{spec.scenario})")


def _port_forward(spec: K8sSpec) -> str:
    kubectl = _kubectl(spec)
    lines = ["#!/bin/sh",
             f"# Forwards the router and every instance of {spec.name!r} to this host, at the URLs attach.yaml names.",
             "# Run it in its own terminal; Ctrl-C stops every forward.",
             "set -eu",
             "trap 'kill $(jobs -p) 2>/dev/null' INT TERM EXIT",
             f"{kubectl} port-forward svc/{spec.name}-router {LOCAL_PORTS['router']}:{PORT} &"]
    for role in ("prefill", "decode"):
        for i in range(getattr(spec, role)):
            lines.append(f"{kubectl} port-forward svc/{object_name(spec, role, i)} {LOCAL_PORTS[role] + i}:{PORT} &")
    lines.append("wait")
    return "\n".join(lines) + "\n"


def render_k8s(spec: K8sSpec) -> RenderedDeployment:
    """The manifests, attach file and port-forward script for `spec`. Writes nothing.

    Raises BadInput for a name Kubernetes refuses, pool sizes out of range, a
    model path no claim holds, or a scenario kvctl cannot load (its problems
    listed).
    """
    _check_spec(spec)
    scenario = load_scenario(spec.scenario)
    raw = {role: scenario.resolved_config(role, STORE_MOUNT, INSTANCE_DIR) for role in ("prefill", "decode")}
    p_store, d_store = transfer_store(raw["prefill"], "send"), transfer_store(raw["decode"], "recv")
    handshake = handshake_connector(raw["prefill"]) is not None
    if handshake and p_store is None:  # NIXL carries KV pod to pod; the claim is only mounted
        p_store = d_store = STORE_MOUNT
    if p_store is None or d_store is None or _abs(p_store) != _abs(d_store):
        raise BadInput(f"scenario {scenario.name}: P's transfer store {p_store!r} and D's {d_store!r} are not one "
                       "directory", field="scenario",
                       fix="use a scenario whose P and D name the same fs_storage_path (e.g. '${store}')")
    store_path = _abs(p_store)
    manifests: dict[str, list[dict[str, Any]]] = {}
    if spec.store_pvc is None:
        manifests["store-pvc.yaml"] = [_store_claim(spec)]
    for role in ("prefill", "decode"):
        manifests[f"{role}.yaml"] = _pool(spec, scenario, role, raw[role], store_path)
    if scenario.lmcache.sharing == "shared" and any(uses_lmcache_server(c) for c in raw.values()):
        manifests["lmcache.yaml"] = _shared_lmcache(spec, scenario)
    manifests["router.yaml"] = _router(spec, handshake)
    notes = []
    if spec.image == DEFAULT_IMAGE:
        notes.append(f"image {DEFAULT_IMAGE} is what `kvctl image build gpu` tags locally: push it to a registry "
                     "the cluster pulls from and render with that image")
    if spec.attach_store is None:
        notes.append("attach.yaml has no store: the store check is reported as not observable unless the "
                     "store volume is mounted where kvctl runs (then set store: in attach.yaml)")
    return RenderedDeployment(spec=spec, manifests=manifests, attach=_attach_file(spec, scenario, raw),
                              port_forward=_port_forward(spec), configs=raw, store_path=store_path, notes=notes)


def _abs(path: str) -> str:
    return posixpath.normpath(posixpath.join(WORKDIR, path))


class _PlainDumper(yaml.SafeDumper):
    """YAML without anchors and aliases: each manifest reads on its own."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def manifest_text(docs: list[dict[str, Any]]) -> str:
    return yaml.dump_all(docs, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False, width=120)


def write_rendered(rendered: RenderedDeployment, out: Path) -> list[Path]:
    """Write the deployment under `out` (created); returns the files written.

    Files kvctl did not render are left alone; rendered ones are replaced.
    Raises BadInput when `out` cannot be written.
    """
    out = Path(out)
    files = {f"manifests/{name}": manifest_text(docs) for name, docs in rendered.manifests.items()}
    spec = rendered.spec
    header = (f"# kvctl attach --from-k8s {out}   (rendered for {spec.prefill}P{spec.decode}D {spec.name!r};\n"
              + ("#  URLs are in-cluster DNS names: run kvctl inside the cluster)\n" if spec.in_cluster
                 else "#  URLs are port-forward.sh's: run it first)\n"))
    files["attach.yaml"] = header + dump_attach_file(rendered.attach)
    files["port-forward.sh"] = rendered.port_forward
    written = []
    try:
        (out / "manifests").mkdir(parents=True, exist_ok=True)
        stale = {p.name for p in (out / "manifests").glob("*.yaml")} - {n.split("/", 1)[1] for n in files
                                                                        if n.startswith("manifests/")}
        for name in stale:  # e.g. store-pvc.yaml from a render without store_pvc: never apply it again
            if (out / "manifests" / name).read_text().find("app.kubernetes.io/managed-by: kvctl") >= 0:
                (out / "manifests" / name).unlink()
        for name, text in files.items():
            path = out / name
            path.write_text(text)
            written.append(path)
        (out / "port-forward.sh").chmod(0o755)
    except OSError as e:
        raise BadInput(f"cannot write the rendered deployment: {e.strerror or e}", where=str(out),
                       fix="choose a directory you can write") from None
    return written


def kubectl_commands(spec: K8sSpec, out: Path) -> list[str]:
    """The commands that deploy, attach and verify what was rendered into `out`."""
    kubectl = _kubectl(spec)
    steps = [f"{kubectl} apply -f {shlex.quote(str(out / 'manifests'))}"]
    names = [object_name(spec, role, i) for role in ("prefill", "decode") for i in range(getattr(spec, role))]
    names.append(f"{spec.name}-router")
    steps += [f"{kubectl} rollout status deploy/{name} --timeout={STARTUP_S}s" for name in names]
    if not spec.in_cluster:
        steps.append(f"{shlex.quote(str(out / 'port-forward.sh'))} &")
    steps += [f"kvctl attach --from-k8s {shlex.quote(str(out))}",
              f"kvctl verify --name {spec.name}" + ("" if spec.attach_store else " --require observable")]
    return steps
