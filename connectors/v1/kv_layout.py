"""Gather KV from, and scatter KV into, vLLM V1's paged caches (token-major in the store).

The store keeps KV token-major, ``[kv_parts, tokens, kv_heads, head_size]`` per
layer, whatever the paged layout. A slot is ``block_id * block_size + offset``
in the KV cache manager's blocks (what the scheduler hands out), so the same
rows land in the right place whatever block size P and D use.

What `register_kv_caches` receives, per layer (vLLM 0.32, RFC #42082: one
logical view ``[blocks, kv_heads, block_tokens, channels]`` for every
backend, physical order given by strides):

    CPU_ATTN                  [B, H, N, 2 * head_size], each (block, head) page is
                              N * 2 * head_size contiguous elements: K in the first
                              half, V in the second, arranged inside each half as the
                              kernel's ISA wants. "vec" (fp32, fp16, bf16 without AMX):
                              K transposed [head_size, N], V [N, head_size].
                              -> PagedCPULayout, positions probed from the kernel
    FLASH_ATTN, TRITON_ATTN,  [B, H, N, 2 * head_size], token n of head h in block b
    FLEX_ATTENTION            is [b, h, n, :head_size] (K) and [b, h, n, head_size:] (V)
                              -> SplitChannelLayout
    earlier V1 FLASH_ATTN     [2, B, N, H, head_size] (V1 releases before the standard view)
                              -> connectors.layout.blocks.FlashAttentionLayout (same slots)

``N`` is the kernel block size: a backend that needs smaller blocks than the
manager's sees each manager block as ``block_size // N`` consecutive kernel
blocks, so a manager slot ``s`` is kernel block ``s // N``, offset ``s % N``.
Every adapter here addresses its cache that way, with its geometry's
``block_size`` set to the view's ``N``.

Imports torch and numpy only (no vLLM): the CPU kernel is passed in as a function
(`probe_page_positions`), so tests run on plain CPU tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from connectors.layout.base import CacheGeometry, KVLayout, UnsupportedLayout, as_bits
from connectors.layout.blocks import FlashAttentionLayout

# A write of token-major key/value [T, heads, head_size] into `slots` of a
# [blocks, heads, N, 2 * head_size] cache, as the attention backend does it.
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

PROBE_BASE = 64  # probe values are 1..PROBE_BASE: exact in fp32, fp16 and bf16


def _block_offset(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return slots // block_size, slots % block_size


class SplitChannelLayout(KVLayout):
    """[blocks, heads, N, 2 * head_size]: K and V of a token side by side in its channels."""

    name = "split_channel"
    blocks_dim = 0

    @classmethod
    def cache_shape(cls, num_blocks, g):
        return (num_blocks, g.kv_heads, g.block_size, 2 * g.head_size)

    def gather(self, cache, slots, out=None):
        block, offset = _block_offset(slots, self.g.block_size)
        out = self._new_out(cache, slots.shape[0]) if out is None else out
        d = self.g.head_size
        rows = as_bits(cache)[block, :, offset]  # advanced dims 0 and 2 -> [T, heads, 2 * head_size]
        as_bits(out[0]).copy_(rows[..., :d])
        as_bits(out[1]).copy_(rows[..., d:])
        return out

    def scatter(self, cache, slots, kv):
        block, offset = _block_offset(slots, self.g.block_size)
        d = self.g.head_size
        bits = as_bits(cache)
        bits[block, :, offset, :d] = as_bits(kv[0].to(cache.dtype))
        bits[block, :, offset, d:] = as_bits(kv[1].to(cache.dtype))


class PagedCPULayout(KVLayout):
    """[blocks, heads, N, 2 * head_size] where each (block, head) page is laid out by the CPU kernel.

    `key_pos[n, d]` and `value_pos[n, d]` are where token offset n, channel d
    of K and of V sit inside one page of N * 2 * head_size elements.
    """

    name = "paged_cpu"
    blocks_dim = 0

    def __init__(self, geometry: CacheGeometry, key_pos: torch.Tensor, value_pos: torch.Tensor):
        super().__init__(geometry)
        shape = (geometry.block_size, geometry.head_size)
        if tuple(key_pos.shape) != shape or tuple(value_pos.shape) != shape:
            raise UnsupportedLayout(f"page positions have shapes {list(key_pos.shape)} and "
                                    f"{list(value_pos.shape)}, want {list(shape)}")
        both = torch.cat([key_pos.reshape(-1), value_pos.reshape(-1)])
        page = 2 * geometry.block_size * geometry.head_size
        if both.min() < 0 or both.max() >= page or torch.unique(both).numel() != both.numel():
            raise UnsupportedLayout("page positions are not a permutation of the page's elements")
        self.key_pos = key_pos.to(torch.int64)
        self.value_pos = value_pos.to(torch.int64)

    @classmethod
    def cache_shape(cls, num_blocks, g):
        return (num_blocks, g.kv_heads, g.block_size, 2 * g.head_size)

    @classmethod
    def vec(cls, geometry: CacheGeometry) -> "PagedCPULayout":
        """The "vec" kernel's page (fp32; fp16/bf16 without AMX): K as [head_size, N], then V as [N, head_size]."""
        n, d = geometry.block_size, geometry.head_size
        tok = torch.arange(n).unsqueeze(1)
        ch = torch.arange(d).unsqueeze(0)
        return cls(geometry, ch * n + tok, n * d + tok * d + ch)

    def _pages(self, cache: torch.Tensor) -> torch.Tensor:
        g = self.g
        page = 2 * g.block_size * g.head_size
        if cache.stride(3) != 1 or cache.stride(2) != 2 * g.head_size:
            raise UnsupportedLayout(f"CPU cache pages are not contiguous (strides {list(cache.stride())})")
        return as_bits(cache).as_strided((cache.shape[0], g.kv_heads, page),
                                       (cache.stride(0), cache.stride(1), 1))

    def _index(self, slots: torch.Tensor, pos: torch.Tensor):
        block, offset = _block_offset(slots, self.g.block_size)
        pos = pos.to(slots.device)
        heads = torch.arange(self.g.kv_heads, device=slots.device)
        # [T, 1, 1], [1, heads, 1], [T, 1, head_size] -> [T, heads, head_size]
        return block[:, None, None], heads[None, :, None], pos[offset][:, None, :]

    def gather(self, cache, slots, out=None):
        out = self._new_out(cache, slots.shape[0]) if out is None else out
        pages = self._pages(cache)
        as_bits(out[0]).copy_(pages[self._index(slots, self.key_pos)])
        as_bits(out[1]).copy_(pages[self._index(slots, self.value_pos)])
        return out

    def scatter(self, cache, slots, kv):
        pages = self._pages(cache)
        pages[self._index(slots, self.key_pos)] = as_bits(kv[0].to(cache.dtype))
        pages[self._index(slots, self.value_pos)] = as_bits(kv[1].to(cache.dtype))

    def plan(self, slots):
        return PagePlan(slots.reshape(-1).to("cpu", torch.int64))

    def scatter_plan(self, cache, plan, kv):
        """`scatter` through the plan's element indices: one index assignment per layer and part.

        (Four times faster than `scatter`, whose three broadcast indices are
        worked out again for every layer and cost more than the data they move.)
        """
        self._pages(cache)  # checks the page strides
        kv = kv.to(cache.device, cache.dtype)
        storage, indices = self._elements(cache, plan)
        for part, index in zip(kv, indices):
            storage[index] = as_bits(part).reshape(-1).numpy()

    def gather_layers(self, caches, slots, out=None):
        """`gather` of every layer through one plan (the element indices are worked out once,
        as for `scatter_plan`), each part taken straight into its slice of `out`."""
        if out is None:
            out = caches[0].new_empty(self.layers_shape(len(caches), slots.shape[0]))
        if caches[0].device.type != "cpu" or not out.is_contiguous():
            return super().gather_layers(caches, slots, out)
        plan = self.plan(slots)
        for cache, layer_out in zip(caches, out):
            self._pages(cache)  # checks the page strides
            storage, indices = self._elements(cache, plan)
            for part, index in zip(layer_out, indices):
                np.take(storage, index, out=as_bits(part).reshape(-1).numpy())
        return out

    def _elements(self, cache: torch.Tensor, plan: "PagePlan") -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """The cache's elements as one flat array, and where `plan`'s K and V elements are in it."""
        g = self.g
        strides = (cache.stride(0), cache.stride(1))
        indices = plan.elements.get(strides)
        if indices is None:
            block, offset = _block_offset(plan.slots, g.block_size)
            page_start = block[:, None, None] * strides[0] + torch.arange(g.kv_heads)[None, :, None] * strides[1]
            indices = tuple((page_start + pos[offset][:, None, :]).reshape(-1).numpy()
                            for pos in (self.key_pos, self.value_pos))
            plan.elements[strides] = indices
        span = (cache.shape[0] - 1) * strides[0] + (g.kv_heads - 1) * strides[1] + 2 * g.block_size * g.head_size
        return as_bits(cache).as_strided((span,), (1,)).numpy(), indices


@dataclass
class PagePlan:
    """`PagedCPULayout.plan`: a request's slots, and their K and V elements' places in a cache
    (flat element indices, [tokens * heads * head_size] each), per cache strides, worked out once
    for every layer."""

    slots: torch.Tensor
    elements: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def probe_page_positions(write: CacheWriter, geometry: CacheGeometry,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the backend's own `write` puts each token's K and V inside a page.

    Writes one block of coded tokens (values 1..PROBE_BASE, one base-64 digit
    of each element's (token, head, channel) number per pass) into a scratch
    cache and reads the numbers back, so no kernel layout is assumed. Returns
    (key_pos, value_pos), each [N, head_size]. Raises UnsupportedLayout when
    the kernel writes anything but a per-(block, head) permutation.
    """
    g = geometry
    n, h, d = g.block_size, g.kv_heads, g.head_size
    count = n * h * d
    passes = max(1, math.ceil(math.log(count, PROBE_BASE)))
    number = torch.arange(count).view(n, h, d)
    slots = torch.arange(n)
    found = {}
    for part in ("key", "value"):
        decoded = torch.zeros(h, 2 * n * d, dtype=torch.int64)
        written = torch.zeros(h, 2 * n * d, dtype=torch.bool)
        for p in range(passes):
            digit = (number // PROBE_BASE ** p) % PROBE_BASE
            coded = (digit + 1).to(dtype)
            zeros = torch.zeros_like(coded)
            cache = torch.zeros((1, h, n, 2 * d), dtype=dtype)
            write(coded if part == "key" else zeros, coded if part == "value" else zeros, cache, slots)
            page = cache.view(h, 2 * n * d).to(torch.float32)
            hit = page != 0
            if p == 0:
                written = hit
            elif not torch.equal(hit, written):
                raise UnsupportedLayout(f"the cache kernel writes {part} elements to different places per pass")
            decoded += (page.clamp(min=1).to(torch.int64) - 1) * PROBE_BASE ** p
        if int(written.sum()) != count:
            raise UnsupportedLayout(f"the cache kernel wrote {int(written.sum())} {part} elements, "
                                    f"expected {count}")
        pos = torch.full((n, h, d), -1, dtype=torch.int64)
        head_of, where = written.nonzero(as_tuple=True)
        codes = decoded[head_of, where]
        tok, head, ch = codes // (h * d), (codes // d) % h, codes % d
        if not torch.equal(head, head_of):
            raise UnsupportedLayout(f"the cache kernel writes {part} of one head into another head's page")
        pos[tok, head, ch] = where
        if (pos < 0).any() or not all(torch.equal(pos[:, i], pos[:, 0]) for i in range(h)):
            raise UnsupportedLayout(f"the cache kernel lays out {part} differently per head")
        found[part] = pos[:, 0]
    return found["key"], found["value"]


# Attention backend (its get_name()) -> how its V1 cache is read, for the
# standard [blocks, heads, N, channels] view. A 5-D [2, B, N, H, D] cache is
# the earlier V1 flash layout, whatever the backend's name.
CPU_BACKENDS = ("CPU_ATTN",)
SPLIT_CHANNEL_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION")


def select_layout(cache: torch.Tensor, backend: str, *, kv_heads: int, head_size: int,
                  cpu_writer: CacheWriter | None = None) -> KVLayout:
    """The adapter for one layer's V1 cache allocated by attention backend `backend`.

    `cpu_writer` is the CPU backend's own cache write (needed for CPU_ATTN:
    its page layout is probed from it). Raises UnsupportedLayout naming the
    backend and the shape when nothing here reads that cache.
    """
    shape = tuple(cache.shape)
    if len(shape) == 5 and shape[0] == 2:
        g = CacheGeometry(block_size=shape[2], kv_heads=kv_heads, head_size=head_size)
        if FlashAttentionLayout.fits(cache, g):
            return FlashAttentionLayout(g)
    if len(shape) == 4:
        g = CacheGeometry(block_size=shape[2], kv_heads=kv_heads, head_size=head_size)
        name = backend.upper()
        if shape[1:] == (kv_heads, shape[2], 2 * head_size):
            if name in CPU_BACKENDS:
                if cpu_writer is None:
                    raise UnsupportedLayout(f"{backend}: the CPU page layout needs the kernel's cache writer")
                return PagedCPULayout(g, *probe_page_positions(cpu_writer, g, cache.dtype))
            if name in SPLIT_CHANNEL_BACKENDS:
                return SplitChannelLayout(g)
    raise UnsupportedLayout(
        f"no KV layout adapter for attention backend {backend!r} with cache shape {list(shape)} "
        f"(kv_heads {kv_heads}, head_size {head_size}); supported: {', '.join(CPU_BACKENDS)} "
        f"[blocks, heads, N, 2*head_size] pages, {', '.join(SPLIT_CHANNEL_BACKENDS)} "
        f"[blocks, heads, N, 2*head_size] channels, and [2, blocks, N, heads, head_size]")


def ordered_layers(kv_caches: Mapping[str, torch.Tensor],
                   layer_index: Callable[[str], int]) -> list[tuple[str, torch.Tensor]]:
    """The caches in model layer order (entries store layer i at index i).

    Raises ValueError when two names give one index or the indices are not 0..n-1.
    """
    indexed = sorted((layer_index(name), name) for name in kv_caches)
    indices = [i for i, _ in indexed]
    if indices != list(range(len(indexed))):
        raise ValueError(f"KV cache layers have indices {indices}, expected 0..{len(indexed) - 1}")
    return [(name, kv_caches[name]) for _, name in indexed]
