"""KV layout adapters' common ground, for V0 and V1 alike (torch only, no vLLM).

    base.py    the KVLayout contract, CacheGeometry, UnsupportedLayout, LayerWriter
               (FSStore.load_into's write_layer), GatherBuffers, as_bits
    blocks.py  SlotPlan and BlockwiseLayout (whole blocks moved as rows), and the
               [2, blocks, block_size, heads, head_size] FlashAttentionLayout that
               V0's FLASH_ATTN and earlier V1 releases both allocate

The engine-specific adapters build on this: connectors.v0.kv_layout (V0's
backends) and connectors.v1.kv_layout (V1's paged views); neither imports the other.

May import: torch. Nothing else of connectors; never vLLM or kvctl.
"""
