"""Runtimes: where a cluster's vLLM servers run, `local` (processes), `docker` (containers)
or `attached` (somewhere kvctl did not start them).

    base.py            the contract (Runtime with its declared capabilities, Instance,
                       InstanceSpec, LaunchPlan), the vLLM command line and environment
                       both launching runtimes use, log-file helpers
    processes.py       psutil: is a process alive, still ours, its group's members
    local.py           LocalRuntime: servers as processes of the rig's python
    docker_engine.py   engine URLs and connecting (the docker SDK only inside `connect`)
    docker_options.py  DockerOptions: image, GPUs, bind address, engines (a plain value)
    log_follower.py    `python -m kvctl.runtime.log_follower`: a container's output to a file
    docker.py          DockerRuntime and DockerInstance: servers as containers
    attached.py        AttachedRuntime: a cluster's servers known by URL (kvctl attach)

This module is the registry: `RUNTIMES` maps each name stored in cluster.json
to its class, `runtime_class` gives the class (its capabilities: `starts_servers`,
`host_rigs`, `docker_options`), `get_runtime` builds one. `select_runtime` is the
one place that resolves a requested runtime (local|docker|auto). Callers ask a
runtime's capabilities, never compare its name: a new runtime is a module here
and a line in `RUNTIMES` (and in `SELECTABLE` when `--runtime` may name it).
A runtime's module is imported only when asked for: kvctl runs without the docker
SDK installed.

May import: `kvctl.errors`, `kvctl.paths`, `kvctl.net`, `kvctl.subprocesses`,
`kvctl.provision` (the rig's python, the default image), `connectors.config`.
Never `kvctl.cluster` (it builds on this), a command or a view.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from kvctl.errors import BadInput
from kvctl.runtime.base import (
    ROLES,
    Instance,
    InstanceSpec,
    InstanceStatus,
    LaunchPlan,
    Runtime,
    StopResult,
)
from kvctl.runtime.local import LocalRuntime

# name (cluster.json's `runtime`) -> "module:Class"
RUNTIMES = {
    "local": "kvctl.runtime.local:LocalRuntime",
    "docker": "kvctl.runtime.docker:DockerRuntime",
    "attached": "kvctl.runtime.attached:AttachedRuntime",
}
SELECTABLE = ("local", "docker")  # what `--runtime` / a scenario's `runtime` may name, besides auto
DEFAULT_RUNTIME = "local"  # of a scenario file, and of build_1p1d_spec
AUTO = "auto"
RUNTIME_CHOICES = (*SELECTABLE, AUTO)

__all__ = ["AUTO", "DEFAULT_RUNTIME", "ROLES", "RUNTIMES", "RUNTIME_CHOICES", "Instance", "InstanceSpec",
           "InstanceStatus", "LaunchPlan", "LocalRuntime", "Runtime", "StopResult", "get_runtime",
           "requested_runtime_class", "runtime_class", "select_runtime", "stray_instances"]


def select_runtime(requested: str) -> tuple[str, str]:
    """Resolve a requested runtime (local, docker or auto) to a concrete name and the reason.

    Raises BadInput (field `runtime`) for an unknown value.
    """
    if requested in SELECTABLE:
        return requested, "requested"
    if requested == AUTO:
        return "local", "auto: local CPU processes (the docker runtime runs containers)"
    raise BadInput(f"unknown runtime {requested!r}", field="runtime",
                   fix=f"use one of: {', '.join(RUNTIME_CHOICES)}")


def runtime_class(name: str) -> type[Runtime]:
    """The class of the runtime stored as `name` in cluster.json (its capabilities are class attributes).

    Raises BadInput for a name this kvctl does not know.
    """
    target = RUNTIMES.get(name)
    if target is None:
        raise BadInput(f"runtime {name!r} is not available in this kvctl", where="runtime",
                       fix="use a kvctl version that supports it, or the local runtime")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def requested_runtime_class(requested: str) -> type[Runtime]:
    """The class a requested runtime (local, docker, auto) resolves to. Raises BadInput as select_runtime."""
    return runtime_class(select_runtime(requested)[0])


def get_runtime(name: str, cluster: LaunchPlan | None = None) -> Runtime:
    """The runtime object for a concrete name stored in cluster.json.

    `cluster` (a ClusterSpec, when launching) carries the docker options and store.
    """
    cls = runtime_class(name)
    return cls.for_cluster(cluster) if cluster is not None else cls()


def stray_instances(cluster_dir: Path) -> dict[str, Instance]:
    """Servers still running in `cluster_dir` when the state naming them is lost (`down` of a
    damaged cluster). Only local servers can be found this way: they run in their cluster dir
    (a docker cluster's containers carry labels, found by `remove_leftovers`)."""
    return dict(LocalRuntime().strays(cluster_dir))
