"""The vLLM 0.9.2 facts connectors.config copies by hand, compared with the rig's vLLM.

`connectors.config.validate` checks ``--kv-transfer-config`` without vLLM
(kvctl runs on laptops), so it keeps its own copy of `KVTransferConfig`'s
fields and of the connector names vLLM's factory registers. These tests run
in the rig and import vLLM (a missing vLLM fails, it does not skip): a vLLM
that adds, drops or retypes a field, or registers other connectors, fails here.
"""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest
import vllm  # noqa: F401  (runs in the rig; a missing vLLM must fail, not skip)
from vllm.config import KVTransferConfig

from connectors import plugin
from connectors.config.validate import KNOWN_V0_CONNECTORS, KNOWN_V1_CONNECTORS, KV_TRANSFER_FIELDS
from connectors.registry import registered_connectors

FIELDS = {f.name: f for f in dataclasses.fields(KVTransferConfig)}
HINTS = typing.get_type_hints(KVTransferConfig)


def json_types(annotation) -> set[type]:
    """The JSON value types a field annotation admits (None left out; a float field takes ints)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(json_types(a) for a in args if a is not type(None)))
    if origin is typing.Literal:
        return {type(a) for a in args}
    if origin is not None:
        return {origin}  # dict[str, Any] -> dict
    return {int, float} if annotation is float else {annotation}


def test_vllm_kv_transfer_config_is_a_dataclass():
    assert dataclasses.is_dataclass(KVTransferConfig)


def test_copied_field_names_are_vllms():
    assert sorted(KV_TRANSFER_FIELDS) == sorted(FIELDS)


@pytest.mark.parametrize("name", sorted(KV_TRANSFER_FIELDS))
def test_copied_field_types_are_vllms(name):
    assert set(KV_TRANSFER_FIELDS[name]) == json_types(HINTS[name]), HINTS[name]


@pytest.mark.parametrize("name", sorted(KV_TRANSFER_FIELDS))
def test_vllms_default_passes_the_copied_type(name):
    field = FIELDS[name]
    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    assert default is None or isinstance(default, KV_TRANSFER_FIELDS[name]), (name, default)


def test_known_connector_names_are_what_the_factory_registers(monkeypatch):
    """vLLM's own V0 and V1 names plus ours, once the plugin has run (no user extras)."""
    monkeypatch.delenv(plugin.EXTRA_CONNECTORS_ENV, raising=False)
    plugin.register()
    assert sorted(registered_connectors()) == sorted(KNOWN_V0_CONNECTORS + KNOWN_V1_CONNECTORS)
