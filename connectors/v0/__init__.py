"""vLLM V0 engine integration (vLLM 0.9.x; V0 was removed upstream in 0.10.1).

    fs_connector.py     FSConnector: KV + hidden state to and from the FS store
    multi_connector.py  MultiConnectorV0: several V0 connectors in one instance
    kv_layout.py        gather/scatter adapters, one per V0 paged-cache layout,
                        chosen by attention backend name, moving whole blocks as rows;
                        reused gather buffers, and the one gather per step that
                        MultiConnectorV0's FS children share (torch and numpy, no vLLM)
    attn_backend.py     which attention backend shaped a worker's KV caches
    batch.py            slicing a V0 batch into per-request prefills, and which requests
                        can't be keyed by token ids (LoRA, multimodal, prompt embeds/adapters)
    cpu_worker.py       the CPU worker with the GPU runner's recv -> forward -> send hooks
                        (``--worker-cls connectors.v0.cpu_worker.KVTransferCPUWorker``)

May import: torch, vLLM, `connectors.store`, `connectors.config`, `connectors.layout`,
`connectors.logs`, `connectors.log_lines`, `connectors.served_model`, `connectors.registry`.

Loaded only inside vLLM processes (through `connectors.plugin`); `kvctl.bench`
imports `kv_layout` inside the rig.
"""
