"""vLLM V1 engine integration (vLLM 0.10.1 on; every release since 0.11 runs V1 only).

    fs_connector.py  FSConnector for V1 (`KVConnectorBase_V1`): whole-prompt KV to and
                     from the FS store in the V0 format; found by name through
                     connectors.plugin, or with "kv_connector_module_path":
                     "connectors.v1.fs_connector"
    transfer.py      what is loaded and saved, without vLLM: the identity of KV-only
                     entries (no hidden state) and the V0 entries a V1 reader also
                     accepts, verifying an entry before promising its tokens, the
                     per-step plan the scheduler hands the workers
    kv_layout.py     gather/scatter adapters for V1's paged caches (torch only, no
                     vLLM): the CPU backend's pages (probed from its own kernel), the
                     [blocks, heads, N, 2*head_size] channel split, the earlier
                     [2, blocks, N, heads, head_size] flash layout
    background.py    the worker's loads and saves off the forward path (vLLM's async
                     contract: get_finished, failed blocks, blocks held for saves),
                     each store call with a deadline (connectors.store.deadline)

May import: torch, vLLM (fs_connector.py only), `connectors.store`, `connectors.config`,
`connectors.layout` (the KVLayout base and the flash layout), `connectors.logs`,
`connectors.log_lines` and `connectors.served_model` (the `model` key rule shared with
V0). Never `connectors.v0`. Loaded only inside vLLM V1 processes (through `connectors.plugin`).
"""
