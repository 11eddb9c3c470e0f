"""vLLM plugin hook (entry point group `vllm.general_plugins`).

vLLM calls `register()` early in every process (API server, engine, workers),
so a plain `--kv-transfer-config '{"kv_connector":"FSConnector",...}'` finds
our connectors in V0's KVConnectorFactory. Registration is lazy: a
connector's module is imported only when a config names it.

V0 looks connector names up only in that factory, so a user's own V0
connector can be registered the same way without writing a plugin:
``KVCTL_EXTRA_CONNECTORS="MyConnector=my_pkg.my_module:MyConnector;..."``.
"""

from __future__ import annotations

import logging
import os

from connectors.config.validate import EXTRA_CONNECTORS_ENV, parse_extra_connectors

CONNECTORS = {
    "FSConnector": ("connectors.v0.fs_connector", "FSConnector"),
    "MultiConnectorV0": ("connectors.v0.multi_connector", "MultiConnectorV0"),
}


def register() -> None:
    """Register our connectors and the user's extras (each name once per process).

    Raises ValueError for a malformed KVCTL_EXTRA_CONNECTORS and
    RegistryUnavailable when vLLM's factory is not the one 0.9.x has.
    """
    from connectors.v0.registry import register_once

    wanted = dict(CONNECTORS)
    wanted.update(parse_extra_connectors(os.environ.get(EXTRA_CONNECTORS_ENV, "")))
    for name, (module, cls) in wanted.items():
        if register_once(name, module, cls):
            logging.getLogger("vllm.kvctl.plugin").debug("registered V0 connector %s", name)
