"""Which connector of a kv-transfer-config does what: the one reading of the topology.

Everything that needs to know "which children send, which one is the transfer
child, where does each FS child store, what role does each have" asks here:
MultiConnectorV0 when it builds its children, the config validator, kvctl's
verify (which `sent to connector` lines P must log, which connector's evidence
it can read), scenarios (which store P and D share) and the cluster spec and
docker runtime (which dirs to create and mount). No torch, no vLLM: it reads
the config dict, validated or not, and skips what it cannot read instead of
raising.

Two multi connectors: ours for vLLM V0 (``MultiConnectorV0``) and vLLM's own
V1 ``MultiConnector`` (vLLM 0.11+; read from vLLM 0.32's
``kv_connector/v1/multi_connector.py``). Both take the children as full
KVTransferConfig dicts in ``kv_connector_extra_config.connectors``.

The rule, as MultiConnectorV0 and vLLM 0.9.2 behave (V0):

- A child's role is its own ``kv_role``; nothing is inherited from the parent.
  MultiConnectorV0 builds each child from its own dict, and vLLM's
  KVTransferConfig refuses a connector without a role (so does the
  validator). A child with no valid role does nothing.
- The parent's role decides whether a hook runs at all: vLLM calls the
  parent's send only when the parent is kv_producer or kv_both, its recv only
  when it is kv_consumer or kv_both.
- So a child **sends** when parent and child both have a sending role, and
  **receives** when both have a receiving role. Every sending child runs, in
  config order; receiving children run in config order until one serves.
  P logs ``sent to connector <Name>`` for each sending child (`logs_send`).

As vLLM 0.32's V1 ``MultiConnector`` behaves (V1):

- Each child is built from its own dict too (its own ``kv_role``), but V1
  calls every connector hook whatever the role, and MultiConnector forwards
  every call to every child: the parent's role gates nothing (it only tunes
  vLLM's scheduler). A child acts by its own role: our FSConnector saves as
  kv_producer/kv_both and loads as kv_consumer/kv_both. vLLM's
  ``ExampleConnector`` (once ``SharedStorageConnector``) ignores its role: it
  saves every new prompt and loads whatever its directory holds, so it both
  sends and receives (`ROLE_BLIND_V1`).
- Loads come from the **first** receiving child, in config order, that offers
  tokens; saves go to every sending child. V1 logs no per-child line
  (`logs_send` is False): verify's evidence is the FS child's own lines.

For both:

- A child marked ``"transfer": true`` is the one kvctl reads the P->D store of
  (V0: MultiConnectorV0 also hands it the prompt as it was before any other
  child rebuilt the input, `Child.transfer`).
- The **transfer child** of a side (``"send"`` for P, ``"recv"`` for D) is the
  FSConnector child that carries KV from P to D: among the FSConnector
  children acting on that side, the one marked transfer, else the only one.
  None when that is ambiguous (several, none marked) or there is none, and
  when a handshake child (NIXL, below) is there and no FS child is marked
  transfer: NIXL carries the KV, an FS child beside it is an offload (its
  store private to the instance). For a plain FSConnector config, the
  connector itself carries the KV.
- A child's **store** is the ``fs_storage_path`` of its extra config (an
  FSConnector's store directory; None when it has none).
- `transfer_connector` names whatever carries KV on a side when no
  FSConnector does (a third-party connector: kvctl cannot read its evidence).
- `handshake_connector` says whether P's answer carries `kv_transfer_params` D
  needs (NIXL): then the router asks P for them and hands them to D.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

ROLES = ("kv_producer", "kv_consumer", "kv_both")
SENDING_ROLES = ("kv_producer", "kv_both")
RECEIVING_ROLES = ("kv_consumer", "kv_both")

FS_CONNECTOR = "FSConnector"
MULTI_CONNECTOR = "MultiConnectorV0"  # ours, vLLM V0
V1_MULTI_CONNECTOR = "MultiConnector"  # vLLM's own, V1
MULTI_ENGINES = {MULTI_CONNECTOR: "v0", V1_MULTI_CONNECTOR: "v1"}
# V1 connectors that save and load whatever their kv_role says (vLLM 0.32's ExampleConnector).
ROLE_BLIND_V1 = ("ExampleConnector", "SharedStorageConnector")
# LMCache's multi-process connector (V1): a client of a separate `lmcache server` process, which
# kvctl runs beside the instance (kvctl.cluster.lmcache); `lmcache.mp.host`/`port` name it.
LMCACHE_MP_CONNECTOR = "LMCacheMPConnector"
# LMCache's in-process V1 connector: no CPU path in LMCache 0.5.6 (it recomputes every prompt there).
LMCACHE_V1_CONNECTOR = "LMCacheConnectorV1"
# Extra-config keys naming a directory a connector writes: ours, and ExampleConnector's.
STORAGE_PATH_KEYS = ("fs_storage_path", "shared_storage_path")

# V1 connectors whose prefill answers with `kv_transfer_params` that D must be given
# (vLLM's P/D proxy protocol: P is asked with `do_remote_decode`, D gets the params P
# answered with and pulls the KV from P). A router in front of such a cluster must
# relay them (kvctl.router's handshake); a file-based transfer needs nothing.
HANDSHAKE_CONNECTORS = ("NixlConnector", "NixlPullConnector", "NixlPushConnector")

Direction = Literal["send", "recv"]


@dataclass(frozen=True)
class Child:
    """One child of a multi connector (MultiConnectorV0 or V1's MultiConnector) as the parent runs it."""

    index: int  # position in kv_connector_extra_config.connectors
    connector: str | None  # its kv_connector (None when missing or not a string)
    role: str | None  # its own kv_role (None when missing or not a role)
    sends: bool  # its send runs: parent and child both have a sending role
    receives: bool  # its recv runs: parent and child both have a receiving role
    transfer: bool  # marked "transfer": true
    store: str | None  # fs_storage_path of its extra config, if any
    config: Mapping[str, Any] = field(repr=False)  # its whole KVTransferConfig dict
    logs_send: bool = False  # P logs `sent to connector <Name>` for it (MultiConnectorV0 senders only)

    @property
    def is_fs(self) -> bool:
        return self.connector == FS_CONNECTOR


def acts(role: object, direction: Direction) -> bool:
    """Whether a connector with `role` runs on that side (send: producer/both, recv: consumer/both)."""
    return role in (SENDING_ROLES if direction == "send" else RECEIVING_ROLES)


def multi_engine(cfg: object) -> str | None:
    """"v0" for a MultiConnectorV0 config, "v1" for vLLM's MultiConnector, None for any other."""
    name = cfg.get("kv_connector") if isinstance(cfg, Mapping) else None
    return MULTI_ENGINES.get(name) if isinstance(name, str) else None


def children(cfg: object) -> list[Child]:
    """A multi connector's children in config order ([] for any other config).

    MultiConnectorV0 (V0) or vLLM's MultiConnector (V1): see the module's rule
    for what each child does. Entries that are not objects are skipped (their
    index is kept by the others).
    """
    engine = multi_engine(cfg)
    if engine is None:
        return []
    assert isinstance(cfg, Mapping)
    listed = _extra(cfg).get("connectors")
    if not isinstance(listed, list):
        return []
    parent_role = cfg.get("kv_role") if engine == "v0" else "kv_both"  # V1: the parent gates nothing
    out = []
    for index, child in enumerate(listed):
        if not isinstance(child, Mapping):
            continue
        role = child.get("kv_role") if child.get("kv_role") in ROLES else None
        name = child.get("kv_connector")
        acting = "kv_both" if engine == "v1" and name in ROLE_BLIND_V1 and role is not None else role
        sends = acts(parent_role, "send") and acts(acting, "send")
        out.append(Child(
            index=index, connector=name if isinstance(name, str) else None, role=role,
            sends=sends, receives=acts(parent_role, "recv") and acts(acting, "recv"),
            transfer=_extra(child).get("transfer") is True, store=_store(child), config=child,
            logs_send=sends and engine == "v0"))
    return out


def sending_children(cfg: object) -> list[Child]:
    """The children whose send runs, in config order (V1: each saves; V0: each is handed the KV)."""
    return [c for c in children(cfg) if c.sends]


def logged_send_children(cfg: object) -> list[Child]:
    """The children P logs `sent to connector <Name>` for, per request, in config order.

    MultiConnectorV0's sending children; none for V1's MultiConnector (it logs
    no per-child line) or a plain connector.
    """
    return [c for c in children(cfg) if c.logs_send]


def receiving_children(cfg: object) -> list[Child]:
    """The children whose recv runs, in config order (the first that serves wins; V1: the first
    that offers tokens)."""
    return [c for c in children(cfg) if c.receives]


def transfer_child(cfg: object, direction: Direction) -> Child | None:
    """The FSConnector child that carries KV P->D on this side, or None (see the module's rule)."""
    listed = children(cfg)
    fs = [c for c in listed if c.is_fs and (c.sends if direction == "send" else c.receives)]
    handshake = any(c.connector in HANDSHAKE_CONNECTORS for c in listed)
    chosen = [c for c in fs if c.transfer] or ([] if handshake else fs)
    return chosen[0] if len(chosen) == 1 else None


def transfer_store(cfg: object, direction: Direction) -> str | None:
    """The FS store directory that carries KV P->D in this config, or None.

    `direction` is the side asking: "send" for the prefill config, "recv" for
    the decode one. A plain FSConnector's own store when its role acts on that
    side; for a multi connector (V0 or V1), the transfer child's store.
    """
    if not isinstance(cfg, Mapping):
        return None
    if multi_engine(cfg) is not None:
        child = transfer_child(cfg, direction)
        return child.store if child is not None else None
    if cfg.get("kv_connector") == FS_CONNECTOR and acts(cfg.get("kv_role"), direction):
        return _store(cfg)
    return None


def transfer_connector(cfg: object, direction: Direction) -> str | None:
    """The connector that carries KV on this side when no FSConnector does, else None.

    None as well when nothing in the config acts on that side. For a plain
    connector, its name; for a multi connector without an FSConnector child on
    that side, its first child acting there (V1 loads from the first that
    offers tokens). kvctl cannot read such a connector's evidence: its log
    lines and its store are not ours.
    """
    if not isinstance(cfg, Mapping) or transfer_store(cfg, direction) is not None:
        return None
    if multi_engine(cfg) is None:
        name, role = cfg.get("kv_connector"), cfg.get("kv_role")
        acting = acts(role, direction) or (name in ROLE_BLIND_V1 and role in ROLES)
        return name if acting and isinstance(name, str) and name != FS_CONNECTOR else None
    acting_children = [c for c in children(cfg) if (c.sends if direction == "send" else c.receives)]
    if any(c.connector in HANDSHAKE_CONNECTORS for c in acting_children):
        # NIXL carries the KV: an FS child beside it is an offload (see transfer_child)
        acting_children = [c for c in acting_children if not c.is_fs]
    if not acting_children or any(c.is_fs for c in acting_children):
        return None  # nothing acts, or FS children (an ambiguous transfer child is the validator's)
    return acting_children[0].connector


def connector_names(cfg: object) -> list[str]:
    """Every connector a config runs: its own kv_connector, then each multi connector
    child's, in config order (names that are not strings are skipped)."""
    if not isinstance(cfg, Mapping):
        return []
    found = [cfg["kv_connector"]] if isinstance(cfg.get("kv_connector"), str) else []
    return found + [c.connector for c in children(cfg) if c.connector is not None]


def handshake_connector(cfg: object) -> str | None:
    """The connector of a prefill config that needs the router's kv_transfer_params
    handshake (HANDSHAKE_CONNECTORS: itself, or a multi connector's child), else None."""
    return next((n for n in connector_names(cfg) if n in HANDSHAKE_CONNECTORS), None)


def named_connectors(cfg: object, name: str) -> list[tuple[int | None, Mapping[str, Any]]]:
    """(child index, config) of every connector called `name` in the config: the config itself
    (index None), or a multi connector's children of that name, in config order."""
    if not isinstance(cfg, Mapping):
        return []
    if multi_engine(cfg) is None:
        return [(None, cfg)] if cfg.get("kv_connector") == name else []
    return [(c.index, c.config) for c in children(cfg) if c.connector == name]


def fs_storage_paths(cfg: object) -> list[str]:
    """Every store directory the config names: the connector's, then each multi connector child's.

    Whatever their role or connector (a user's connector may use the key
    too; ExampleConnector's `shared_storage_path` counts): these are the
    directories a server may touch, to create and mount.
    """
    if not isinstance(cfg, Mapping):
        return []
    found = _paths(cfg)
    for c in children(cfg):
        found += _paths(c.config)
    return found


def _extra(cfg: Mapping) -> Mapping:
    extra = cfg.get("kv_connector_extra_config")
    return extra if isinstance(extra, Mapping) else {}


def _paths(cfg: Mapping) -> list[str]:
    extra = _extra(cfg)
    return [p for key in STORAGE_PATH_KEYS if isinstance(p := extra.get(key), str) and p]


def _store(cfg: Mapping) -> str | None:
    found = _extra(cfg).get("fs_storage_path")
    return found if isinstance(found, str) and found else None
