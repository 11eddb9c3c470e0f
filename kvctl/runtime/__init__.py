"""Runtimes that start vLLM servers: `local` (processes) and `docker` (containers).

    base.py            the contract (Runtime, Instance, InstanceSpec), the vLLM command
                       line and environment both runtimes use, log-file helpers
    processes.py       /proc: is a process alive, still ours, its group's members
    local.py           LocalRuntime: servers as processes of the rig's python
    docker_engine.py   engine URLs and connecting (the docker SDK only inside `connect`)
    docker_options.py  DockerOptions: image, GPUs, bind address, engines (a plain value)
    log_follower.py    `python -m kvctl.runtime.log_follower`: a container's output to a file
    docker.py          DockerRuntime and DockerInstance: servers as containers

`select_runtime` is the one place that resolves a requested runtime
(local|docker|auto); `get_runtime` builds the chosen one. The docker runtime
is imported only when chosen: kvctl runs without the docker SDK installed.

May import: `kvctl.errors`, `kvctl.paths`, `kvctl.subprocesses`, `kvctl.provision`
(the rig's python, the default image), `connectors.config`. Never `kvctl.cluster`
(it builds on this), a command or a view.
"""

from __future__ import annotations

from typing import Any

from kvctl.errors import BadInput
from kvctl.runtime.base import (
    ROLES,
    Instance,
    InstanceSpec,
    InstanceStatus,
    Runtime,
    StopResult,
)
from kvctl.runtime.local import LocalRuntime

RUNTIME_CHOICES = ("local", "docker", "auto")

__all__ = ["ROLES", "RUNTIME_CHOICES", "Instance", "InstanceSpec", "InstanceStatus", "LocalRuntime",
           "Runtime", "StopResult", "get_runtime", "select_runtime"]


def select_runtime(requested: str) -> tuple[str, str]:
    """Resolve a requested runtime (local, docker or auto) to a concrete name and the reason.

    Raises BadInput (field `runtime`) for an unknown value.
    """
    if requested in ("local", "docker"):
        return requested, "requested"
    if requested == "auto":
        return "local", "auto: local CPU processes (the docker runtime runs containers)"
    raise BadInput(f"unknown runtime {requested!r}", field="runtime",
                   fix=f"use one of: {', '.join(RUNTIME_CHOICES)}")


def get_runtime(name: str, cluster: Any = None) -> Runtime:
    """The runtime object for a concrete name stored in cluster.json.

    `cluster` (a ClusterSpec, when launching) carries the docker options and store.
    """
    if name == "local":
        return LocalRuntime()
    if name == "docker":
        from kvctl.runtime.docker import DockerRuntime

        return DockerRuntime.for_cluster(cluster) if cluster is not None else DockerRuntime()
    raise BadInput(f"runtime {name!r} is not available in this kvctl", where="runtime",
                   fix="use a kvctl version that supports it, or the local runtime")
