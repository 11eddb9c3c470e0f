"""Bounded store (LRU + TTL eviction) and concurrency: real processes, real files."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from connectors.store import format as fmt  # noqa: E402
from connectors.store.eviction import EntryTooLarge, evict, published_entries, store_lock  # noqa: E402
from connectors.store.fs_store import FSStore  # noqa: E402

IDENT = fmt.KVIdentity(model="m", num_layers=2, kv_parts=2, kv_heads=2, head_size=32, dtype="F32")
TOKENS = 64


def entry(seed: int, tokens: int = TOKENS):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 2, tokens, 2, 32, generator=g)
    return [seed * 100_000 + i for i in range(tokens)], kv, torch.randn(1, 64, generator=g)


def entry_size(tmp_path) -> int:
    probe = tmp_path / "probe"
    probe.mkdir()
    return FSStore(probe).save(IDENT, *entry(0)).path.stat().st_size


def published_bytes(root) -> int:
    return sum(size for _, size, _ in published_entries(root))


def test_bound_holds_and_lru_keeps_recently_used(tmp_path):
    size = entry_size(tmp_path)
    root = tmp_path / "store"
    root.mkdir()
    store = FSStore(root, max_bytes=5 * size)
    ids0 = entry(0)[0]
    for seed in range(12):
        store.save(IDENT, *entry(seed))
        assert published_bytes(root) <= 5 * size
        if seed >= 1:
            time.sleep(0.01)
            store.load(IDENT, ids0)  # keep entry 0 hot
            time.sleep(0.01)
    names = {p.name for p, _, _ in published_entries(root)}
    assert len(names) == 5
    assert fmt.entry_path(root, fmt.compute_key(IDENT, ids0)).name in names  # used: kept
    assert fmt.entry_path(root, fmt.compute_key(IDENT, entry(1)[0])).name not in names  # LRU: gone


def test_ttl_expires_old_entries_on_next_publish(tmp_path):
    store = FSStore(tmp_path, ttl_seconds=60)
    old = store.save(IDENT, *entry(1)).path
    past = time.time() - 3600
    os.utime(old, (past, past))
    new = store.save(IDENT, *entry(2)).path
    assert not old.exists() and new.exists()


def test_entry_larger_than_bound_is_not_published(tmp_path):
    size = entry_size(tmp_path)
    root = tmp_path / "store"
    root.mkdir()
    with pytest.raises(EntryTooLarge):
        FSStore(root, max_bytes=size - 1).save(IDENT, *entry(3))
    assert [p.name for p in root.iterdir() if p.name != fmt.LOCK_NAME] == []


def test_bounded_publish_evicts_only_entries(tmp_path):
    """Item 4: a user's files, a directory named x.safetensors and a symlink are never evicted or counted."""
    size = entry_size(tmp_path)
    root = tmp_path / "store"
    root.mkdir()
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w" * 100)
    users = [root / n for n in ("adapter_model.safetensors", "model.safetensors", "My Weights.safetensors")]
    for path in users:
        path.write_bytes(b"\0" * size)  # as big as an entry: counting them would evict more
    (root / "x.safetensors").mkdir()
    link = root / ("ab" * 16 + ".safetensors")
    link.symlink_to(weights)
    past = time.time() - 7200
    for path in (*users, root / "x.safetensors", weights):
        os.utime(path, (past, past))
    os.utime(link, (past, past), follow_symlinks=False)
    store = FSStore(root, max_bytes=3 * size, ttl_seconds=3600)
    for seed in range(6):
        store.save(IDENT, *entry(seed))
    assert len(published_entries(root)) == 3
    assert all(p.exists() and p.stat().st_mtime == past for p in users)
    assert (root / "x.safetensors").is_dir() and link.is_symlink() and weights.stat().st_mtime == past


def test_evict_prune_by_age_and_size(tmp_path):
    store = FSStore(tmp_path)
    paths = [store.save(IDENT, *entry(s)).path for s in range(4)]
    for age, path in zip((400, 300, 200, 100), paths):
        t = time.time() - age
        os.utime(path, (t, t))
    report = evict(tmp_path, ttl_seconds=250)
    assert sorted(report.removed) == sorted(p.name for p in paths[:2])
    report = evict(tmp_path, max_bytes=paths[3].stat().st_size)
    assert report.removed == [paths[2].name] and paths[3].exists()


def test_full_disk_below_the_bound_recovers_by_evicting_first(tmp_path):
    """max_bytes above the real free space: eviction runs before the write, so saves keep working."""
    from tmpfs import mounted_tmpfs

    big = 1 << 20  # ~1 MiB entries on a 4 MiB disk, bound 8 MiB
    with mounted_tmpfs(tmp_path / "disk", "4m") as disk:
        store = FSStore(disk, fsync=False, max_bytes=8 << 20)
        for seed in range(10):
            g = torch.Generator().manual_seed(seed)
            kv = torch.randn(2, 2, big // (2 * 2 * 2 * 32 * 4), 2, 32, generator=g)
            ids = [seed * 100_000 + i for i in range(kv.shape[2])]
            store.save(IDENT, ids, kv, torch.zeros(1, 64))
            assert store.load(IDENT, ids).kv.equal(kv)


# -- several processes on one directory --

def _producer(root: str, first_seed: int, count: int, max_bytes: int) -> None:
    store = FSStore(root, fsync=False, max_bytes=max_bytes)
    for seed in range(first_seed, first_seed + count):
        store.save(IDENT, *entry(seed))


def test_two_producers_share_one_bound(tmp_path):
    """Two P processes publish into one bounded dir; sampled under the lock, never over."""
    size = entry_size(tmp_path)
    root = tmp_path / "store"
    root.mkdir()
    bound = 4 * size
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_producer, args=(str(root), first, 40, bound)) for first in (1, 1000)]
    for p in procs:
        p.start()
    worst = samples = 0
    deadline = time.monotonic() + 300
    while any(p.is_alive() for p in procs):
        assert time.monotonic() < deadline, "the producers did not finish in 300 s"
        with store_lock(root):
            worst = max(worst, published_bytes(root))
        samples += 1
        time.sleep(0.005)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert samples > 5
    assert worst <= bound, f"store reached {worst} bytes, bound {bound}"


def _same_key_writer(root: str, seed: int, rounds: int) -> None:
    store = FSStore(root, fsync=False)
    ids = entry(0)[0]
    _, kv, hidden = entry(seed)
    for _ in range(rounds):
        store.save(IDENT, ids, kv, hidden)


def _evictor(root: str, rounds: int) -> None:
    for _ in range(rounds):
        evict(root, max_bytes=1)  # removes everything published
        time.sleep(0.001)


def test_same_key_publish_overwrite_and_eviction_race_a_reader(tmp_path):
    """Two producers overwrite one key with different KV while an evictor deletes it:
    every read is one producer's whole entry, or a miss. Never torn, never an error."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_same_key_writer, args=(str(tmp_path), seed, 150)) for seed in (7, 8)]
    procs.append(ctx.Process(target=_evictor, args=(str(tmp_path), 300)))
    for p in procs:
        p.start()
    store = FSStore(tmp_path)
    ids = entry(0)[0]
    valid = {entry(s)[1].sum().item() for s in (7, 8)}
    hits = misses = 0
    try:
        while any(p.is_alive() for p in procs):
            try:
                got = store.load(IDENT, ids)
            except FileNotFoundError:
                misses += 1
                continue
            assert got.kv.sum().item() in valid
            hits += 1
    finally:
        for p in procs:
            p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert hits > 0
