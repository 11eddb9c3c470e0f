"""V1 paged-cache adapters on plain CPU tensors: slot semantics, strides, block sizes, the CPU page probe."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from connectors.store import format as fmt  # noqa: E402
from connectors.store import fs_store  # noqa: E402
from connectors.layout.base import CacheGeometry, LayerWriter, UnsupportedLayout  # noqa: E402
from connectors.layout.blocks import FlashAttentionLayout  # noqa: E402
from connectors.v1.kv_layout import (  # noqa: E402
    PagedCPULayout,
    SplitChannelLayout,
    ordered_layers,
    probe_page_positions,
    select_layout,
)
from connectors.v1.transfer import slots_for  # noqa: E402

H, D = 2, 32


def token_kv(tokens: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """[2, tokens, heads, head_size] of distinct values."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, tokens, H, D, generator=g).to(dtype)


def vec_writer(key, value, cache, slots):
    """What vLLM's CPU "vec" kernel does (checked against the real kernel in test_v1_vllm):
    per (block, head) page, K as [head_size, N] then V as [N, head_size]."""
    n = cache.shape[2]
    pages = cache.view(cache.shape[0], cache.shape[1], -1)
    for t, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, n)
        for h in range(cache.shape[1]):
            pages[b, h, torch.arange(D) * n + o] = key[t, h]
            pages[b, h, n * D + o * D + torch.arange(D)] = value[t, h]


def blocked_writer(key, value, cache, slots):
    """A made-up kernel layout (K in 16-token tiles, V transposed), to show the probe assumes nothing."""
    n = cache.shape[2]
    pages = cache.view(cache.shape[0], cache.shape[1], -1)
    for t, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, n)
        tile, within = divmod(o, 16)
        for h in range(cache.shape[1]):
            pages[b, h, tile * 16 * D + torch.arange(D) * 16 + within] = key[t, h]
            pages[b, h, n * D + torch.arange(D) * n + o] = value[t, h]


def cpu_cache(blocks: int, n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(blocks, H, n, 2 * D, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("writer", [vec_writer, blocked_writer])
def test_probe_recovers_the_kernels_page_layout_and_gather_reads_what_it_wrote(writer, dtype):
    n = 32
    g = CacheGeometry(block_size=n, kv_heads=H, head_size=D)
    layout = PagedCPULayout(g, *probe_page_positions(writer, g, dtype))
    cache = cpu_cache(6, n, dtype)
    slots = torch.tensor([4 * n + 3, 4 * n + 4, 1 * n + 31, 5 * n + 0, 0 * n + 9])
    kv = token_kv(len(slots), dtype)
    writer(kv[0], kv[1], cache, slots)  # the kernel writes ...
    assert torch.equal(layout.gather(cache, slots), kv)  # ... we read the same token-major rows
    again = cpu_cache(6, n, dtype)
    layout.scatter(again, slots, kv)  # and our scatter writes exactly what the kernel would
    assert torch.equal(again, cache)


def test_vec_layout_is_what_the_probe_finds_for_the_vec_kernel():
    g = CacheGeometry(block_size=64, kv_heads=H, head_size=D)
    key_pos, value_pos = probe_page_positions(vec_writer, g, torch.float32)
    vec = PagedCPULayout.vec(g)
    assert torch.equal(key_pos, vec.key_pos) and torch.equal(value_pos, vec.value_pos)


def test_probe_refuses_a_kernel_that_is_not_a_per_head_permutation():
    g = CacheGeometry(block_size=32, kv_heads=H, head_size=D)

    def drops_values(key, value, cache, slots):
        vec_writer(key, torch.zeros_like(value), cache, slots)

    def swaps_heads(key, value, cache, slots):
        vec_writer(key.flip(1), value.flip(1), cache, slots)

    with pytest.raises(UnsupportedLayout, match="value"):
        probe_page_positions(drops_values, g, torch.float32)
    with pytest.raises(UnsupportedLayout, match="another head"):
        probe_page_positions(swaps_heads, g, torch.float32)


def split_channel_cache(blocks: int, n: int, order=(0, 1, 2, 3)) -> torch.Tensor:
    """A [blocks, heads, N, 2*head_size] view whose memory is in `order` (as vLLM's KV cache layouts permute)."""
    logical = (blocks, H, n, 2 * D)
    physical = torch.zeros([logical[i] for i in order])
    inverse = [order.index(i) for i in range(4)]
    return physical.permute(*inverse)


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (0, 2, 1, 3)], ids=["BHNC", "BNHC"])
def test_split_channel_layout_follows_the_flash_slot_semantics(order):
    """FLASH_ATTN in vLLM 0.32: kv_cache.transpose(1, 2).split(head_size, -1) gives K and V of [b, n, h]."""
    n = 16
    cache = split_channel_cache(5, n, order)
    layout = select_layout(cache, "FLASH_ATTN", kv_heads=H, head_size=D)
    assert isinstance(layout, SplitChannelLayout)
    slots = torch.tensor([3 * n + 1, 0 * n + 15, 4 * n + 7])
    kv = token_kv(3)
    layout.scatter(cache, slots, kv)
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)  # what the backend reads
    for t, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, n)
        assert torch.equal(key_cache[b, o], kv[0, t]) and torch.equal(value_cache[b, o], kv[1, t])
    assert torch.equal(layout.gather(cache, slots), kv)
    assert cache.count_nonzero() == kv.count_nonzero()


def test_earlier_v1_flash_layout_is_read_like_v0s():
    n = 16
    cache = torch.zeros(2, 4, n, H, D)
    layout = select_layout(cache, "FLASH_ATTN", kv_heads=H, head_size=D)
    assert isinstance(layout, FlashAttentionLayout)
    slots = torch.tensor([2 * n + 5, 3 * n + 0])
    kv = token_kv(2)
    layout.scatter(cache, slots, kv)
    assert torch.equal(cache[0, 2, 5], kv[0, 0]) and torch.equal(cache[1, 3, 0], kv[1, 1])
    assert torch.equal(layout.gather(cache, slots), kv)


def test_manager_slots_address_kernel_blocks_when_vllm_splits_blocks():
    """Manager block 64 over 32-token kernel blocks: manager block b is kernel blocks 2b and 2b+1."""
    kernel_n, manager_n, tokens = 32, 64, 70
    block_ids = [3, 1]  # a request's manager blocks
    kv = token_kv(tokens)
    cache = cpu_cache(2 * 4, kernel_n)  # 4 manager blocks as 8 kernel blocks
    layout = PagedCPULayout.vec(CacheGeometry(kernel_n, H, D))
    layout.scatter(cache, torch.tensor(slots_for(block_ids, manager_n, 0, tokens)), kv)
    # The kernel, given kernel-block slots (block b's j-th kernel block is 2b + j), writes the same bytes.
    kernel_slots = [(block_ids[i // manager_n] * 2 + i % manager_n // kernel_n) * kernel_n + i % kernel_n
                    for i in range(tokens)]
    expect = cpu_cache(2 * 4, kernel_n)
    vec_writer(kv[0], kv[1], expect, torch.tensor(kernel_slots))
    assert torch.equal(cache, expect)


@pytest.mark.parametrize("p_block,d_block", [(32, 64), (128, 32), (64, 32)])
def test_token_major_rows_move_between_block_sizes(p_block, d_block):
    """P gathers with its block size and block table, D scatters with its own: D's cache reads the same rows."""
    tokens = 150
    p_cache, d_cache = cpu_cache(40, p_block), cpu_cache(40, d_block)
    p_layout, d_layout = PagedCPULayout.vec(CacheGeometry(p_block, H, D)), PagedCPULayout.vec(CacheGeometry(d_block, H, D))
    p_blocks = list(range(39, 39 - -(-tokens // p_block), -1))
    d_blocks = [5, 17, 2, 30, 11][: -(-tokens // d_block)]
    kv = token_kv(tokens)
    p_layout.scatter(p_cache, torch.tensor(slots_for(p_blocks, p_block, 0, tokens)), kv)
    stored = p_layout.gather(p_cache, torch.tensor(slots_for(p_blocks, p_block, 0, tokens)))
    d_slots = torch.tensor(slots_for(d_blocks, d_block, 0, tokens - 1))
    d_layout.scatter(d_cache, d_slots, stored[:, : tokens - 1])
    assert torch.equal(d_layout.gather(d_cache, d_slots), kv[:, : tokens - 1])


def test_layers_are_gathered_into_one_token_major_tensor():
    n = 32
    layout = PagedCPULayout.vec(CacheGeometry(n, H, D))
    caches = [cpu_cache(3, n), cpu_cache(3, n)]
    slots = torch.tensor([n + 2, 2 * n + 9])
    kv = torch.stack([token_kv(2, seed=1), token_kv(2, seed=2)])
    layout.scatter_layers(caches, slots, kv)
    assert torch.equal(layout.gather_layers(caches, slots), kv)


def test_unknown_backends_and_shapes_are_refused_with_the_shape_named():
    with pytest.raises(UnsupportedLayout, match=r"'FLASHINFER' with cache shape \[4, 2, 16, 64\]"):
        select_layout(torch.zeros(4, 2, 16, 2 * D), "FLASHINFER", kv_heads=H, head_size=D)
    with pytest.raises(UnsupportedLayout, match="TRITON_MLA"):
        select_layout(torch.zeros(4, 1, 16, 576), "TRITON_MLA", kv_heads=1, head_size=576)
    with pytest.raises(UnsupportedLayout, match="cache writer"):
        select_layout(cpu_cache(2, 32), "CPU_ATTN", kv_heads=H, head_size=D)


def test_layers_are_ordered_by_model_index():
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(1) for i in (1, 0, 2)}
    index = lambda name: int(name.split(".")[2])  # noqa: E731
    assert [n for n, _ in ordered_layers(caches, index)] == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    with pytest.raises(ValueError, match="indices"):
        ordered_layers({"a.0": torch.zeros(1), "b.2": torch.zeros(1)}, lambda n: int(n[-1]))


# ---------------------------------------------------------------- D's load: the store straight into the cache

LOAD_N, LOAD_BLOCKS = 16, 8
LOAD_IDENT = fmt.KVIdentity(model="m;hidden=none", num_layers=3, kv_parts=2, kv_heads=H, head_size=D, dtype="F32")
LAYOUTS = {  # name -> (layout, an empty cache of its shape)
    "paged_cpu": (lambda g: PagedCPULayout.vec(g), lambda: cpu_cache(LOAD_BLOCKS, LOAD_N)),
    "split_channel": (SplitChannelLayout, lambda: split_channel_cache(LOAD_BLOCKS, LOAD_N, (0, 2, 1, 3))),
    "flash": (FlashAttentionLayout, lambda: torch.zeros(2, LOAD_BLOCKS, LOAD_N, H, D)),
}


def stored_entry(root, tokens: int = 40):
    """A V1 producer's entry (KV only) of `tokens` tokens: (store, token ids, kv, path)."""
    ids = list(range(500, 500 + tokens))
    kv = torch.stack([token_kv(tokens, seed=layer) for layer in range(LOAD_IDENT.num_layers)])
    store = fs_store.FSStore(root, fsync=False)
    path = store.save(LOAD_IDENT, ids, kv, torch.empty((1, 0))).path
    return store, ids, kv, path


def entry_path(root, ids):
    return fmt.entry_path(root, fmt.compute_key(LOAD_IDENT, ids))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_load_puts_positions_start_to_end_of_every_layer_into_the_requests_slots(tmp_path, name):
    """What the V1 FSConnector's worker does: load_into + LayerWriter, the prefix-cached block left alone."""
    make_layout, new_cache = LAYOUTS[name]
    layout = make_layout(CacheGeometry(LOAD_N, H, D))
    store, ids, kv, _ = stored_entry(tmp_path)
    block_ids, start, end = [5, 2, 7], LOAD_N, len(ids) - 1  # block 5 held the local prefix hit
    slots = torch.tensor(slots_for(block_ids, LOAD_N, start, end))
    caches = [new_cache().fill_(0.25) for _ in range(LOAD_IDENT.num_layers)]
    expect = [c.clone() for c in caches]
    layout.scatter_layers(expect, slots, kv[:, :, start:end])  # the two-pass load it replaces
    writer = LayerWriter(layout, caches, slots, slice(start, end))
    entry = store.load_into(LOAD_IDENT, ids, writer)
    assert entry.kv is None and entry.num_bytes == fmt.read_entry(entry_path(tmp_path, ids))[0].data_len
    assert all(torch.equal(got, want) for got, want in zip(caches, expect))
    assert torch.equal(layout.gather_layers(caches, slots), kv[:, :, start:end])
    assert writer.seconds > 0


def test_damage_in_the_last_layer_is_found_only_after_the_scatter(tmp_path, monkeypatch):
    """The checksum covers the whole entry: a load that already wrote every layer still fails (the
    connector must then report the blocks failed, test_v1_e2e's worker test)."""
    monkeypatch.setattr(fs_store, "LOAD_CHUNK_BYTES", 1, raising=False)  # one layer per read
    layout = PagedCPULayout.vec(CacheGeometry(LOAD_N, H, D))
    store, ids, kv, path = stored_entry(tmp_path)
    header, _ = fmt.read_entry(path)
    raw = bytearray(path.read_bytes())
    raw[header.data_start + header.span("kv")[1] - 3] ^= 0x40  # the last layer's last value
    path.write_bytes(bytes(raw))
    caches = [cpu_cache(LOAD_BLOCKS, LOAD_N) for _ in range(LOAD_IDENT.num_layers)]
    written = []
    writer = LayerWriter(layout, caches, torch.tensor(slots_for([1, 3, 4], LOAD_N, 0, len(ids) - 1)),
                         slice(0, len(ids) - 1))
    with pytest.raises(fmt.EntryCorrupt, match="checksum"):
        store.load_into(LOAD_IDENT, ids, lambda layer, layer_kv: written.append(layer) or writer(layer, layer_kv))
    assert written == list(range(LOAD_IDENT.num_layers))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_layouts_plan_writes_what_scatter_writes_whatever_the_caches_strides(dtype):
    """One plan for every layer, even when layers differ in strides or start inside a larger buffer."""
    n = 32
    layout = PagedCPULayout(CacheGeometry(n, H, D), *probe_page_positions(blocked_writer, CacheGeometry(n, H, D),
                                                                          dtype))
    slots = torch.tensor(slots_for([4, 0, 2], n, 5, 3 * n - 7))  # a partial first and last block
    kv = token_kv(len(slots), dtype)
    heads_outer = torch.zeros(H, 6, n, 2 * D, dtype=dtype).transpose(0, 1)  # [blocks, heads, ...], heads outermost
    inside = torch.zeros(7, H, n, 2 * D, dtype=dtype)[1:]  # storage offset of one block
    plan = layout.plan(slots)
    for cache in (cpu_cache(6, n, dtype), heads_outer, inside):
        cache.fill_(0.5)
        expect = cache.clone()
        layout.scatter(expect, slots, kv)
        layout.scatter_plan(cache, plan, kv)
        assert torch.equal(cache, expect)
        assert torch.equal(layout.gather(cache, slots), kv)
    assert len(plan.elements) == 2  # per strides: the offset view has the contiguous cache's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_layouts_planned_gather_of_every_layer_reads_what_gather_reads(dtype):
    """gather_layers (one plan for all layers, P's send) equals per-layer gather, whatever each layer's strides."""
    n = 32
    layout = PagedCPULayout(CacheGeometry(n, H, D), *probe_page_positions(blocked_writer, CacheGeometry(n, H, D),
                                                                          dtype))
    slots = torch.tensor(slots_for([4, 0, 2], n, 5, 3 * n - 7))
    caches = [cpu_cache(6, n, dtype), torch.zeros(H, 6, n, 2 * D, dtype=dtype).transpose(0, 1),
              torch.zeros(7, H, n, 2 * D, dtype=dtype)[1:]]
    kv = torch.stack([token_kv(len(slots), dtype, seed=s) for s in range(len(caches))])
    for cache, layer_kv in zip(caches, kv):
        cache.fill_(0.5)
        layout.scatter(cache, slots, layer_kv)
    out = torch.full_like(kv, -1)
    assert layout.gather_layers(caches, slots, out) is out
    assert torch.equal(out, kv)
    assert torch.equal(torch.stack([layout.gather(c, slots) for c in caches]), kv)
