"""Gather KV from, and scatter KV into, vLLM V0's paged caches.

The store keeps KV token-major as ``[kv_parts, tokens, kv_heads, head_size]``
per layer, whatever the paged layout; one adapter per V0 cache layout
translates slots (``block * block_size + offset``) to and from it. Shapes come
from each backend's ``get_kv_cache_shape`` in vLLM 0.9.2:

    PagedAttention (TORCH_SDPA and IPEX on CPU,      [2, blocks, block_size * heads * head_size]
      XFORMERS, ROCM_FLASH, BLOCK_SPARSE_FLASH_ATTN)
        key view   [blocks, heads, head_size // x, block_size, x], x = 16 // element_size
        value view [blocks, heads, head_size, block_size]
    FLASH_ATTN, DUAL_CHUNK_FLASH_ATTN                [2, blocks, block_size, heads, head_size]
    FLASHINFER                                       [blocks, 2, block_size, heads, head_size]
    MLA backends (TRITON_MLA, FLASHMLA, CPU_MLA, ..) [blocks, block_size, head_size] (one latent)

The adapter is chosen by the attention backend's name (what its
``get_name()`` returns, e.g. ``FLASH_ATTN``); the shape only confirms it.
Shape alone is ambiguous: a FlashAttention cache with 2 blocks,
``[2, 2, bs, heads, d]``, is also a valid FlashInfer cache.

Imports torch only (no vLLM): `kvctl.bench.layout` runs these adapters too.
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
    blocks_dim = 1  # where num_blocks sits in the cache shape

    def __init__(self, geometry: CacheGeometry):
        self.g = geometry

    @classmethod
    def cache_shape(cls, num_blocks: int | str, g: CacheGeometry) -> tuple[int | str, ...]:
        """The cache shape this layout's backends allocate (their ``get_kv_cache_shape``).

        A string `num_blocks` names the dimension in error messages.
        """
        raise NotImplementedError

    @classmethod
    def fits(cls, cache: torch.Tensor, g: CacheGeometry) -> bool:
        s = tuple(cache.shape)
        return len(s) > cls.blocks_dim and s == cls.cache_shape(s[cls.blocks_dim], g)

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

    @classmethod
    def cache_shape(cls, num_blocks, g):
        return (2, num_blocks, g.block_size * g.kv_heads * g.head_size)

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

    @classmethod
    def cache_shape(cls, num_blocks, g):
        return (2, num_blocks, g.block_size, g.kv_heads, g.head_size)

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
    blocks_dim = 0

    @classmethod
    def cache_shape(cls, num_blocks, g):
        return (num_blocks, 2, g.block_size, g.kv_heads, g.head_size)

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
    blocks_dim = 0

    @classmethod
    def cache_shape(cls, num_blocks, g):
        return (num_blocks, g.block_size, g.head_size)  # vLLM assumes kv_heads == 1

    def gather(self, cache, slots, out=None):
        flat = _bits(cache).view(-1, cache.shape[-1])
        if out is None:
            return flat.index_select(0, slots).view(cache.dtype).view(1, -1, 1, cache.shape[-1])
        torch.index_select(flat, 0, slots, out=_bits(out).view(-1, cache.shape[-1]))
        return out

    def scatter(self, cache, slots, kv):
        flat = _bits(cache).view(-1, cache.shape[-1])
        flat.index_copy_(0, slots, _bits(kv).reshape(-1, cache.shape[-1]))


# Backend name (AttentionBackend.get_name() in vLLM 0.9.2) -> adapter, from each
# backend's get_kv_cache_shape. V1 names end in _VLLM_V1 and share the V0 layout.
BACKEND_LAYOUTS: dict[str, type[KVLayout]] = {
    "TORCH_SDPA": PagedAttentionLayout,
    "IPEX": PagedAttentionLayout,
    "XFORMERS": PagedAttentionLayout,
    "ROCM_FLASH": PagedAttentionLayout,
    "BLOCK_SPARSE_FLASH_ATTN": PagedAttentionLayout,
    "FLASH_ATTN": FlashAttentionLayout,
    "DUAL_CHUNK_FLASH_ATTN": FlashAttentionLayout,
    "FLASHINFER": FlashInferLayout,
    "TRITON_MLA": MLALayout,
    "FLASHMLA": MLALayout,
    "ROCM_AITER_MLA": MLALayout,
    "CUTLASS_MLA": MLALayout,
    "CPU_MLA": MLALayout,
}


def layout_for_backend(backend: str) -> type[KVLayout]:
    """The adapter class for attention backend `backend` (its ``get_name()``).

    Raises UnsupportedLayout naming the backend when no adapter reads its cache.
    """
    cls = BACKEND_LAYOUTS.get(backend.upper().removesuffix("_VLLM_V1"))
    if cls is None:
        raise UnsupportedLayout(
            f"no KV layout adapter for attention backend {backend!r}; "
            f"supported backends: {', '.join(BACKEND_LAYOUTS)}")
    return cls


def select_layout(cache: torch.Tensor, geometry: CacheGeometry, backend: str) -> KVLayout:
    """The adapter for a layer's cache allocated by attention backend `backend`.

    `backend` is the backend's name (``AttentionBackend.get_name()``); it
    decides the layout, and the cache's shape must then match it.
    Raises UnsupportedLayout for a backend with no adapter (naming it) or a
    shape that does not match the backend's layout.
    """
    cls = layout_for_backend(backend)
    if not cls.fits(cache, geometry):
        raise UnsupportedLayout(
            f"cache shape {list(cache.shape)} does not match the {cls.name} layout of "
            f"attention backend {backend} for {geometry}: expected "
            f"[{', '.join(map(str, cls.cache_shape('num_blocks', geometry)))}]")
    return cls(geometry)
