"""Gather KV from, and scatter KV into, vLLM V0's paged caches.

The store keeps KV token-major as ``[kv_parts, tokens, kv_heads, head_size]``
per layer, whatever the paged layout; one adapter per V0 cache layout
translates slots (``block * block_size + offset``) to and from it. Shapes come
from each backend's ``get_kv_cache_shape`` in vLLM 0.9.2:

    PagedAttention (CPU TORCH_SDPA, XFORMERS, ROCM)  [2, blocks, block_size * heads * head_size]
        key view   [blocks, heads, head_size // x, block_size, x], x = 16 // element_size
        value view [blocks, heads, head_size, block_size]
    FLASH_ATTN                                       [2, blocks, block_size, heads, head_size]
    FLASHINFER                                       [blocks, 2, block_size, heads, head_size]
    MLA backends                                     [blocks, block_size, head_size] (one latent)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class UnsupportedLayout(ValueError):
    pass


@dataclass(frozen=True)
class CacheGeometry:
    block_size: int
    kv_heads: int
    head_size: int


class KVLayout:
    """Translate between one layer's paged cache and token-major KV."""

    name = "abstract"
    kv_parts = 2

    def __init__(self, geometry: CacheGeometry):
        self.g = geometry

    def gather(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """KV of `slots` as a new [kv_parts, tokens, heads, head_size] tensor."""
        raise NotImplementedError

    def scatter(self, cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write [kv_parts, tokens, heads, head_size] `kv` into `slots` of `cache`."""
        raise NotImplementedError


class PagedAttentionLayout(KVLayout):
    name = "paged_attention"

    def _views(self, cache: torch.Tensor):
        g = self.g
        x = 16 // cache.element_size()
        blocks = cache.shape[1]
        key = cache[0].view(blocks, g.kv_heads, g.head_size // x, g.block_size, x)
        value = cache[1].view(blocks, g.kv_heads, g.head_size, g.block_size)
        return key, value, x

    def gather(self, cache, slots):
        key, value, x = self._views(cache)
        block, offset = slots // self.g.block_size, slots % self.g.block_size
        # Advanced indices on dims 0 and 3 (split by slices) move to the front:
        # key -> [T, heads, head_size // x, x], value -> [T, heads, head_size].
        k = key[block, :, :, offset, :].reshape(-1, self.g.kv_heads, self.g.head_size)
        v = value[block, :, :, offset]
        return torch.stack((k, v))

    def scatter(self, cache, slots, kv):
        key, value, x = self._views(cache)
        block, offset = slots // self.g.block_size, slots % self.g.block_size
        tokens = slots.shape[0]
        key[block, :, :, offset, :] = kv[0].reshape(tokens, self.g.kv_heads, self.g.head_size // x, x)
        value[block, :, :, offset] = kv[1]


class FlashAttentionLayout(KVLayout):
    name = "flash_attn"

    def _flat(self, cache):
        return cache.view(2, -1, self.g.kv_heads, self.g.head_size)

    def gather(self, cache, slots):
        return self._flat(cache).index_select(1, slots)

    def scatter(self, cache, slots, kv):
        self._flat(cache).index_copy_(1, slots, kv)


class FlashInferLayout(KVLayout):
    name = "flashinfer"

    def gather(self, cache, slots):
        block, offset = slots // self.g.block_size, slots % self.g.block_size
        # Advanced indices on dims 0 and 2 -> [T, 2, heads, head_size].
        return cache[block, :, offset].transpose(0, 1).contiguous()

    def scatter(self, cache, slots, kv):
        block, offset = slots // self.g.block_size, slots % self.g.block_size
        cache[block, :, offset] = kv.transpose(0, 1)


class MLALayout(KVLayout):
    name = "mla"
    kv_parts = 1

    def gather(self, cache, slots):
        flat = cache.view(-1, cache.shape[-1])
        return flat.index_select(0, slots).view(1, -1, 1, cache.shape[-1])

    def scatter(self, cache, slots, kv):
        flat = cache.view(-1, cache.shape[-1])
        flat.index_copy_(0, slots, kv.view(-1, cache.shape[-1]))


_BY_BACKEND = {
    "TORCH_SDPA": PagedAttentionLayout,
    "XFORMERS": PagedAttentionLayout,
    "ROCM_FLASH": PagedAttentionLayout,
    "FLASH_ATTN": FlashAttentionLayout,
    "FLASHINFER": FlashInferLayout,
    "TRITON_MLA": MLALayout,
    "FLASHMLA": MLALayout,
    "ROCM_AITER_MLA": MLALayout,
    "CUTLASS_MLA": MLALayout,
}


def select_layout(cache: torch.Tensor, geometry: CacheGeometry, backend: str | None = None) -> KVLayout:
    """The adapter for a layer's cache: by backend name, else by shape.

    Raises UnsupportedLayout when the shape fits no known layout.
    """
    cls = _BY_BACKEND.get((backend or "").upper().removesuffix("_VLLM_V1"))
    if cls is None:
        cls = _layout_from_shape(cache, geometry)
    _check_shape(cls, cache, geometry)
    return cls(geometry)


def _layout_from_shape(cache: torch.Tensor, g: CacheGeometry) -> type[KVLayout]:
    s = tuple(cache.shape)
    if len(s) == 3 and s[0] == 2 and s[2] == g.block_size * g.kv_heads * g.head_size:
        return PagedAttentionLayout
    if len(s) == 5 and s[0] == 2 and s[2:] == (g.block_size, g.kv_heads, g.head_size):
        return FlashAttentionLayout
    if len(s) == 5 and s[1] == 2 and s[2:] == (g.block_size, g.kv_heads, g.head_size):
        return FlashInferLayout
    if len(s) == 3 and s[1:] == (g.block_size, g.head_size):
        return MLALayout
    raise UnsupportedLayout(f"no KV layout adapter for cache shape {list(s)} with {g}")


def _check_shape(cls: type[KVLayout], cache: torch.Tensor, g: CacheGeometry) -> None:
    try:
        found = _layout_from_shape(cache, g)
    except UnsupportedLayout:
        found = None
    if found is not cls:
        raise UnsupportedLayout(
            f"cache shape {list(cache.shape)} does not match the {cls.name} layout for {g}")
