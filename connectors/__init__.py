"""KV connectors for vLLM: FSConnector and MultiConnectorV0, and the FS store they share.

Packages (each may import only those listed before it):

    store/    the on-disk format (no torch, no vLLM), eviction, the torch-side store
    config/   KV-transfer config: validation, the multi-connector topology (no torch, no vLLM)
    v0/       vLLM V0 engine integration: connectors, KV layouts, batch slicing, CPU worker
    logs.py   loggers named under "vllm.kvctl." (any package)
    plugin.py the vllm.general_plugins entry point; registers the connectors lazily

kvctl imports `store` and `config` only (its rig-side benchmark `kvctl.bench.layout`
also runs `v0.kv_layout`); `v0` is loaded by vLLM through the plugin.
`connectors` never imports `kvctl`.
"""
