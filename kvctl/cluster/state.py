"""Cluster state: what is running, in `$KVCTL_HOME/clusters/<name>/cluster.json`.

    {"name": str, "runtime": "local"|"docker", "model": abs path,
     "served_model_name": str, "store": abs host path of the shared store dir,
     "created": ISO-8601 UTC,
     "instances": {"prefill": {...}, "decode": {...}}}

Each instance: `role`, `url`, `pid` (local) or `container_id` (docker) plus
runtime extras (`start_ticks`, `command`), `log_path`, `kv_transfer_config`
(dict, or null for a server without a connector), `cwd`. Other kvctl modules
(verify, inspect-store, scenarios) read these fields: they are a contract.
The cluster dir also holds the servers' cwd, their logs under `logs/`, and
the default store `store/`. The file is written atomically (temp + rename).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvctl.errors import BadInput
from kvctl.paths import kvctl_home

DEFAULT_NAME = "default"
STATE_FILE = "cluster.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


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
    """`name`, checked. Raises BadInput (field `name`) for one unfit for a directory."""
    if not _NAME_RE.match(name or ""):
        raise BadInput(f"invalid cluster name {name!r}", field="name",
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
    fix = (f"name one of: {', '.join(existing)}" if existing
           else f"launch a cluster named {name!r} first (`kvctl launch 1p1d`)")
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
                       fix=f"tear cluster {name!r} down with `kvctl down` (it removes the state)") from None


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
