"""Which vLLM attention backend shaped a worker's KV caches.

A V0 worker's cache engine allocates every layer's cache with the shape its
attention backend's ``get_kv_cache_shape`` gives; the KV layout adapters
(`connectors.v0.kv_layout`) are chosen by that backend's name, since the
shape alone is ambiguous.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.attention.selector import get_attn_backend

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def kv_cache_backend_name(config: "VllmConfig") -> str:
    """The name (``AttentionBackend.get_name()``, e.g. ``TORCH_SDPA``) of the
    backend whose cache layout this worker's KV caches have.

    Asks vLLM's selector with the arguments its cache engines pass
    (vllm/worker/cache_engine.py, CPUCacheEngine in vllm/worker/cpu_worker.py);
    the selector caches its answer per arguments, so this is the class they got.
    Raises what the selector raises (ValueError for an invalid backend).
    """
    model, cache = config.model_config, config.cache_config
    backend = get_attn_backend(model.get_head_size(), model.dtype, cache.cache_dtype,
                               cache.block_size, model.is_attention_free, use_mla=model.use_mla)
    return backend.get_name()
