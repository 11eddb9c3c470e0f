"""FS store round trips and rejection of anything that is not exactly the entry asked for."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from connectors.store import format as fmt  # noqa: E402
from connectors.store.fs_store import FSStore, TokenMismatch  # noqa: E402

IDENT = fmt.KVIdentity(model="m", num_layers=3, kv_parts=2, kv_heads=2, head_size=32,
                       dtype="BF16")


def make_entry(tokens: int = 37, seed: int = 0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(3, 2, tokens, 2, 32, generator=g).to(dtype)
    hidden = torch.randn(tokens, 128, generator=g).to(dtype)
    ids = torch.randint(0, 2000, (tokens,), generator=g).tolist()
    return ids, kv, hidden


def test_round_trip_bit_exact(tmp_path):
    store = FSStore(tmp_path)
    ids, kv, hidden = make_entry()
    saved = store.save(IDENT, ids, kv, hidden)
    assert saved.path == fmt.entry_path(tmp_path, saved.key)
    assert len(saved.key) == 32  # 128-bit
    got = store.load(IDENT, ids)
    assert torch.equal(got.kv, kv) and torch.equal(got.hidden, hidden)
    assert got.kv.dtype == torch.bfloat16 and got.key == saved.key
    # Nothing but the entry is left behind (no temp files).
    assert [p.name for p in tmp_path.iterdir()] == [saved.path.name]


def test_entry_is_plain_safetensors(tmp_path):
    import safetensors.torch as safetensors
    ids, kv, hidden = make_entry(tokens=5)
    saved = FSStore(tmp_path).save(IDENT, ids, kv, hidden)
    loaded = safetensors.load_file(saved.path)
    assert torch.equal(loaded["kv"], kv) and loaded["token_ids"].tolist() == ids


def test_key_depends_on_tokens_and_identity():
    ids = list(range(20))
    base = fmt.compute_key(IDENT, ids)
    assert fmt.compute_key(IDENT, ids[:-1]) != base
    assert fmt.compute_key(IDENT, ids[:-1] + [999]) != base
    for change in (dict(model="other"), dict(num_layers=4), dict(kv_heads=4), dict(head_size=64),
                   dict(dtype="F16"), dict(tp_rank=1), dict(tp_size=2)):
        other = fmt.KVIdentity(**{**IDENT.__dict__, **change})
        assert fmt.compute_key(other, ids) != base, change


def test_miss_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        FSStore(tmp_path).load(IDENT, [1, 2, 3])


@pytest.mark.parametrize("damage", ["flip_data_byte", "truncate", "append", "zero_header"])
def test_damaged_entry_is_rejected(tmp_path, damage):
    store = FSStore(tmp_path)
    ids, kv, hidden = make_entry()
    path = store.save(IDENT, ids, kv, hidden).path
    raw = bytearray(path.read_bytes())
    if damage == "flip_data_byte":
        raw[-100] ^= 0xFF
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "append":
        raw += b"\0" * 16
    else:
        raw[:8] = b"\0" * 8
    path.write_bytes(bytes(raw))
    with pytest.raises(fmt.EntryCorrupt):
        store.load(IDENT, ids)


def test_entry_under_wrong_name_is_rejected(tmp_path):
    """A valid entry renamed to another prompt's key (e.g. a botched copy) is never served."""
    store = FSStore(tmp_path)
    ids_a, kv, hidden = make_entry(seed=1)
    ids_b = ids_a[:-1] + [ids_a[-1] + 1]
    path = store.save(IDENT, ids_a, kv, hidden).path
    os.replace(path, fmt.entry_path(tmp_path, fmt.compute_key(IDENT, ids_b)))
    with pytest.raises(fmt.EntryCorrupt, match="hashes to key"):
        store.load(IDENT, ids_b)


def test_token_mismatch_is_rejected(tmp_path, monkeypatch):
    """Simulated key collision: same key, other tokens -> TokenMismatch, not a hit."""
    store = FSStore(tmp_path)
    ids_a, kv, hidden = make_entry(seed=2)
    ids_b = list(reversed(ids_a))
    monkeypatch.setattr(fmt, "key_from_token_bytes", lambda identity, raw: "ab" * 16)
    store.save(IDENT, ids_a, kv, hidden)
    with pytest.raises(TokenMismatch):
        store.load(IDENT, ids_b)


def test_foreign_safetensors_file_is_rejected(tmp_path):
    import safetensors.torch as safetensors
    ids, kv, hidden = make_entry()
    key = fmt.compute_key(IDENT, ids)
    safetensors.save_file({"kv": kv.contiguous()}, fmt.entry_path(tmp_path, key))
    with pytest.raises(fmt.EntryCorrupt, match="not a kvctl-fs-kv entry"):
        FSStore(tmp_path).load(IDENT, ids)


def _writer(root: str, rounds: int) -> None:
    store = FSStore(root, fsync=False)
    for i in range(rounds):
        ids, kv, hidden = make_entry(tokens=2000, seed=i % 2)
        store.save(IDENT, [7] * 2000, kv, hidden)  # same key, alternating content


def test_reader_racing_writer_never_sees_partial_entry(tmp_path):
    """Atomic publish: while a writer keeps replacing one ~1 MB entry, every read is whole."""
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_writer, args=(str(tmp_path), 60))
    proc.start()
    store = FSStore(tmp_path)
    expected = {make_entry(tokens=2000, seed=s)[1].view(torch.int16).sum().item() for s in (0, 1)}
    hits = 0
    deadline = time.monotonic() + 60
    try:
        while proc.is_alive() and time.monotonic() < deadline:
            try:
                got = store.load(IDENT, [7] * 2000)
            except FileNotFoundError:
                continue
            assert got.kv.view(torch.int16).sum().item() in expected
            hits += 1
    finally:
        proc.join(30)
    assert proc.exitcode == 0
    assert hits > 0
    assert not [p for p in tmp_path.iterdir() if fmt.is_temp_name(p.name)]


def test_has_entry_reads_the_header_and_refreshes_recency(tmp_path):
    store = FSStore(tmp_path)
    ids, kv, hidden = make_entry()
    path = store.save(IDENT, ids, kv, hidden).path
    key = fmt.compute_key(IDENT, ids)
    os.utime(path, (1, 1))
    assert store.has_entry(key) and path.stat().st_mtime > 1
    assert not store.has_entry(fmt.compute_key(IDENT, ids[:-1]))
    path.write_bytes(b"\0" * 16)  # a damaged header is not an entry
    assert not store.has_entry(key)


# -- hostile entries on the torch side (issue 11, items 6-8) --

SMALL = fmt.KVIdentity(model="m", num_layers=2, kv_parts=2, kv_heads=2, head_size=4, dtype="F32")


def small_entry(root, tokens=(5, 6, 7)):
    ids = list(tokens)
    kv = torch.arange(2 * 2 * len(ids) * 2 * 4, dtype=torch.float32).view(2, 2, len(ids), 2, 4)
    return ids, FSStore(root).save(SMALL, ids, kv, torch.ones(1, 16)).path


def rewrite_header(path, change):
    raw = path.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + hlen])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + hlen:])


def test_crafted_kv_shape_is_corrupt_before_any_scatter(tmp_path):
    """kv [1,2,6,2,4] where the identity says [2,2,3,2,4]: same bytes, key and checksum still match."""
    ids, path = small_entry(tmp_path)
    rewrite_header(path, lambda h: h["kv"].update(shape=[1, 2, 6, 2, 4]))
    with pytest.raises(fmt.EntryCorrupt, match="identity says"):
        FSStore(tmp_path).load(SMALL, ids)


@pytest.mark.parametrize("change", [
    lambda h: h["__metadata__"].update(model=None),
    lambda h: h["__metadata__"].update(num_layers=["2"]),
    lambda h: h["__metadata__"].update(dtype=["F32"]),
    lambda h: h["kv"].update(dtype=["F32"]),
    lambda h: h["hidden"].update(dtype="BOOL"),  # 1-byte elements: the spans no longer add up
], ids=["model null", "num_layers list", "identity dtype list", "kv dtype list", "hidden BOOL"])
def test_malformed_entry_is_entry_corrupt_on_both_sides(tmp_path, change):
    """The consumer gets EntryCorrupt (a miss it removes), the producer's has_entry says no: never TypeError."""
    ids, path = small_entry(tmp_path)
    rewrite_header(path, change)
    store = FSStore(tmp_path)
    assert store.has_entry(fmt.compute_key(SMALL, ids)) is False
    with pytest.raises(fmt.EntryCorrupt) as info:
        store.load(SMALL, ids)
    assert store.remove_corrupt(info.value) and not path.exists()


def test_hidden_dtype_without_a_torch_dtype_is_corrupt(tmp_path):
    """I16 [1, 32] spans what F32 [1, 16] did: a sound header, but no torch dtype to view it as."""
    ids, path = small_entry(tmp_path)
    rewrite_header(path, lambda h: h["hidden"].update(dtype="I16", shape=[1, 32]))
    with pytest.raises(fmt.EntryCorrupt, match="no torch dtype"):
        FSStore(tmp_path).load(SMALL, ids)


def test_deeply_nested_header_is_corrupt(tmp_path):
    ids, path = small_entry(tmp_path)
    raw = path.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    text = b'{"junk":' + b"[" * 100_000 + b"]" * 100_000 + b"," + raw[9:8 + hlen].rstrip()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + hlen:])
    store = FSStore(tmp_path)
    assert store.has_entry(fmt.compute_key(SMALL, ids)) is False
    with pytest.raises(fmt.EntryCorrupt, match="nested too deeply"):
        store.load(SMALL, ids)


def test_hidden_size_and_dtype_are_checked_when_given(tmp_path):
    ids, _ = small_entry(tmp_path)
    store = FSStore(tmp_path)
    assert store.load(SMALL, ids, hidden_size=16, hidden_dtype=torch.float32).hidden.shape == (1, 16)
    with pytest.raises(fmt.EntryCorrupt, match="hidden size is 32"):
        store.load(SMALL, ids, hidden_size=32)
    with pytest.raises(fmt.EntryCorrupt, match="needs BF16"):
        store.load(SMALL, ids, hidden_dtype=torch.bfloat16)


def test_huge_hidden_claim_is_refused_before_allocating(tmp_path):
    """A sparse file whose hidden tensor claims 1 TiB: refused from the header, nothing allocated."""
    ids, path = small_entry(tmp_path)
    width = (1 << 40) // 4

    def claim(h):
        begin = h["hidden"]["data_offsets"][0]
        h["hidden"].update(shape=[1, width], data_offsets=[begin, begin + 4 * width])
    rewrite_header(path, claim)
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) - 64 + 4 * width)
    with pytest.raises(fmt.EntryCorrupt, match="hidden size is 16"):
        FSStore(tmp_path).load(SMALL, ids, hidden_size=16)


def _alarm(signum, frame):
    raise TimeoutError("blocked")


def test_fifo_at_an_entry_name_never_blocks(tmp_path):
    ids = [1, 2, 3]
    fifo = fmt.entry_path(tmp_path, fmt.compute_key(SMALL, ids))
    os.mkfifo(fifo)
    store = FSStore(tmp_path)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)  # the old reader and has_entry blocked forever in open()
    try:
        assert store.has_entry(fmt.compute_key(SMALL, ids)) is False
        with pytest.raises(fmt.EntryCorrupt, match="a FIFO") as info:
            store.load(SMALL, ids)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert store.remove_corrupt(info.value) is False and fifo.exists()  # not an entry: never removed


def test_symlink_at_an_entry_name_is_never_followed_or_touched(tmp_path):
    ids, real = small_entry(tmp_path)
    other = tmp_path / "b"
    other.mkdir()
    link = other / real.name
    link.symlink_to(real)
    os.utime(real, (1, 1))
    store = FSStore(other)
    assert store.has_entry(fmt.compute_key(SMALL, ids)) is False
    with pytest.raises(fmt.EntryCorrupt, match="symbolic link") as info:
        store.load(SMALL, ids)
    assert store.remove_corrupt(info.value) is False and link.is_symlink()
    assert real.stat().st_mtime == 1  # no utime through the link


def test_remove_corrupt_spares_an_entry_republished_since(tmp_path):
    ids, path = small_entry(tmp_path)
    rewrite_header(path, lambda h: h["__metadata__"].update(model=None))
    store = FSStore(tmp_path)
    with pytest.raises(fmt.EntryCorrupt) as info:
        store.load(SMALL, ids)
    small_entry(tmp_path)  # the producer republishes (has_entry said no)
    assert store.remove_corrupt(info.value) is False
    assert store.load(SMALL, ids).kv.shape == (2, 2, 3, 2, 4)
