"""vLLM plugin hook (entry point group `vllm.general_plugins`).

vLLM calls `register()` early in every process (API server, engine, workers),
so a plain `--kv-transfer-config '{"kv_connector":"FSConnector",...}'` finds
our connectors in vLLM's KVConnectorFactory. Registration is lazy: a
connector's module is imported only when a config names it.

Which connectors depend on the vLLM that loads the plugin:

- vLLM 0.9.x (its factory has the V0 API, `create_connector_v0`): the V0
  connectors FSConnector and MultiConnectorV0 (connectors.v0), and the
  user's own V0 connectors from
  ``KVCTL_EXTRA_CONNECTORS="MyConnector=my_pkg.my_module:MyConnector;..."``
  (V0 looks names up only in that factory).
- vLLM V1 only (0.10.1 on: the V0 API is gone): FSConnector for V1
  (connectors.v1). V1 also finds it without the plugin through
  ``"kv_connector_module_path": "connectors.v1.fs_connector"``, and a user's
  own V1 connectors the same way, so KVCTL_EXTRA_CONNECTORS is V0-only.

A name already in the factory (registered by an earlier load of the plugin,
or by vLLM itself) is left alone.
"""

from __future__ import annotations

import logging
import os

from connectors.config.validate import EXTRA_CONNECTORS_ENV, parse_extra_connectors

CONNECTORS = {
    "FSConnector": ("connectors.v0.fs_connector", "FSConnector"),
    "MultiConnectorV0": ("connectors.v0.multi_connector", "MultiConnectorV0"),
}
V1_CONNECTORS = {
    "FSConnector": ("connectors.v1.fs_connector", "FSConnector"),
}


def has_v0_connector_api() -> bool:
    """The running vLLM can build V0 connectors (0.9.x), else it is V1-only."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return hasattr(KVConnectorFactory, "create_connector_v0")


def register() -> None:
    """Register our connectors (and, on V0, the user's extras) for this vLLM, each name once per process.

    Raises ValueError for a malformed KVCTL_EXTRA_CONNECTORS and
    RegistryUnavailable when vLLM's factory keeps no name registry.
    """
    from connectors.registry import register_once

    log = logging.getLogger("vllm.kvctl.plugin")
    if has_v0_connector_api():
        wanted = dict(CONNECTORS)
        wanted.update(parse_extra_connectors(os.environ.get(EXTRA_CONNECTORS_ENV, "")))
        engine = "V0"
    else:
        wanted, engine = dict(V1_CONNECTORS), "V1"
    for name, (module, cls) in wanted.items():
        if register_once(name, module, cls):
            log.debug("registered %s connector %s", engine, name)
