"""Whole-block gather/scatter (SlotPlan) for every V0 layout, against a per-token reference.

A prompt's slots are whole blocks from a shuffled block table and a partial
last block; the adapters move the whole blocks as rows and the rest token by
token. Each case is checked bit for bit against an independent reading of
the layout's slot semantics, and only the addressed slots may change.
"""

from __future__ import annotations

import pytest
import torch

from connectors.layout.base import CacheGeometry, GatherBuffers
from connectors.layout.blocks import SlotPlan
from connectors.v0 import kv_layout
from connectors.v0.kv_layout import select_layout

BS, HEADS, HEAD = 16, 2, 32
BACKEND = {"paged_attention": "TORCH_SDPA", "flash_attn": "FLASH_ATTN", "flashinfer": "FLASHINFER",
           "mla": "TRITON_MLA"}
LAYOUTS = list(BACKEND)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def geometry(name: str) -> CacheGeometry:
    return CacheGeometry(BS, 1 if name == "mla" else HEADS, HEAD)


def random_cache(name: str, blocks: int, dtype, seed: int) -> torch.Tensor:
    g = geometry(name)
    shape = {
        "paged_attention": (2, blocks, BS * g.kv_heads * g.head_size),
        "flash_attn": (2, blocks, BS, g.kv_heads, g.head_size),
        "flashinfer": (blocks, 2, BS, g.kv_heads, g.head_size),
        "mla": (blocks, BS, g.head_size),
    }[name]
    bits = torch.randint(0, 255, shape + (torch.empty((), dtype=dtype).element_size(),),
                         dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return bits.view(dtype).view(shape)


def reference_token(name: str, cache: torch.Tensor, slot: int) -> torch.Tensor:
    """[kv_parts, heads, head_size] of one slot, read straight from the layout's definition."""
    g = geometry(name)
    b, o = divmod(slot, BS)
    u = cache.view(torch.uint8) if cache.element_size() == 1 else cache.view(
        {2: torch.int16, 4: torch.int32}[cache.element_size()])
    if name == "paged_attention":
        x = 16 // cache.element_size()
        key = u[0].view(-1, g.kv_heads, g.head_size // x, BS, x)[b, :, :, o, :].reshape(g.kv_heads, g.head_size)
        value = u[1].view(-1, g.kv_heads, g.head_size, BS)[b, :, :, o]
        return torch.stack([key, value])
    if name == "flash_attn":
        return u[:, b, o]
    if name == "flashinfer":
        return u[b, :, o]
    return u[b, o].view(1, 1, g.head_size)


def reference(name, cache, slots) -> torch.Tensor:
    return torch.stack([reference_token(name, cache, s) for s in slots.tolist()], dim=1)


def prompt_slots(tokens: int, blocks: int, seed: int, first_offset: int = 0) -> torch.Tensor:
    """A prompt's slots: shuffled block table, positions from `first_offset`."""
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(first_offset, first_offset + tokens)
    return table[pos // BS] * BS + pos % BS


CASES = [(3 * BS, 0), (3 * BS + 5, 0), (BS - 1, 0), (2 * BS + 3, 7)]  # (tokens, first position)


@pytest.fixture(params=["numpy", "torch"])
def paged_path(request, monkeypatch):
    """The paged layout's whole blocks move through numpy on the CPU, through torch elsewhere: test both."""
    monkeypatch.setattr(kv_layout, "NUMPY_BLOCK_TRANSPOSE", request.param == "numpy")
    return request.param


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,first", CASES)
def test_gather_matches_slot_semantics(name, dtype, tokens, first, paged_path):
    cache = random_cache(name, 8, dtype, seed=tokens)
    layout = select_layout(cache, geometry(name), BACKEND[name])
    slots = prompt_slots(tokens, 8, seed=first, first_offset=first)
    got = layout.gather(cache, slots)
    want = reference(name, cache, slots)
    assert torch.equal(got.view(want.dtype) if got.element_size() > 1 else got.view(torch.uint8), want)


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("tokens,first", CASES)
def test_scatter_writes_only_its_slots(name, dtype, tokens, first, paged_path):
    source = random_cache(name, 8, dtype, seed=1)
    cache = random_cache(name, 8, dtype, seed=2)
    before = cache.clone()
    layout = select_layout(cache, geometry(name), BACKEND[name])
    slots = prompt_slots(tokens, 8, seed=3, first_offset=first)
    kv = layout.gather(source, slots)
    layout.scatter(cache, slots, kv)
    assert torch.equal(reference(name, cache, slots), reference(name, source, slots))
    untouched = sorted(set(range(8 * BS)) - set(slots.tolist()))
    idx = torch.tensor(untouched)
    assert torch.equal(reference(name, cache, idx), reference(name, before, idx))


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("shift", [0, 8])
def test_layers_round_trip_through_misaligned_entry(name, shift, paged_path):
    """Entry KV that starts 8 bytes off a 16-byte boundary (after an odd count of int64 token ids)."""
    g = geometry(name)
    caches = [random_cache(name, 8, torch.bfloat16, seed=i) for i in range(3)]
    layout = select_layout(caches[0], g, BACKEND[name])
    slots = prompt_slots(3 * BS + 4, 8, seed=5)
    got = layout.gather_layers(caches, slots)
    assert got.shape == (3, layout.kv_parts, len(slots), g.kv_heads, g.head_size)
    for layer, cache in enumerate(caches):
        assert torch.equal(got[layer].view(torch.int16), reference(name, cache, slots))
    raw = torch.zeros(got.numel() * 2 + shift, dtype=torch.uint8)
    entry = raw[shift:].view(torch.bfloat16).view(got.shape)
    entry.copy_(got)
    fresh = [torch.zeros_like(c) for c in caches]
    layout.scatter_layers(fresh, slots, entry)
    for layer, cache in enumerate(fresh):
        assert torch.equal(reference(name, cache, slots), reference(name, caches[layer], slots))


def test_slot_plan_splits_whole_blocks_from_the_rest():
    slots = torch.tensor([32 + i for i in range(16)] + [80 + i for i in range(16)] + [5, 6, 7])
    plan = SlotPlan.of(slots, 16)
    assert plan.blocks.tolist() == [2, 5] and plan.full == 32 and plan.tail.tolist() == [5, 6, 7]
    # Not whole aligned blocks in order: everything goes token by token.
    shifted = SlotPlan.of(slots[1:], 16)
    assert shifted.full == 0 and shifted.tail.tolist() == slots[1:].tolist()
    reversed_block = torch.cat([slots[:16].flip(0), slots[16:]])
    assert SlotPlan.of(reversed_block, 16).full == 0


def test_gather_buffers_are_reused_per_request_of_a_step_and_bounded():
    like = torch.zeros(1, dtype=torch.bfloat16)
    buffers = GatherBuffers(max_bytes=3 * 4096)
    first = buffers.take((2, 1024), like)  # 4 KiB
    second = buffers.take((2, 512), like)  # another request of the same step: another buffer
    assert first.data_ptr() != second.data_ptr()
    assert first.shape == (2, 1024) and first.dtype == torch.bfloat16 and first.is_contiguous()
    buffers.start_step()
    assert buffers.take((4, 256), like).data_ptr() == first.data_ptr()  # smaller fits the kept one
    assert buffers.take((2, 512), like).data_ptr() == second.data_ptr()
    over = buffers.take((4, 1024), like)  # 8 KiB more would pass the bound: fresh, not kept
    buffers.start_step()
    buffers.take((1,), like), buffers.take((1,), like)
    assert buffers.take((4, 1024), like).data_ptr() != over.data_ptr()
