"""What every KV layout adapter shares, V0's and V1's: the contract and the buffers.

The store keeps KV token-major as ``[kv_parts, tokens, kv_heads, head_size]``
per layer, whatever the paged layout; a KVLayout translates a layer's paged
cache to and from it, addressed by slots (``block * block_size + offset``).

    KVLayout        the adapter contract; gather_layers/scatter_layers over every layer
    CacheGeometry   block size, KV heads, head size of one layer's cache
    LayerWriter     FSStore.load_into's write_layer: token-major KV into the paged caches
    GatherBuffers   reused host tensors for gathered KV (a fresh one faults in slowly)
    as_bits         the same bytes as integers (bit-exact moves on every device)

Imports torch only (no vLLM).
"""

from __future__ import annotations

import math
import time
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

    def abandon(self) -> None:
        """Never hand out the kept buffers again (a save given up on may still be reading one)."""
        self._kept = []
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
# them as integers of the element's size: bit exact, and index kernels exist
# for them on every device (unlike float8 on CPU).
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers of the element's size."""
    return t.view(BITS[t.element_size()])
