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

A prompt's slots are whole blocks of its block table and one partial last
block (`SlotPlan`): the adapters move whole blocks as rows with one index
kernel call per layer and part (index_select / index_copy_ over the blocks,
viewed as 16- or 8-byte elements), and only the tail token by token. Flash,
FlashInfer and MLA then run near memcpy speed on the CPU (`kvctl bench
layout`). PagedAttention keeps a block's tokens innermost (the value) or
innermost but one (the key, in 16-byte groups), so every block is a
transpose; the value's is of single elements, which no torch or numpy copy
does near memcpy speed (see `_move_blocks`): that layout needs a kernel of
its own to get there.

What V0 and V1 share (the KVLayout contract, LayerWriter, GatherBuffers, the
blockwise moves and the flash layout) is connectors.layout. Imports torch and
numpy only (no vLLM): `kvctl.bench.layout` runs these adapters too.
"""

from __future__ import annotations

import numpy as np
import torch

# The adapters' contract (connectors.layout), re-exported for V0's callers.
from connectors.layout.base import (  # noqa: F401
    CacheGeometry, GatherBuffers, KVLayout, LayerWriter, UnsupportedLayout, as_bits)
from connectors.layout.blocks import BlockwiseLayout, FlashAttentionLayout, index_out, move_unit, row_pair


class PagedAttentionLayout(BlockwiseLayout):
    """[2, blocks, block_size * heads * head_size]; inside a block, tokens are the
    innermost dimension but one (key) or the innermost (value): moving a token
    is a transpose, at 16 bytes (key) and at one element (value)."""

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
        return as_bits(cache[1]).view(cache.shape[1], g.kv_heads, g.head_size, g.block_size)

    def _token_key(self, t: torch.Tensor, unit: torch.dtype, size: int) -> torch.Tensor:
        # token-major [T, heads, head_size] as [T, heads, head_size // x, 16 // size] of `unit`
        x = 16 // t.element_size()
        return t.view(unit).view(t.shape[0], self.g.kv_heads, self.g.head_size // x, 16 // size)

    def _gather(self, cache, plan, out):
        g = self.g
        unit, size = move_unit(cache[0], out[0])
        key, value = self._key_view(cache, unit, size), self._value_view(cache)
        out_key, out_value = self._token_key(out[0], unit, size), as_bits(out[1])
        full, n = plan.full, plan.blocks.shape[0]
        if n:
            _move_blocks(plan.blocks, key, value, out_key[:full].view(n, g.block_size, *out_key.shape[1:]),
                         out_value[:full].view(n, g.block_size, g.kv_heads, g.head_size), gather=True)
        if plan.tail.shape[0]:
            block, offset = plan.split(g.block_size)
            # Advanced indices on dims 0 and 3 (split by slices) move to the front:
            # key -> [T, heads, head_size // x, 16 // size], value -> [T, heads, head_size].
            index_out(key, [block, None, None, offset], out=out_key[full:])
            index_out(value, [block, None, None, offset], out=out_value[full:])

    def _scatter(self, cache, plan, kv):
        g = self.g
        key = kv[0].contiguous()
        unit, size = move_unit(cache[0], key)
        key_view, value_view = self._key_view(cache, unit, size), self._value_view(cache)
        tok_key, tok_value = self._token_key(key, unit, size), as_bits(kv[1].contiguous())
        full, n = plan.full, plan.blocks.shape[0]
        if n:
            _move_blocks(plan.blocks, key_view, value_view,
                         tok_key[:full].view(n, g.block_size, *tok_key.shape[1:]),
                         tok_value[:full].view(n, g.block_size, g.kv_heads, g.head_size), gather=False)
        if plan.tail.shape[0]:
            block, offset = plan.split(g.block_size)
            key_view[block, :, :, offset] = tok_key[full:]
            value_view[block, :, :, offset] = tok_value[full:]


NUMPY_BLOCK_TRANSPOSE = True  # False: torch's index ops for the value on the CPU too (tests run both)


def _move_blocks(blocks: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tok_key: torch.Tensor,
                 tok_value: torch.Tensor, gather: bool) -> None:
    """Whole blocks between the paged key/value views and token-major rows.

    key [blocks, heads, head_size // x, block_size, k] <-> tok_key [n, block_size, heads, head_size // x, k]
    value [blocks, heads, head_size, block_size]       <-> tok_value [n, block_size, heads, head_size]

    A block's tokens are its innermost dimension but one (key) or the
    innermost (value), so each block is a transpose: of 16-byte groups for
    the key (torch's index kernels do it at about memcpy speed), of single
    elements for the value. For the value on the CPU, numpy's strided copy
    of one block at a time was the fastest found without a kernel of our
    own: gather 2.0x and scatter 3.1x the time of a memcpy of the *whole*
    entry for the value half alone, vs 2.9x and 3.7x with torch's index
    ops (bf16, 8 heads x 128, measured here); even numpy's transpose of a
    whole layer with no index at all takes 1.4x. Elsewhere: torch.
    """
    if gather:
        index_out(key.permute(0, 3, 1, 2, 4), [blocks], out=tok_key)
    else:
        key.permute(0, 3, 1, 2, 4).index_put_((blocks,), tok_key)
    if value.device.type != "cpu" or not NUMPY_BLOCK_TRANSPOSE:
        if gather:
            index_out(value.permute(0, 3, 1, 2), [blocks], out=tok_value)
        else:
            value.permute(0, 3, 1, 2).index_put_((blocks,), tok_value)
        return
    vc, vt = value.numpy(), tok_value.numpy()
    if gather:
        for i, block in enumerate(blocks.tolist()):
            np.copyto(vt[i], vc[block].transpose(2, 0, 1))
    else:
        for i, block in enumerate(blocks.tolist()):
            np.copyto(vc[block], vt[i].transpose(1, 2, 0))


class FlashInferLayout(BlockwiseLayout):
    """[blocks, 2, block_size, heads, head_size]: a block of one part is one contiguous
    row, the two parts of a block side by side."""

    name = "flashinfer"
    blocks_dim = 0

    @classmethod
    def cache_shape(cls, num_blocks, g):
        return (num_blocks, 2, g.block_size, g.kv_heads, g.head_size)

    def _gather(self, cache, plan, out):
        full, n = plan.full, plan.blocks.shape[0]
        for part in range(2):
            if n:
                # cache[:, part] is [blocks, row] with a stride of two rows
                rows, into = row_pair(cache, 2 * cache.shape[0],
                                       out[part, :full], n)
                torch.index_select(rows.view(cache.shape[0], 2, -1)[:, part], 0, plan.blocks, out=into)
        if plan.tail.shape[0]:
            block, offset = plan.split(self.g.block_size)
            # Advanced indices on dims 0 and 2 -> [T, 2, heads, head_size].
            as_bits(out[:, full:]).copy_(as_bits(cache)[block, :, offset].transpose(0, 1))

    def _scatter(self, cache, plan, kv):
        full, n = plan.full, plan.blocks.shape[0]
        kv = kv.contiguous()
        for part in range(2):
            if n:
                rows, values = row_pair(cache, 2 * cache.shape[0], kv[part, :full], n)
                rows.view(cache.shape[0], 2, -1)[:, part].index_copy_(0, plan.blocks, values)
        if plan.tail.shape[0]:
            block, offset = plan.split(self.g.block_size)
            as_bits(cache)[block, :, offset] = as_bits(kv[:, full:]).transpose(0, 1)


class MLALayout(BlockwiseLayout):
    """[blocks, block_size, head_size]: one latent per token, a block is one contiguous row."""

    name = "mla"
    kv_parts = 1
    blocks_dim = 0

    @classmethod
    def cache_shape(cls, num_blocks, g):
        return (num_blocks, g.block_size, g.head_size)  # vLLM assumes kv_heads == 1

    def _gather(self, cache, plan, out):
        self._move(cache, plan, out[0], gather=True)

    def _scatter(self, cache, plan, kv):
        self._move(cache, plan, kv[0].contiguous(), gather=False)

    def _move(self, cache, plan, tokens, gather: bool):
        full, n, tail = plan.full, plan.blocks.shape[0], plan.tail.shape[0]
        for index, count, cache_rows, part in ((plan.blocks, n, cache.shape[0], tokens[:full]),
                                               (plan.tail, tail, cache.shape[0] * self.g.block_size,
                                                tokens[full:])):
            if not count:
                continue
            rows, token_rows = row_pair(cache, cache_rows, part, count)
            if gather:
                torch.index_select(rows, 0, index, out=token_rows)
            else:
                rows.index_copy_(0, index, token_rows)


class SharedGathers:
    """One send step's gathered KV, shared by the FSConnector children of a MultiConnectorV0.

    Every FS child stores the same token-major KV of a request; the first
    that needs it gathers it from the paged cache, the others get that
    tensor (sends only read it). Keyed by the layout and geometry, the
    caches and the slots' values, so a child that sends another input (the
    transfer child's pre-recv prompt) gathers its own. Tensors are kept
    until `start_step` (the multi connector calls it before each send), in
    buffers reused from step to step; a child that is not an FSConnector
    gets the paged caches as always.
    """

    def __init__(self):
        self._buffers = GatherBuffers()
        self._kv: dict[tuple, torch.Tensor] = {}
        self.gathers = 0  # gathers done since the last start_step (tests read it)

    def start_step(self) -> None:
        self._kv.clear()
        self._buffers.start_step()
        self.gathers = 0

    def abandon(self) -> None:
        """GatherBuffers.abandon for this step's tensors (a child's save was given up on)."""
        self._kv.clear()
        self._buffers.abandon()

    def gather(self, layout: KVLayout, kv_caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        first = kv_caches[0]
        key = (type(layout), layout.g, len(kv_caches), first.data_ptr(), first.dtype, first.device,
               tuple(slots.tolist()))
        kv = self._kv.get(key)
        if kv is None:
            shape = layout.layers_shape(len(kv_caches), slots.shape[0])
            kv = layout.gather_layers(kv_caches, slots, out=self._buffers.take(shape, first))
            self._kv[key] = kv
            self.gathers += 1
        return kv


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
