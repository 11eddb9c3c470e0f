"""What verify needs from a cluster: its model name, store and each instance's URL, log and config.

Read from kvctl.cluster's state (ClusterState, or its cluster.json dict), or
built directly (tests, and anything that runs servers itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvctl.cluster.state import ClusterState, load_cluster
from kvctl.errors import BadInput
from kvctl.paths import kvctl_home


@dataclass(frozen=True)
class InstanceInfo:
    role: str
    url: str
    log_path: Path
    kv_transfer_config: dict


@dataclass(frozen=True)
class ClusterInfo:
    """What verify needs from a cluster's state, whatever runtime launched it."""

    name: str
    model: str  # the name requests use (served model name)
    store: Path
    prefill: InstanceInfo
    decode: InstanceInfo


def cluster_info(state: ClusterState | Mapping[str, Any]) -> ClusterInfo:
    """ClusterInfo from a ClusterState or its cluster.json dict.

    Raises BadInput naming the missing field.
    """
    d = state.to_json() if isinstance(state, ClusterState) else state
    name = str(d.get("name", "?"))

    def need(obj: Mapping, key: str, where: str) -> Any:
        if obj.get(key) in (None, ""):
            raise BadInput(f"cluster state of {name!r} lacks {where}{key}",
                           where=str(kvctl_home() / "clusters" / name / "cluster.json"),
                           fix=f"relaunch it: `kvctl down` then `kvctl launch 1p1d`, both for cluster {name!r}")
        return obj[key]

    instances = need(d, "instances", "")

    def instance(role: str) -> InstanceInfo:
        inst = need(instances, role, "instances.")
        return InstanceInfo(role=role, url=str(need(inst, "url", f"instances.{role}.")),
                            log_path=Path(need(inst, "log_path", f"instances.{role}.")),
                            kv_transfer_config=dict(inst.get("kv_transfer_config") or {}))

    model = d.get("served_model_name") or need(d, "model", "")
    return ClusterInfo(name=name, model=str(model), store=Path(need(d, "store", "")),
                       prefill=instance("prefill"), decode=instance("decode"))


def load_cluster_info(name: str) -> ClusterInfo:
    """The named cluster's ClusterInfo. Raises BadInput for an unknown cluster."""
    return cluster_info(load_cluster(name))
