"""Layouts that move whole blocks as rows, and the flash layout V0 and V1 share.

A prompt's slots are whole blocks of its block table and one partial last
block (`SlotPlan`): a BlockwiseLayout moves whole blocks as rows with one
index kernel call per layer and part (index_select / index_copy_ over the
blocks, viewed as 16- or 8-byte elements), and only the tail token by token.

    FlashAttentionLayout  [2, blocks, block_size, heads, head_size]: V0's FLASH_ATTN
                          and DUAL_CHUNK_FLASH_ATTN, and V1's FLASH_ATTN before the
                          standard view (connectors.v1.kv_layout)

Imports torch only (no vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from connectors.layout.base import BITS, KVLayout

# Beside the integers of the element's size (connectors.layout.base.BITS), whole
# rows and the paged key's 16-byte groups move as the widest element the
# tensors' alignment allows (complex128, else int64), which the element-wise
# index kernels move in 1/x (1/(x/2)) as many steps. aten's index with `out`
# writes the gathered rows straight into the caller's tensor.
_WIDE = ((torch.complex128, 16), (torch.int64, 8))
index_out = torch.ops.aten.index.Tensor_out


def move_unit(*tensors: torch.Tensor) -> tuple[torch.dtype, int]:
    """The widest element every tensor's start is aligned to (a view needs it).

    A loaded entry's KV starts right after its int64 token ids, so with an
    odd token count it is 8- but not 16-byte aligned.
    """
    for dtype, size in _WIDE:
        if all(t.storage_offset() * t.element_size() % size == 0 for t in tensors):
            return dtype, size
    es = tensors[0].element_size()
    return BITS[es], es


def row_pair(a: torch.Tensor, a_rows: int, b: torch.Tensor,
             b_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous `a` and `b` as [a_rows, row] and [b_rows, row] of one element type:
    the widest (16, 8 bytes) both starts are aligned to and both rows hold whole, else
    the integers of their element size. Index kernels then move a row in few steps."""
    es = a.element_size()
    row_bytes = a.numel() * es // a_rows
    for dtype, size in _WIDE + ((BITS[es], es),):
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


class BlockwiseLayout(KVLayout):
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


class FlashAttentionLayout(BlockwiseLayout):
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
                rows, into = row_pair(src, src.shape[0], dst[:full], n)
                torch.index_select(rows, 0, plan.blocks, out=into)
            if tail:
                rows, into = row_pair(src, src.shape[0] * bs, dst[full:], tail)
                torch.index_select(rows, 0, plan.tail, out=into)

    def _scatter(self, cache, plan, kv):
        full, n, tail = plan.full, plan.blocks.shape[0], plan.tail.shape[0]
        bs = self.g.block_size
        for part in range(2):
            dst, src = cache[part], kv[part].contiguous()
            if n:
                rows, values = row_pair(dst, dst.shape[0], src[:full], n)
                rows.index_copy_(0, plan.blocks, values)
            if tail:
                rows, values = row_pair(dst, dst.shape[0] * bs, src[full:], tail)
                rows.index_copy_(0, plan.tail, values)
