"""The store's save path (one pwritev, temp + rename) and FSStore.load_into (layer by layer into a cache).

Real files, no vLLM. The save must keep every safety property of the format:
a temp file or a partial entry is never a hit, a failed write leaves nothing,
fsync covers the file before its name appears. load_into must check
everything load checks, and a truncated, deleted or damaged entry is a clean
miss or EntryCorrupt (no mmap, so no SIGBUS).
"""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from connectors.store import format as fmt
from connectors.store.fs_store import FSStore, TokenMismatch
from connectors.v0.kv_layout import CacheGeometry, PagedAttentionLayout

IDENT = fmt.KVIdentity(model='m"odel\\ é;dtype=bfloat16', num_layers=3, kv_parts=2, kv_heads=2, head_size=16,
                       dtype="BF16")
HIDDEN = 32


def make(seed: int, tokens: int = 21):
    g = torch.Generator().manual_seed(seed)
    ids = [seed * 1000 + i for i in range(tokens)]
    kv = torch.randn(IDENT.num_layers, 2, tokens, IDENT.kv_heads, IDENT.head_size, generator=g).to(torch.bfloat16)
    return ids, kv, torch.randn(1, HIDDEN, generator=g).to(torch.bfloat16)


def test_header_is_the_json_of_its_records(tmp_path):
    ids, kv, hidden = make(1)
    path = FSStore(tmp_path, fsync=False).save(IDENT, ids, kv, hidden).path
    raw = path.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    doc = json.loads(raw[8:8 + hlen])
    assert json.dumps(doc, separators=(",", ":")).encode() == raw[8:8 + hlen].rstrip(b" ")
    assert list(doc) == ["token_ids", "kv", "hidden", "__metadata__"]
    assert doc["__metadata__"]["model"] == IDENT.model
    header, data = fmt.read_entry(path)
    assert fmt.token_ids_of(header, data) == ids
    fmt.verify_entry(path)


def test_save_fsyncs_the_file_before_its_name_appears_and_not_the_directory(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("rename", b)) or real_replace(a, b))
    path = FSStore(tmp_path, fsync=True).save(IDENT, *make(2)).path
    assert [e[0] for e in events] == ["fsync", "rename"]
    assert fmt.is_temp_name(os.path.basename(events[0][1]))  # the temp file, not the directory
    events.clear()
    FSStore(tmp_path, fsync=False).save(IDENT, *make(3))
    assert [e[0] for e in events] == ["rename"]
    assert path.exists()


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    real = os.pwritev
    calls = []

    def short_then_enospc(fd, bufs, offset):
        calls.append(offset)
        if len(calls) == 1:
            return real(fd, [memoryview(bufs[0])[:100]], offset)  # a short write first
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", short_then_enospc)
    with pytest.raises(OSError) as info:
        FSStore(tmp_path, fsync=False).save(IDENT, *make(4))
    assert info.value.errno == errno.ENOSPC and calls == [0, 100]  # the short write was resumed
    assert list(tmp_path.iterdir()) == []


def test_short_writes_are_resumed(tmp_path, monkeypatch):
    real = os.pwritev

    def at_most_1000(fd, bufs, offset):
        first = memoryview(bufs[0]).cast("B")
        return real(fd, [first[:1000]], offset)

    monkeypatch.setattr(os, "pwritev", at_most_1000)
    ids, kv, hidden = make(5)
    store = FSStore(tmp_path, fsync=False)
    store.save(IDENT, ids, kv, hidden)
    monkeypatch.setattr(os, "pwritev", real)
    assert torch.equal(store.load(IDENT, ids).kv, kv)


def test_temp_files_and_partial_entries_are_misses(tmp_path):
    store = FSStore(tmp_path, fsync=False)
    ids, kv, hidden = make(6)
    path = store.save(IDENT, ids, kv, hidden).path
    whole = path.read_bytes()
    key = path.name[:-len(fmt.ENTRY_SUFFIX)]
    path.unlink()
    temp = tmp_path / f".{key}.123.deadbeef.tmp"
    temp.write_bytes(whole)  # even a complete temp file is not an entry
    assert fmt.is_temp_name(temp.name)
    with pytest.raises(FileNotFoundError):
        store.load(IDENT, ids)
    with pytest.raises(FileNotFoundError):
        store.load_into(IDENT, ids, lambda layer, t: None)
    assert not store.has_entry(key)
    path.write_bytes(whole[:len(whole) // 2])  # a torn file under the final name
    for load in (lambda: store.load(IDENT, ids), lambda: store.load_into(IDENT, ids, lambda layer, t: None)):
        with pytest.raises(fmt.EntryCorrupt):
            load()
    assert not store.has_entry(key)


def paged(tokens: int):
    g = CacheGeometry(block_size=16, kv_heads=IDENT.kv_heads, head_size=IDENT.head_size)
    blocks = 2 * -(-tokens // 16) + 1
    caches = [torch.zeros(PagedAttentionLayout.cache_shape(blocks, g), dtype=torch.bfloat16)
              for _ in range(IDENT.num_layers)]
    slots = torch.randperm(blocks * 16, generator=torch.Generator().manual_seed(0))[:tokens]
    return PagedAttentionLayout(g), caches, slots


def test_load_into_scatters_what_load_returns(tmp_path):
    store = FSStore(tmp_path, fsync=False)
    for seed, tokens in ((7, 21), (8, 1), (9, 64)):
        ids, kv, hidden = make(seed, tokens)
        store.save(IDENT, ids, kv, hidden)
        layout, caches, slots = paged(tokens)
        seen = []
        entry = store.load_into(IDENT, ids, lambda layer, t: seen.append(layer) or layout.scatter(caches[layer],
                                                                                                   slots, t),
                                hidden_size=HIDDEN, hidden_dtype=torch.bfloat16)
        assert seen == list(range(IDENT.num_layers)) and entry.kv is None
        assert torch.equal(layout.gather_layers(caches, slots), kv)
        assert torch.equal(entry.hidden, hidden)
        assert entry.num_bytes == store.load(IDENT, ids).num_bytes


def test_load_into_checks_before_writing_anything(tmp_path):
    store = FSStore(tmp_path, fsync=False)
    ids, kv, hidden = make(10)
    path = store.save(IDENT, ids, kv, hidden).path
    calls = []
    sink = lambda layer, t: calls.append(layer)  # noqa: E731
    other = fmt.KVIdentity(**{**IDENT.__dict__, "model": "other"})
    with pytest.raises(FileNotFoundError):  # another identity: another key
        store.load_into(other, ids, sink)
    with pytest.raises(fmt.EntryCorrupt, match="hidden has"):
        store.load_into(IDENT, ids, sink, hidden_size=HIDDEN + 1)
    # an entry holding other token ids under this key (a hash collision or tampering)
    other_ids = [i + 1 for i in ids]
    other_path = store.save(IDENT, other_ids, kv, hidden).path
    os.replace(other_path, path)
    with pytest.raises(fmt.EntryCorrupt, match="content hashes to key"):
        store.load_into(IDENT, ids, sink)
    assert calls == []


def test_load_into_reports_damaged_data_after_the_fact(tmp_path):
    store = FSStore(tmp_path, fsync=False)
    ids, kv, hidden = make(11)
    path = store.save(IDENT, ids, kv, hidden).path
    raw = bytearray(path.read_bytes())
    raw[-HIDDEN - 5] ^= 0x01  # one bit in the last layer's V
    path.write_bytes(bytes(raw))
    calls = []
    with pytest.raises(fmt.EntryCorrupt, match="checksum mismatch") as info:
        store.load_into(IDENT, ids, lambda layer, t: calls.append(layer))
    assert calls == [0, 1, 2]  # the caller was told; it recomputes and overwrites those slots
    assert store.remove_corrupt(info.value) and not path.exists()


def test_load_into_entry_cut_short_or_deleted_while_loading(tmp_path):
    store = FSStore(tmp_path, fsync=False)
    ids, kv, hidden = make(12)
    path = store.save(IDENT, ids, kv, hidden).path
    size = path.stat().st_size

    def truncate_after_first(layer, t):
        if layer == 0:
            os.truncate(path, size // 2)  # another host cuts the file under the reader

    with pytest.raises(fmt.EntryCorrupt, match="short read"):
        store.load_into(IDENT, ids, truncate_after_first)
    path.unlink()
    store.save(IDENT, ids, kv, hidden)
    layout, caches, slots = paged(len(ids))

    def delete_after_first(layer, t):
        if layer == 0:
            path.unlink()  # an evictor removes the name: the open descriptor still reads it whole
        layout.scatter(caches[layer], slots, t)

    store.load_into(IDENT, ids, delete_after_first)
    assert torch.equal(layout.gather_layers(caches, slots), kv)
    with pytest.raises(FileNotFoundError):
        store.load_into(IDENT, ids, lambda layer, t: None)


@pytest.mark.parametrize("chunk", [1, 1 << 20])  # one layer per read; every layer in one read
def test_load_into_reuses_its_staging_buffer(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr("connectors.store.fs_store.LOAD_CHUNK_BYTES", chunk)
    store = FSStore(tmp_path, fsync=False)
    seen = []
    for seed in (13, 14, 15):
        ids, kv, hidden = make(seed)
        store.save(IDENT, ids, kv, hidden)
        layout, caches, slots = paged(len(ids))
        pointers = {}

        def sink(layer, t):
            pointers[layer] = t.data_ptr()
            layout.scatter(caches[layer], slots, t)

        store.load_into(IDENT, ids, sink)
        assert torch.equal(layout.gather_layers(caches, slots), kv)
        seen.append(pointers)
    assert seen[0] == seen[1] == seen[2]  # the same staging memory every time, nothing allocated per load
    assert len(set(seen[0].values())) == (1 if chunk == 1 else IDENT.num_layers)
