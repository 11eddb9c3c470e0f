"""Gather/scatter round trips for every V0 paged-cache layout, checked against slot semantics."""

from __future__ import annotations

import pytest
import torch

from connectors.v0.kv_layout import (  # noqa: E402
    CacheGeometry,
    FlashAttentionLayout,
    FlashInferLayout,
    MLALayout,
    PagedAttentionLayout,
    UnsupportedLayout,
    select_layout,
)

G = CacheGeometry(block_size=16, kv_heads=2, head_size=32)
BLOCKS = 8
# An attention backend (its get_name()) that allocates each layout.
BACKEND = {"paged_attention": "TORCH_SDPA", "flash_attn": "FLASH_ATTN", "flashinfer": "FLASHINFER",
           "mla": "TRITON_MLA"}


def empty_cache(name: str, dtype=torch.float32, blocks: int = BLOCKS):
    bs, h, d = G.block_size, G.kv_heads, G.head_size
    shape = {
        "paged_attention": (2, blocks, bs * h * d),
        "flash_attn": (2, blocks, bs, h, d),
        "flashinfer": (blocks, 2, bs, h, d),
        "mla": (blocks, bs, d),
    }[name]
    return torch.zeros(shape, dtype=dtype)


def token_kv(parts: int, tokens: int, heads: int, dtype=torch.float32):
    return torch.randn(parts, tokens, heads, G.head_size, generator=torch.Generator().manual_seed(0)).to(dtype)


# Slots spread over non-contiguous blocks and offsets, as a real block table gives.
SLOTS = torch.tensor([5 * 16 + 3, 5 * 16 + 4, 1 * 16 + 15, 7 * 16 + 0, 0 * 16 + 9])


@pytest.mark.parametrize("name,cls", [("paged_attention", PagedAttentionLayout),
                                      ("flash_attn", FlashAttentionLayout),
                                      ("flashinfer", FlashInferLayout), ("mla", MLALayout)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_then_gather_round_trip(name, cls, dtype):
    cache = empty_cache(name, dtype)
    layout = select_layout(cache, G if name != "mla" else CacheGeometry(16, 1, G.head_size), BACKEND[name])
    assert isinstance(layout, cls)
    kv = token_kv(layout.kv_parts, len(SLOTS), 1 if name == "mla" else G.kv_heads, dtype)
    layout.scatter(cache, SLOTS, kv)
    assert torch.equal(layout.gather(cache, SLOTS), kv)
    # Only the addressed slots changed: everything else is still zero.
    assert cache.count_nonzero() == kv.count_nonzero()


def test_paged_layout_matches_vllm_slot_semantics():
    """Independent check of the CPU V0 layout: write a token the way PagedAttention does."""
    cache = empty_cache("paged_attention")
    x = 16 // cache.element_size()
    key = cache[0].view(BLOCKS, G.kv_heads, G.head_size // x, G.block_size, x)
    value = cache[1].view(BLOCKS, G.kv_heads, G.head_size, G.block_size)
    slot = 3 * 16 + 7
    k = torch.arange(G.kv_heads * G.head_size, dtype=torch.float32).view(G.kv_heads, G.head_size)
    v = -k
    for head in range(G.kv_heads):
        for dim in range(G.head_size):
            key[3, head, dim // x, 7, dim % x] = k[head, dim]
            value[3, head, dim, 7] = v[head, dim]
    got = select_layout(cache, G, "TORCH_SDPA").gather(cache, torch.tensor([slot]))
    assert torch.equal(got[0, 0], k) and torch.equal(got[1, 0], v)


def test_flash_layout_matches_slot_semantics():
    cache = empty_cache("flash_attn")
    cache[1, 2, 5, 1, 7] = 42.0  # value, block 2, offset 5, head 1, dim 7
    got = select_layout(cache, G, "FLASH_ATTN").gather(cache, torch.tensor([2 * 16 + 5]))
    assert got[1, 0, 1, 7] == 42.0 and got.count_nonzero() == 1


def test_block_size_independence():
    """KV written through a block-16 cache reads back through a block-32 cache unchanged."""
    kv = token_kv(2, 40, G.kv_heads)
    small = empty_cache("paged_attention")
    select_layout(small, G, "TORCH_SDPA").scatter(small, torch.arange(40) + 16, kv)
    gathered = select_layout(small, G, "TORCH_SDPA").gather(small, torch.arange(40) + 16)
    g32 = CacheGeometry(32, G.kv_heads, G.head_size)
    big = torch.zeros(2, 4, 32 * G.kv_heads * G.head_size)
    layout32 = select_layout(big, g32, "TORCH_SDPA")
    slots32 = torch.arange(40) + 64
    layout32.scatter(big, slots32, gathered)
    assert torch.equal(layout32.gather(big, slots32), kv)


def test_unknown_shape_is_refused():
    with pytest.raises(UnsupportedLayout):
        select_layout(torch.zeros(3, 4, 5, 6), G, "TORCH_SDPA")
    with pytest.raises(UnsupportedLayout, match="does not match"):
        select_layout(empty_cache("flash_attn"), G, backend="TORCH_SDPA")


def test_unknown_backend_is_refused_by_name():
    with pytest.raises(UnsupportedLayout, match="attention backend 'PALLAS'") as e:
        select_layout(torch.zeros(2, 4, 16, 2, 32), G, "PALLAS")
    assert "FLASH_ATTN" in str(e.value)  # lists the supported ones


@pytest.mark.parametrize("backend,cls", [("FLASH_ATTN", FlashAttentionLayout),
                                         ("FLASHINFER", FlashInferLayout),
                                         ("FLASH_ATTN_VLLM_V1", FlashAttentionLayout),
                                         ("FLASHINFER_VLLM_V1", FlashInferLayout)])
def test_two_block_cache_takes_its_backends_layout(backend, cls):
    """[2, 2, bs, heads, d] is both a FlashAttention and a FlashInfer cache: the backend decides."""
    flash = empty_cache("flash_attn", blocks=2)
    assert flash.shape == empty_cache("flashinfer", blocks=2).shape
    layout = select_layout(flash, G, backend)
    assert type(layout) is cls
    # Slot 3 (block 0, offset 3): its value (kv part 1) of head 1, dim 7, where the backend keeps it.
    cache = torch.zeros_like(flash)
    if cls is FlashAttentionLayout:
        cache[1, 0, 3, 1, 7] = 42.0  # [kv, block, offset, head, dim]
    else:
        cache[0, 1, 3, 1, 7] = 42.0  # [block, kv, offset, head, dim]
    got = layout.gather(cache, torch.tensor([3]))
    assert got[1, 0, 1, 7] == 42.0 and got.count_nonzero() == 1


@pytest.mark.parametrize("name", ["paged_attention", "flash_attn", "flashinfer", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_gather_layers_fills_one_tensor_like_stacked_gathers(name, dtype):
    g = G if name != "mla" else CacheGeometry(16, 1, G.head_size)
    caches = [empty_cache(name, torch.float32).normal_(generator=torch.Generator().manual_seed(i)).to(dtype)
              for i in range(3)]
    layout = select_layout(caches[0], g, BACKEND[name])
    expected = torch.stack([layout.gather(c, SLOTS) for c in caches])
    got = layout.gather_layers(caches, SLOTS)
    assert got.shape == (3, layout.kv_parts, len(SLOTS), g.kv_heads, g.head_size)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # bit exact, NaNs included
    fresh = [torch.zeros_like(c) for c in caches]
    layout.scatter_layers(fresh, SLOTS, got)
    assert torch.equal(layout.gather_layers(fresh, SLOTS).view(torch.uint8), got.view(torch.uint8))


def test_paged_gather_moves_bytes_not_values():
    # Moving 16-byte groups as complex128 must not touch the bits: NaN payloads and -0.0 survive.
    cache = empty_cache("paged_attention", torch.bfloat16)
    cache.view(torch.int16).copy_(torch.randint(-2**15, 2**15 - 1, cache.shape, dtype=torch.int16,
                                                generator=torch.Generator().manual_seed(1)))
    layout = select_layout(cache, G, "TORCH_SDPA")
    kv = layout.gather(cache, SLOTS)
    other = torch.zeros_like(cache)
    layout.scatter(other, SLOTS, kv)
    assert torch.equal(layout.gather(other, SLOTS).view(torch.int16), kv.view(torch.int16))
    block, offset = SLOTS // 16, SLOTS % 16
    x = 16 // 2
    key = cache[0].view(BLOCKS, G.kv_heads, G.head_size // x, 16, x)
    assert torch.equal(kv[0].view(torch.int16),
                       key[block, :, :, offset, :].reshape(len(SLOTS), G.kv_heads, G.head_size).view(torch.int16))


@pytest.mark.parametrize("shift_bytes", [0, 8, 4])
def test_paged_round_trip_from_unaligned_kv(shift_bytes):
    # A loaded entry's KV follows its int64 token ids: 8-byte aligned with an odd token count.
    kv = token_kv(2, len(SLOTS), G.kv_heads)
    raw = torch.zeros(kv.numel() * 4 + shift_bytes, dtype=torch.uint8)
    view = raw[shift_bytes:].view(torch.float32).view(kv.shape) if shift_bytes % 4 == 0 else None
    view.copy_(kv)
    cache = empty_cache("paged_attention")
    layout = select_layout(cache, G, "TORCH_SDPA")
    layout.scatter(cache, SLOTS, view)
    out_raw = torch.zeros_like(raw)
    out = out_raw[shift_bytes:].view(torch.float32).view(kv.shape)
    layout.gather(cache, SLOTS, out=out)
    assert torch.equal(out, kv) and torch.equal(layout.gather(cache, SLOTS), kv)
