"""Runtimes that start vLLM servers: `local` (processes) and, later, `docker`.

`select_runtime` is the one place that resolves `--runtime local|docker|auto`;
`get_runtime` builds the chosen one. The docker runtime plugs in here.
"""

from __future__ import annotations

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
        raise BadInput("the docker runtime is not available yet in this kvctl",
                       where="--runtime docker",
                       fix="use --runtime local (vLLM CPU processes from the rig)")
    if requested == "auto":
        # Docker+GPU will be preferred here once the docker runtime exists.
        return "local", "auto: the docker runtime is not available yet, so local CPU processes"
    raise BadInput(f"unknown runtime {requested!r}", where="--runtime",
                   fix=f"use one of: {', '.join(RUNTIME_CHOICES)}")


def get_runtime(name: str) -> Runtime:
    """The runtime object for a concrete name stored in cluster.json."""
    if name == "local":
        return LocalRuntime()
    raise BadInput(f"runtime {name!r} is not available in this kvctl", where="runtime",
                   fix="use a kvctl version that supports it, or --runtime local")
