"""vLLM plugin hook (entry point group `vllm.general_plugins`).

vLLM calls `register()` early in every process (API server, engine, workers),
so a plain `--kv-transfer-config '{"kv_connector":"FSConnector",...}'` finds
our connectors in V0's KVConnectorFactory. Registration is lazy: a
connector's module is imported only when a config names it.
"""

from __future__ import annotations

CONNECTORS = {
    "FSConnector": ("connectors.fs_connector", "FSConnector"),
    "MultiConnectorV0": ("connectors.multi_connector", "MultiConnectorV0"),
}


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, (module, cls) in CONNECTORS.items():
        # vLLM may load plugins more than once per process; registering twice raises.
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, cls)
