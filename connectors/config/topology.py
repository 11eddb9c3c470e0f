"""Which connector of a kv-transfer-config does what: the one reading of the topology.

Everything that needs to know "which children send, which one is the transfer
child, where does each FS child store, what role does each have" asks here:
MultiConnectorV0 when it builds its children, the config validator, kvctl's
verify (which `sent to connector` lines P must log), scenarios (which store P
and D share) and the cluster spec and docker runtime (which dirs to create and
mount). No torch, no vLLM: it reads the config dict, validated or not, and
skips what it cannot read instead of raising.

The rule, as MultiConnectorV0 and vLLM 0.9.2 behave:

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
- A child marked ``"transfer": true`` gets the prompt as it was before any
  other child rebuilt the input (MultiConnectorV0's `Child.transfer`).
- The **transfer child** of a side (``"send"`` for P, ``"recv"`` for D) is the
  FSConnector child that carries KV from P to D: among the FSConnector
  children acting on that side, the one marked transfer, else the only one.
  None when that is ambiguous (several, none marked) or there is none. For a
  plain FSConnector config, the connector itself carries the KV.
- A child's **store** is the ``fs_storage_path`` of its extra config (an
  FSConnector's store directory; None when it has none).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

ROLES = ("kv_producer", "kv_consumer", "kv_both")
SENDING_ROLES = ("kv_producer", "kv_both")
RECEIVING_ROLES = ("kv_consumer", "kv_both")

FS_CONNECTOR = "FSConnector"
MULTI_CONNECTOR = "MultiConnectorV0"

Direction = Literal["send", "recv"]


@dataclass(frozen=True)
class Child:
    """One MultiConnectorV0 child as the parent runs it."""

    index: int  # position in kv_connector_extra_config.connectors
    connector: str | None  # its kv_connector (None when missing or not a string)
    role: str | None  # its own kv_role (None when missing or not a role)
    sends: bool  # its send runs: parent and child both have a sending role
    receives: bool  # its recv runs: parent and child both have a receiving role
    transfer: bool  # marked "transfer": true
    store: str | None  # fs_storage_path of its extra config, if any
    config: Mapping[str, Any] = field(repr=False)  # its whole KVTransferConfig dict

    @property
    def is_fs(self) -> bool:
        return self.connector == FS_CONNECTOR


def acts(role: object, direction: Direction) -> bool:
    """Whether a connector with `role` runs on that side (send: producer/both, recv: consumer/both)."""
    return role in (SENDING_ROLES if direction == "send" else RECEIVING_ROLES)


def children(cfg: object) -> list[Child]:
    """A MultiConnectorV0 config's children in config order ([] for any other config).

    Entries that are not objects are skipped (their index is kept by the others).
    """
    if not isinstance(cfg, Mapping) or cfg.get("kv_connector") != MULTI_CONNECTOR:
        return []
    listed = _extra(cfg).get("connectors")
    if not isinstance(listed, list):
        return []
    parent_role = cfg.get("kv_role")
    out = []
    for index, child in enumerate(listed):
        if not isinstance(child, Mapping):
            continue
        role = child.get("kv_role") if child.get("kv_role") in ROLES else None
        name = child.get("kv_connector")
        out.append(Child(
            index=index, connector=name if isinstance(name, str) else None, role=role,
            sends=acts(parent_role, "send") and acts(role, "send"),
            receives=acts(parent_role, "recv") and acts(role, "recv"),
            transfer=_extra(child).get("transfer") is True, store=_store(child), config=child))
    return out


def sending_children(cfg: object) -> list[Child]:
    """The children whose send runs, in config order (P logs `sent to connector <Name>` for each)."""
    return [c for c in children(cfg) if c.sends]


def receiving_children(cfg: object) -> list[Child]:
    """The children whose recv runs, in config order (the first that serves wins)."""
    return [c for c in children(cfg) if c.receives]


def transfer_child(cfg: object, direction: Direction) -> Child | None:
    """The FSConnector child that carries KV P->D on this side, or None (see the module's rule)."""
    fs = [c for c in children(cfg) if c.is_fs and (c.sends if direction == "send" else c.receives)]
    chosen = [c for c in fs if c.transfer] or fs
    return chosen[0] if len(chosen) == 1 else None


def transfer_store(cfg: object, direction: Direction) -> str | None:
    """The FS store directory that carries KV P->D in this config, or None.

    `direction` is the side asking: "send" for the prefill config, "recv" for
    the decode one. A plain FSConnector's own store when its role acts on that
    side; for MultiConnectorV0, the transfer child's store.
    """
    if not isinstance(cfg, Mapping) or not acts(cfg.get("kv_role"), direction):
        return None
    if cfg.get("kv_connector") == FS_CONNECTOR:
        return _store(cfg)
    child = transfer_child(cfg, direction)
    return child.store if child is not None else None


def fs_storage_paths(cfg: object) -> list[str]:
    """Every store directory the config names: the connector's, then each MultiConnectorV0 child's.

    Whatever their role or connector (a user's connector may use the key
    too): these are the directories a server may touch, to create and mount.
    """
    if not isinstance(cfg, Mapping):
        return []
    own = _store(cfg)
    return ([own] if own else []) + [c.store for c in children(cfg) if c.store]


def _extra(cfg: Mapping) -> Mapping:
    extra = cfg.get("kv_connector_extra_config")
    return extra if isinstance(extra, Mapping) else {}


def _store(cfg: Mapping) -> str | None:
    found = _extra(cfg).get("fs_storage_path")
    return found if isinstance(found, str) and found else None
