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

Imports torch and numpy only (no vLLM): `kvctl.bench.layout` runs these adapters too.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
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

    def plan(self, slots: torch.Tensor):
        """What `scatter_plan` takes for `slots` (worked out once for every layer)."""
        return slots

    def scatter_plan(self, cache: torch.Tensor, plan, kv: torch.Tensor) -> None:
        """`scatter` with a `plan(slots)`; `kv` may be on another device or of another dtype."""
        self.scatter(cache, plan, kv.to(cache.device, cache.dtype))

    def layers_shape(self, num_layers: int, tokens: int) -> tuple[int, ...]:
        return (num_layers, self.kv_parts, tokens, self.g.kv_heads, self.g.head_size)

    def gather_layers(self, caches: list[torch.Tensor], slots: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """Every layer's KV of `slots` as one [layers, kv_parts, tokens, heads, head_size]
        tensor (`out` when given, else a new one), each layer gathered straight into its slice."""
        if out is None:
            out = caches[0].new_empty(self.layers_shape(len(caches), slots.shape[0]))
        for layer, cache in enumerate(caches):
            self.gather(cache, slots, out=out[layer])
        return out

    def scatter_layers(self, caches: list[torch.Tensor], slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write [layers, kv_parts, tokens, heads, head_size] `kv` into `slots` of every layer."""
        for cache, layer_kv in zip(caches, kv):
            self.scatter(cache, slots, layer_kv.to(cache.dtype))

    def _new_out(self, cache: torch.Tensor, tokens: int) -> torch.Tensor:
        return cache.new_empty((self.kv_parts, tokens, self.g.kv_heads, self.g.head_size))


class LayerWriter:
    """`FSStore.load_into`'s ``write_layer``: each layer's token-major KV into its paged cache.

    Token positions `positions` of a layer's ``[kv_parts, tokens, heads,
    head_size]`` KV go to `slots` of ``caches[layer]``, through the layout's
    plan of the slots, worked out once for every layer. `seconds` adds up
    the time spent scattering.
    """

    def __init__(self, layout: KVLayout, caches: list[torch.Tensor], slots: torch.Tensor,
                 positions: slice = slice(None)):
        self.layout, self.caches, self.positions = layout, caches, positions
        self.plan = layout.plan(slots)
        self.seconds = 0.0

    def __call__(self, layer: int, kv: torch.Tensor) -> None:
        begin = time.perf_counter()
        self.layout.scatter_plan(self.caches[layer], self.plan, kv[:, self.positions])
        self.seconds += time.perf_counter() - begin


# --- reusable gather outputs: a fresh one faults in 4 KiB at a time ---

GATHER_BUFFER_BYTES = 512 << 20  # at most this much host memory kept for reuse


class GatherBuffers:
    """Reusable host tensors for gather_layers' output, one per request of a step.

    A new multi-MB CPU tensor is a fresh mapping that faults in one 4 KiB
    page at a time on its first write: that made a 128 MB gather about 5x
    slower than copying the same bytes into a tensor written before
    (measured here, 145 vs 28 ms). `take` hands out the i-th buffer of the
    step (kept from earlier steps when big enough); `start_step` makes them
    all free again, so a caller must be done with a step's tensors (saved)
    before the next step starts. At most `max_bytes` are kept, in all;
    anything beyond (and any non-CPU tensor) is allocated fresh.
    """

    def __init__(self, max_bytes: int = GATHER_BUFFER_BYTES):
        self.max_bytes = max_bytes
        self._kept: list[torch.Tensor] = []  # uint8
        self._next = 0

    def start_step(self) -> None:
        self._next = 0

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        nbytes = math.prod(shape) * like.element_size()
        if like.device.type != "cpu":
            return like.new_empty(shape)
        index, self._next = self._next, self._next + 1
        if index < len(self._kept) and self._kept[index].numel() >= nbytes:
            buf = self._kept[index]
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            others = sum(t.numel() for i, t in enumerate(self._kept) if i != index)
            if index <= len(self._kept) and others + nbytes <= self.max_bytes:
                self._kept[index:index + 1] = [buf]
        return buf[:nbytes].view(like.dtype).view(shape)


# Gather and scatter only move bytes, so they work on views that reinterpret
# them: integers of the element's size (bit exact, and index kernels exist
# for them on every device, unlike float8 on CPU), and for whole rows or the
# paged key's 16-byte groups the widest element the tensors' alignment allows
# (complex128, else int64), which the element-wise index kernels move in
# 1/x (1/(x/2)) as many steps. aten's index with `out` writes the gathered
# rows straight into the caller's tensor.
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


def _row_pair(a: torch.Tensor, a_rows: int, b: torch.Tensor,
              b_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous `a` and `b` as [a_rows, row] and [b_rows, row] of one element type:
    the widest (16, 8 bytes) both starts are aligned to and both rows hold whole, else
    the integers of their element size. Index kernels then move a row in few steps."""
    es = a.element_size()
    row_bytes = a.numel() * es // a_rows
    for dtype, size in _WIDE + ((_BITS[es], es),):
        if row_bytes % size == 0 and all(t.storage_offset() * es % size == 0 for t in (a, b)):
            return a.view(a_rows, -1).view(dtype), b.view(b_rows, -1).view(dtype)
    raise AssertionError("unreachable: the element size always fits")


@dataclass(frozen=True)
class SlotPlan:
    """A request's slots split into whole blocks and the rest.

    A prompt's slots are ``block_table[pos // block_size] * block_size +
    pos % block_size``: every block but the last is whole, so the first
    `full` slots move as `blocks` (one row of block_size tokens each) and
    only the `tail` moves token by token. Slots that are not whole blocks
    in order (any other caller's) all go in `tail`.
    """

    slots: torch.Tensor
    blocks: torch.Tensor
    tail: torch.Tensor
    full: int  # slots covered by `blocks`: len(blocks) * block_size

    @classmethod
    def of(cls, slots: torch.Tensor, block_size: int) -> "SlotPlan":
        slots = slots.reshape(-1).to(torch.int64)
        n = slots.shape[0] // block_size
        if n:
            head = slots[: n * block_size].view(n, block_size)
            first = head[:, 0]
            step = torch.arange(block_size, device=slots.device, dtype=slots.dtype)
            if not bool(((first % block_size == 0) & (head == first[:, None] + step).all(1)).all()):
                n = 0
        full = n * block_size
        blocks = slots[:full:block_size] // block_size if n else slots[:0]
        return cls(slots, blocks, slots[full:], full)

    def split(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tail's (block, offset) pairs."""
        return self.tail // block_size, self.tail % block_size


class _BlockwiseLayout(KVLayout):
    """A layout that moves whole blocks as rows: one plan per call, shared by every layer."""

    def gather(self, cache, slots, out=None):
        out = self._new_out(cache, slots.shape[0]) if out is None else out
        self._gather(cache, SlotPlan.of(slots, self.g.block_size), out)
        return out

    def scatter(self, cache, slots, kv):
        self._scatter(cache, SlotPlan.of(slots, self.g.block_size), kv)

    def gather_layers(self, caches, slots, out=None):
        if out is None:
            out = caches[0].new_empty(self.layers_shape(len(caches), slots.shape[0]))
        plan = SlotPlan.of(slots, self.g.block_size)
        for layer, cache in enumerate(caches):
            self._gather(cache, plan, out[layer])
        return out

    def scatter_layers(self, caches, slots, kv):
        plan = SlotPlan.of(slots, self.g.block_size)
        for cache, layer_kv in zip(caches, kv):
            self._scatter(cache, plan, layer_kv.to(cache.dtype))

    def plan(self, slots):
        return SlotPlan.of(slots, self.g.block_size)

    def scatter_plan(self, cache, plan, kv):
        self._scatter(cache, plan, kv.to(cache.device, cache.dtype))

    def _gather(self, cache: torch.Tensor, plan: SlotPlan, out: torch.Tensor) -> None:
        raise NotImplementedError

    def _scatter(self, cache: torch.Tensor, plan: SlotPlan, kv: torch.Tensor) -> None:
        raise NotImplementedError


class PagedAttentionLayout(_BlockwiseLayout):
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
        return _bits(cache[1]).view(cache.shape[1], g.kv_heads, g.head_size, g.block_size)

    def _token_key(self, t: torch.Tensor, unit: torch.dtype, size: int) -> torch.Tensor:
        # token-major [T, heads, head_size] as [T, heads, head_size // x, 16 // size] of `unit`
        x = 16 // t.element_size()
        return t.view(unit).view(t.shape[0], self.g.kv_heads, self.g.head_size // x, 16 // size)

    def _gather(self, cache, plan, out):
        g = self.g
        unit, size = _move_unit(cache[0], out[0])
        key, value = self._key_view(cache, unit, size), self._value_view(cache)
        out_key, out_value = self._token_key(out[0], unit, size), _bits(out[1])
        full, n = plan.full, plan.blocks.shape[0]
        if n:
            _move_blocks(plan.blocks, key, value, out_key[:full].view(n, g.block_size, *out_key.shape[1:]),
                         out_value[:full].view(n, g.block_size, g.kv_heads, g.head_size), gather=True)
        if plan.tail.shape[0]:
            block, offset = plan.split(g.block_size)
            # Advanced indices on dims 0 and 3 (split by slices) move to the front:
            # key -> [T, heads, head_size // x, 16 // size], value -> [T, heads, head_size].
            _index_out(key, [block, None, None, offset], out=out_key[full:])
            _index_out(value, [block, None, None, offset], out=out_value[full:])

    def _scatter(self, cache, plan, kv):
        g = self.g
        key = kv[0].contiguous()
        unit, size = _move_unit(cache[0], key)
        key_view, value_view = self._key_view(cache, unit, size), self._value_view(cache)
        tok_key, tok_value = self._token_key(key, unit, size), _bits(kv[1].contiguous())
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
        _index_out(key.permute(0, 3, 1, 2, 4), [blocks], out=tok_key)
    else:
        key.permute(0, 3, 1, 2, 4).index_put_((blocks,), tok_key)
    if value.device.type != "cpu" or not NUMPY_BLOCK_TRANSPOSE:
        if gather:
            _index_out(value.permute(0, 3, 1, 2), [blocks], out=tok_value)
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


class FlashAttentionLayout(_BlockwiseLayout):
    """[2, blocks, block_size, heads, head_size]: a block of one part is one contiguous row."""

    name = "flash_attn"

    @classmethod
    def cache_shape(cls, num_blocks, g):
        return (2, num_blocks, g.block_size, g.kv_heads, g.head_size)

    def _gather(self, cache, plan, out):
        full, n, tail = plan.full, plan.blocks.shape[0], plan.tail.shape[0]
        bs = self.g.block_size
        for part in range(2):
            src, dst = cache[part], out[part]
            if n:
                rows, into = _row_pair(src, src.shape[0], dst[:full], n)
                torch.index_select(rows, 0, plan.blocks, out=into)
            if tail:
                rows, into = _row_pair(src, src.shape[0] * bs, dst[full:], tail)
                torch.index_select(rows, 0, plan.tail, out=into)

    def _scatter(self, cache, plan, kv):
        full, n, tail = plan.full, plan.blocks.shape[0], plan.tail.shape[0]
        bs = self.g.block_size
        for part in range(2):
            dst, src = cache[part], kv[part].contiguous()
            if n:
                rows, values = _row_pair(dst, dst.shape[0], src[:full], n)
                rows.index_copy_(0, plan.blocks, values)
            if tail:
                rows, values = _row_pair(dst, dst.shape[0] * bs, src[full:], tail)
                rows.index_copy_(0, plan.tail, values)


class FlashInferLayout(_BlockwiseLayout):
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
                rows, into = _row_pair(cache, 2 * cache.shape[0],
                                       out[part, :full], n)
                torch.index_select(rows.view(cache.shape[0], 2, -1)[:, part], 0, plan.blocks, out=into)
        if plan.tail.shape[0]:
            block, offset = plan.split(self.g.block_size)
            # Advanced indices on dims 0 and 2 -> [T, 2, heads, head_size].
            _bits(out[:, full:]).copy_(_bits(cache)[block, :, offset].transpose(0, 1))

    def _scatter(self, cache, plan, kv):
        full, n = plan.full, plan.blocks.shape[0]
        kv = kv.contiguous()
        for part in range(2):
            if n:
                rows, values = _row_pair(cache, 2 * cache.shape[0], kv[part, :full], n)
                rows.view(cache.shape[0], 2, -1)[:, part].index_copy_(0, plan.blocks, values)
        if plan.tail.shape[0]:
            block, offset = plan.split(self.g.block_size)
            _bits(cache)[block, :, offset] = _bits(kv[:, full:]).transpose(0, 1)


class MLALayout(_BlockwiseLayout):
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
            rows, token_rows = _row_pair(cache, cache_rows, part, count)
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
