"""Runtimes that start vLLM servers: `local` (processes) and `docker` (containers).

`select_runtime` is the one place that resolves `--runtime local|docker|auto`;
`get_runtime` builds the chosen one. The docker runtime (and its SDK) is
imported only when chosen: kvctl runs without the docker SDK installed.
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
    """Resolve a --runtime value to a concrete runtime name and the reason for it.

    Raises BadInput for an unknown value or a runtime this kvctl cannot run yet.
    """
    if requested == "local":
        return "local", "requested with --runtime local"
    if requested == "docker":
        return "docker", "requested with --runtime docker"
    if requested == "auto":
        return "local", "auto: local CPU processes (--runtime docker runs containers)"
    raise BadInput(f"unknown runtime {requested!r}", where="--runtime",
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
                   fix="use a kvctl version that supports it, or --runtime local")
