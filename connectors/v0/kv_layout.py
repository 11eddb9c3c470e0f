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

    def gather(self, cache: torch.Tensor, slots: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """KV of `slots` as [kv_parts, tokens, heads, head_size].

        Written into `out` (contiguous, that shape, the cache's dtype and
        device) when given, so a caller gathering every layer fills one
        tensor instead of stacking per-layer copies. Returns `out` or a new tensor.
        """
        raise NotImplementedError

    def scatter(self, cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write [kv_parts, tokens, heads, head_size] `kv` into `slots` of `cache`."""
        raise NotImplementedError

    def gather_layers(self, caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """Every layer's KV of `slots` as one [layers, kv_parts, tokens, heads, head_size]
        tensor, each layer gathered straight into its slice."""
        out = caches[0].new_empty((len(caches), self.kv_parts, slots.shape[0],
                                   self.g.kv_heads, self.g.head_size))
        for layer, cache in enumerate(caches):
            self.gather(cache, slots, out=out[layer])
        return out

    def scatter_layers(self, caches: list[torch.Tensor], slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write [layers, kv_parts, tokens, heads, head_size] `kv` into `slots` of every layer."""
        for cache, layer_kv in zip(caches, kv):
            self.scatter(cache, slots, layer_kv.to(cache.dtype))

    def _new_out(self, cache: torch.Tensor, tokens: int) -> torch.Tensor:
        return cache.new_empty((self.kv_parts, tokens, self.g.kv_heads, self.g.head_size))


# Gather and scatter only move bytes, so they work on views that reinterpret
# them: integers of the element's size (bit exact, and index kernels exist
# for them on every device, unlike float8 on CPU), and for the paged key's
# 16-byte groups the widest element the tensors' alignment allows (complex128,
# else int64), which the element-wise index kernels move in 1/x (1/(x/2)) as
# many steps. aten's index with `out` writes the gathered rows straight into
# the caller's tensor.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WIDE = ((torch.complex128, 16), (torch.int64, 8))
_index_out = torch.ops.aten.index.Tensor_out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _move_unit(*tensors: torch.Tensor) -> tuple[torch.dtype, int]:
    """The widest element every tensor's start is aligned to (a view needs it).

    A loaded entry's KV starts right after its int64 token ids, so with an
    odd token count it is 8- but not 16-byte aligned.
    """
    for dtype, size in _WIDE:
        if all(t.storage_offset() * t.element_size() % size == 0 for t in tensors):
            return dtype, size
    es = tensors[0].element_size()
    return _BITS[es], es


class PagedAttentionLayout(KVLayout):
    name = "paged_attention"

    def _key_view(self, cache: torch.Tensor, unit: torch.dtype, size: int) -> torch.Tensor:
        # [blocks, heads, head_size // x, block_size, x]: a (token, head, head_size // x)
        # group is 16 contiguous bytes, 16 // size elements of `unit`.
        g = self.g
        x = 16 // cache.element_size()
        return cache[0].view(unit).view(cache.shape[1], g.kv_heads, g.head_size // x, g.block_size,
                                        16 // size)

    def _value_view(self, cache: torch.Tensor) -> torch.Tensor:
        g = self.g
        return _bits(cache[1]).view(cache.shape[1], g.kv_heads, g.head_size, g.block_size)

    def _token_key(self, t: torch.Tensor, unit: torch.dtype, size: int) -> torch.Tensor:
        # token-major [T, heads, head_size] as [T, heads, head_size // x, 16 // size] of `unit`
        x = 16 // t.element_size()
        return t.view(unit).view(t.shape[0], self.g.kv_heads, self.g.head_size // x, 16 // size)

    def gather(self, cache, slots, out=None):
        block, offset = slots // self.g.block_size, slots % self.g.block_size
        out = self._new_out(cache, slots.shape[0]) if out is None else out
        unit, size = _move_unit(cache[0], out[0])
        # Advanced indices on dims 0 and 3 (split by slices) move to the front:
        # key -> [T, heads, head_size // x, 16 // size], value -> [T, heads, head_size].
        _index_out(self._key_view(cache, unit, size), [block, None, None, offset],
                   out=self._token_key(out[0], unit, size))
        _index_out(self._value_view(cache), [block, None, None, offset], out=_bits(out[1]))
        return out

    def scatter(self, cache, slots, kv):
        block, offset = slots // self.g.block_size, slots % self.g.block_size
        key = kv[0].contiguous()
        unit, size = _move_unit(cache[0], key)
        self._key_view(cache, unit, size)[block, :, :, offset] = self._token_key(key, unit, size)
        self._value_view(cache)[block, :, :, offset] = _bits(kv[1])


class FlashAttentionLayout(KVLayout):
    name = "flash_attn"

    def _flat(self, cache):
        return _bits(cache).view(2, -1, self.g.kv_heads, self.g.head_size)

    def gather(self, cache, slots, out=None):
        out = self._new_out(cache, slots.shape[0]) if out is None else out
        torch.index_select(self._flat(cache), 1, slots, out=_bits(out))
        return out

    def scatter(self, cache, slots, kv):
        self._flat(cache).index_copy_(1, slots, _bits(kv))


class FlashInferLayout(KVLayout):
    name = "flashinfer"

    def gather(self, cache, slots, out=None):
        block, offset = slots // self.g.block_size, slots % self.g.block_size
        # Advanced indices on dims 0 and 2 -> [T, 2, heads, head_size].
        kv = _bits(cache)[block, :, offset].transpose(0, 1)
        if out is None:
            return kv.contiguous().view(cache.dtype)
        _bits(out).copy_(kv)
        return out

    def scatter(self, cache, slots, kv):
        block, offset = slots // self.g.block_size, slots % self.g.block_size
        _bits(cache)[block, :, offset] = _bits(kv).transpose(0, 1)


class MLALayout(KVLayout):
    name = "mla"
    kv_parts = 1

    def gather(self, cache, slots, out=None):
        flat = _bits(cache).view(-1, cache.shape[-1])
        if out is None:
            return flat.index_select(0, slots).view(cache.dtype).view(1, -1, 1, cache.shape[-1])
        torch.index_select(flat, 0, slots, out=_bits(out).view(-1, cache.shape[-1]))
        return out

    def scatter(self, cache, slots, kv):
        flat = _bits(cache).view(-1, cache.shape[-1])
        flat.index_copy_(0, slots, _bits(kv).reshape(-1, cache.shape[-1]))


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
