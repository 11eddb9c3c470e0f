"""The FS store: one safetensors entry per (prompt, TP rank).

    format.py    the on-disk format, keys, atomic publish, reading and checking entries,
                 and the one rule for what a name in a store is (entry, temp, lock, foreign)
                 and what may be deleted. Standard library + xxhash only: kvctl reads
                 stores without torch.
    eviction.py  bounded stores: the store lock, LRU eviction (imports format)
    model_identity.py  the weights' identity in keys: Hugging Face snapshot commit or a
                 cached xxh3-128 content fingerprint (standard library + xxhash; kvctl may use it)
    fs_store.py  the torch side used by the connectors: save and load tensors (imports both)

May import: `connectors.logs`, `connectors.log_lines`, the standard library, xxhash, torch
(fs_store.py only). Nothing else of connectors; never vLLM or kvctl.
"""
