"""What verify needs from a cluster: its model name, store and each instance's URL, log and config.

Read from kvctl.cluster's state (ClusterState, or its cluster.json dict), or
built directly (tests, and anything that runs servers itself).

A launched cluster has every piece. An attached one (kvctl.attach) may lack
some: an instance without a log source, a store not visible from here. Those
stay None with the reason beside them (`InstanceInfo.unobservable`,
`ClusterInfo.store_unobservable`), for the checks to report as not observable.
An instance whose log is a command (`cmd:...`) has `log_command`; its output
goes to `log_path` while verify runs (kvctl.verify.log_files.capturing_logs).
`api_key` is what verify's requests authenticate with: the cluster's `api_key`
file (launched with a key), else $KVCTL_API_KEY (kvctl.cluster.state.cluster_api_key).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from connectors.config.topology import LMCACHE_MP_CONNECTOR, named_connectors
from kvctl.cluster.state import COMMAND_PREFIX, ClusterState, cluster_api_key, cluster_store_keys, load_cluster
from kvctl.errors import BadInput
from kvctl.paths import kvctl_home

if TYPE_CHECKING:
    from connectors.store.auth import StoreKeys

NO_LOG_SOURCE = "no log source was given for it (kvctl attach)"
STORE_NOT_VISIBLE = "the store is not visible from this host (attached without a store path)"


@dataclass(frozen=True)
class OffloadInfo:
    """An instance's offload child whose evidence kvctl reads: LMCacheMPConnector and the
    LMCache server kvctl runs for it (cluster.json's `lmcache`)."""

    connector: str  # the child's kv_connector, e.g. LMCacheMPConnector
    child: int | None  # its index among the multi connector's children (None: the connector itself)
    server: str  # the server's name, e.g. lmcache-prefill
    url: str  # its HTTP base URL (/healthcheck)
    log_path: Path
    chunk_size: int

    @property
    def label(self) -> str:
        return self.connector if self.child is None else f"{self.connector} (child {self.child})"


@dataclass(frozen=True)
class InstanceInfo:
    role: str
    url: str
    log_path: Path | None  # None: not observable from here (see `unobservable`)
    kv_transfer_config: dict
    name: str = ""  # its key in cluster.json ("prefill", "decode-0", ...); "" means the role
    log_command: str | None = None  # its log is this command's output, captured into log_path
    unobservable: str = ""  # why its log cannot be read ("" when it can)
    offload: OffloadInfo | None = None  # its LMCache offload child, when kvctl runs its server

    @property
    def label(self) -> str:
        return self.name or self.role


@dataclass(frozen=True)
class ClusterInfo:
    """What verify needs from a cluster's state, whatever runtime launched it."""

    name: str
    model: str  # the name requests use (served model name)
    store: Path | None  # None: not visible from here (see `store_unobservable`)
    prefill: InstanceInfo
    decode: InstanceInfo
    endpoint: str | None = None  # the router in front of the instances, if any
    store_unobservable: str = ""
    instances: tuple[InstanceInfo, ...] = field(default=())  # every instance; () means prefill and decode
    api_key: str | None = field(default=None, repr=False)  # sent as `Authorization: Bearer KEY`
    store_keys: "StoreKeys | None" = field(default=None, repr=False)  # the entries' tags are checked with these
    managed: bool = True  # False: attached (kvctl did not start it)

    def all_instances(self) -> tuple[InstanceInfo, ...]:
        return self.instances or (self.prefill, self.decode)


def cluster_info(state: ClusterState | Mapping[str, Any], *, prefill: str | None = None,
                 decode: str | None = None) -> ClusterInfo:
    """ClusterInfo from a ClusterState or its cluster.json dict.

    `prefill`/`decode` name the instances requests go to; default: the one
    named after its role (a 1P1D cluster), else the first of the role listed.
    Raises BadInput naming the missing field or the unknown instance.
    """
    d = state.to_json() if isinstance(state, ClusterState) else state
    name = str(d.get("name", "?"))
    where = str(kvctl_home() / "clusters" / name / "cluster.json")
    managed = d.get("managed", True) is not False

    def need(obj: Mapping, key: str, at: str) -> Any:
        if obj.get(key) in (None, ""):
            raise BadInput(f"cluster state of {name!r} lacks {at}{key}", where=where,
                           fix=(f"relaunch it: `kvctl down` then `kvctl launch 1p1d`, both for cluster {name!r}"
                                if managed else f"attach it again: `kvctl detach {name}`, then `kvctl attach`"))
        return obj[key]

    instances = need(d, "instances", "")

    def instance(key: str) -> InstanceInfo:
        inst = need(instances, key, "instances.")
        at = f"instances.{key}."
        role = str(inst.get("role") or key)
        source = inst.get("log_source", ...)
        log_path: Path | None
        command, why = None, ""
        if source is ... or managed:  # launched: the log is its file
            log_path = Path(need(inst, "log_path", at))
        elif not source:
            log_path, why = None, NO_LOG_SOURCE
        elif str(source).startswith(COMMAND_PREFIX):
            log_path, command = Path(need(inst, "log_path", at)), str(source)[len(COMMAND_PREFIX):].strip()
        else:
            log_path = Path(need(inst, "log_path", at))
        cfg = dict(inst.get("kv_transfer_config") or {})
        return InstanceInfo(role=role, url=str(need(inst, "url", at)), log_path=log_path,
                            kv_transfer_config=cfg, name=key, log_command=command, unobservable=why,
                            offload=_offload(key, cfg, d.get("lmcache") or {}))

    def pick(role: str, wanted: str | None) -> str:
        of_role = [k for k, v in instances.items() if isinstance(v, Mapping) and v.get("role", k) == role]
        if wanted is not None:
            if wanted not in of_role:
                raise BadInput(f"cluster {name!r} has no {role} instance named {wanted!r}", field=role,
                               fix=f"use one of: {', '.join(of_role) or '(none)'}")
            return wanted
        if role in instances or not of_role:
            return role  # need() names it when it is missing
        return of_role[0]

    all_infos = tuple(instance(k) for k in instances if isinstance(instances[k], Mapping))
    p_key, d_key = pick("prefill", prefill), pick("decode", decode)
    model = d.get("served_model_name") or need(d, "model", "")
    store = d.get("store")
    if managed or store:
        store_path, store_why = Path(need(d, "store", "")), ""
    else:
        store_path, store_why = None, STORE_NOT_VISIBLE
    return ClusterInfo(name=name, model=str(model), store=store_path, prefill=instance(p_key),
                       decode=instance(d_key), endpoint=d.get("endpoint"), store_unobservable=store_why,
                       instances=all_infos, api_key=cluster_api_key(name), managed=managed,
                       store_keys=cluster_store_keys(name) if store_path is not None else None)


def _offload(instance: str, cfg: dict, servers: Mapping[str, Any]) -> OffloadInfo | None:
    """The LMCache server (cluster.json `lmcache`) serving `instance`'s LMCacheMPConnector, if any."""
    found = named_connectors(cfg, LMCACHE_MP_CONNECTOR)
    rec = next((r for r in servers.values() if isinstance(r, Mapping) and instance in (r.get("serves") or ())),
               None)
    if not found or rec is None:
        return None
    return OffloadInfo(connector=LMCACHE_MP_CONNECTOR, child=found[0][0], server=str(rec.get("name")),
                       url=str(rec.get("url")), log_path=Path(rec["log_path"]),
                       chunk_size=int((rec.get("options") or {}).get("chunk_size") or 0))


def load_cluster_info(name: str, *, prefill: str | None = None, decode: str | None = None) -> ClusterInfo:
    """The named cluster's ClusterInfo. Raises BadInput for an unknown cluster or instance."""
    return cluster_info(load_cluster(name), prefill=prefill, decode=decode)
