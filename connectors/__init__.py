"""KV connectors for vLLM: FSConnector (V0 and V1), MultiConnectorV0, and the FS store they share.

Packages (each may import only those listed before it):

    store/    the on-disk format (no torch, no vLLM), eviction, the torch-side store
    config/   KV-transfer config: validation, the multi-connector topology, the engine
              and role names (no torch, no vLLM)
    layout/   what V0's and V1's KV layout adapters share: the KVLayout contract,
              LayerWriter, gather buffers, blockwise moves, the flash layout (torch only)
    served_model.py  the model identity in store keys, from vLLM's model config (no vLLM import)
    registry.py      the one place that reads vLLM's KVConnectorFactory registry
    v0/       vLLM V0 engine integration: connectors, KV layouts, batch slicing, CPU worker
    v1/       vLLM V1 integration: FSConnector (KVConnectorBase_V1), KV layouts, transfer
              decisions; never imports v0 (what both use is in layout/ and served_model.py)
    logs.py   loggers named under "vllm.kvctl." (any package)
    log_lines.py  the log lines operators grep: templates the connectors log and the
              patterns kvctl reads them back with (standard library only; any package)
    plugin.py the vllm.general_plugins entry point; registers the connectors of the
              running engine (V0 on vLLM 0.9.x, V1 on vLLM >= 0.11) lazily

kvctl imports `store`, `config` and `log_lines` only (its rig-side benchmark `kvctl.bench.layout`
also runs `layout` and `v0.kv_layout`); `v0`/`v1` are loaded by vLLM through the plugin.
`connectors` never imports `kvctl`.
"""
