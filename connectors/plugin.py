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

ENV_EXTRA = "KVCTL_EXTRA_CONNECTORS"

CONNECTORS = {
    "FSConnector": ("connectors.fs_connector", "FSConnector"),
    "MultiConnectorV0": ("connectors.multi_connector", "MultiConnectorV0"),
}


def parse_extra_connectors(value: str) -> dict[str, tuple[str, str]]:
    """`Name=module:Class;...` -> {Name: (module, Class)}. Raises ValueError naming the bad item."""
    found = {}
    for item in filter(None, (part.strip() for part in value.split(";"))):
        name, eq, target = item.partition("=")
        module, colon, cls = target.partition(":")
        if not (eq and colon and name.strip() and module.strip() and cls.strip()):
            raise ValueError(f"{ENV_EXTRA}: {item!r} is not Name=module:Class")
        found[name.strip()] = (module.strip(), cls.strip())
    return found


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    wanted = dict(CONNECTORS)
    wanted.update(parse_extra_connectors(os.environ.get(ENV_EXTRA, "")))
    for name, (module, cls) in wanted.items():
        # vLLM may load plugins more than once per process; registering twice raises.
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, cls)
            logging.getLogger("vllm.kvctl.plugin").debug("registered V0 connector %s", name)
