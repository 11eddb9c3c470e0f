"""vLLM's KV connector registry (`KVConnectorFactory`), read and written here only.

vLLM 0.9.2 registers connectors lazily (name -> module path + class name)
with `KVConnectorFactory.register_connector`, which raises on a name already
taken, and has no public way to list the names: they are the keys of the
private class attribute `KVConnectorFactory._registry`. Every part of
`connectors` that needs them asks this module, so a vLLM that renames or
reshapes that attribute fails here, once, with an error that says so.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory


class RegistryUnavailable(RuntimeError):
    """vLLM's factory no longer keeps its connector names where vLLM 0.9.x did."""


def _registry() -> Mapping:
    found = getattr(KVConnectorFactory, "_registry", None)
    if not isinstance(found, Mapping):
        import vllm

        raise RegistryUnavailable(
            f"vLLM {vllm.__version__}: KVConnectorFactory._registry is "
            f"{'missing' if found is None else type(found).__name__ + ', not a dict'}; "
            "connectors.registry reads the registered KV connector names from it "
            "(as in vLLM 0.9.x) and needs updating for this vLLM")
    return found


def registered_connectors() -> tuple[str, ...]:
    """Every connector name vLLM's factory can build, in registration order.

    Raises RegistryUnavailable when vLLM no longer exposes them as 0.9.x did.
    """
    return tuple(_registry())


def register_once(name: str, module: str, class_name: str) -> bool:
    """Register `name` -> `module`:`class_name` unless the name is taken.

    vLLM may load plugins more than once per process, and registering a name
    twice raises. Returns True when this call registered it. Raises
    RegistryUnavailable as `registered_connectors` does.
    """
    if name in _registry():
        return False
    KVConnectorFactory.register_connector(name, module, class_name)
    return True
