"""Bounded stores without a directory listing per publish: the accounts in the lock file.

Real files and real processes, no vLLM. What must hold (connectors/store/eviction.py):
- a publish does not list the store (one scan per writer, then every count // 16 publishes);
- the accounts equal the directory after bounded publishes, and only ever over-count
  (a writer killed at any moment, entries deleted behind the writers' backs);
- several processes publishing with one bound never exceed it, and LRU order holds;
- damaged or missing accounts are rebuilt by a scan; TTL expiry reaches entries
  published after a writer's last scan.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from connectors.store import eviction
from connectors.store import format as fmt
from connectors.store.eviction import BoundedPublish, published_entries, read_accounts, store_lock
from connectors.store.fs_store import FSStore

IDENT = fmt.KVIdentity(model="acc", num_layers=2, kv_parts=2, kv_heads=1, head_size=16, dtype="F16")
TOKENS = 4


def tokens_of(i: int) -> list[int]:
    return [i * TOKENS + t for t in range(TOKENS)]


def tensors(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.full((2, 2, TOKENS, 1, 16), float(i % 997), dtype=torch.float16)
    return kv, torch.zeros((1, 8), dtype=torch.float16)


def publish(store: FSStore, i: int):
    return store.save(IDENT, tokens_of(i), *tensors(i))


def entry_size(tmp_path: Path) -> int:
    probe = tmp_path / "probe"
    probe.mkdir(exist_ok=True)
    return publish(FSStore(probe, fsync=False), 0).path.stat().st_size


def fill(root: Path, first: int, last: int) -> None:
    """Publish entries first..last-1, each used one second after the one before (file times are coarse)."""
    store = FSStore(root, fsync=False)
    past = time.time() - 10_000
    for i in range(first, last):
        path = publish(store, i).path
        os.utime(path, (past + i - first, past + i - first))


def published_bytes(root: Path) -> int:
    return sum(size for _, size, _ in published_entries(root))


def key_name(i: int) -> str:
    return fmt.entry_path("/", fmt.compute_key(IDENT, tokens_of(i))).name


@pytest.fixture
def size(tmp_path) -> int:
    """The size of one published entry (all entries here are the same size)."""
    return entry_size(tmp_path)


@pytest.fixture
def root(tmp_path) -> Path:
    """An empty store directory."""
    root = tmp_path / "store"
    root.mkdir()
    return root


def test_publishes_do_not_list_the_store_and_accounts_stay_exact(root, size, monkeypatch):
    fill(root, 0, 320)
    scans = []
    real_scan = eviction._scan
    monkeypatch.setattr(eviction, "_scan", lambda r: scans.append(1) or real_scan(r))
    store = FSStore(root, fsync=False, max_bytes=320 * size)
    for i in range(1000, 1015):  # fewer than 320 // 16 publishes after the first scan
        publish(store, i)
    assert len(scans) == 1 and store.guard.scans == 1  # the writer's first publish, then none
    assert published_bytes(root) <= 320 * size
    names = {p.name for p, _, _ in published_entries(root)}
    assert len(names) == 320
    assert not any(key_name(i) in names for i in range(15))  # the 15 least recently used went
    assert all(key_name(i) in names for i in range(15, 320)) and key_name(1014) in names
    acc = read_accounts(root)
    assert (acc.total_bytes, acc.count) == (published_bytes(root), 320)
    for i in range(1015, 1030):  # past count // 16 = 20 publishes since the scan: one more
        publish(store, i)
    assert store.guard.scans == 2


def test_lru_skips_entries_used_since_the_scan(root, size):
    fill(root, 0, 40)
    past = time.time() - 1000
    for n, (path, _, _) in enumerate(sorted(published_entries(root), key=lambda e: e[0].name)):
        os.utime(path, (past + n, past + n))  # a known LRU order
    order = [p.name for p, _, _ in published_entries(root)]
    writer = FSStore(root, fsync=False, max_bytes=40 * size)
    publish(writer, 100)  # first publish: scans, evicts the oldest
    reader = FSStore(root)
    hot = next(i for i in range(40) if key_name(i) == order[1])
    reader.load(IDENT, tokens_of(hot))  # used after the writer's scan: no longer LRU
    publish(writer, 101)
    names = {p.name for p, _, _ in published_entries(root)}
    assert order[0] not in names and order[1] in names and order[2] not in names


def test_deletes_behind_the_writers_back_are_reconciled(root, size):
    fill(root, 0, 64)
    store = FSStore(root, fsync=False, max_bytes=64 * size)
    publish(store, 1000)
    for path, _, _ in published_entries(root)[:20]:
        path.unlink()  # rm, or a reader deleting corrupt entries: the accounts over-count
    acc = read_accounts(root)
    assert acc.total_bytes > published_bytes(root)
    for i in range(1001, 1001 + 64 // 16 + 1):
        publish(store, i)
        assert published_bytes(root) <= 64 * size
    acc = read_accounts(root)
    assert acc.total_bytes == published_bytes(root)
    assert acc.count == len(published_entries(root))


@pytest.mark.parametrize("damage", [b"", b"garbage" * 20, None])
def test_missing_or_damaged_accounts_are_rebuilt(root, size, damage):
    fill(root, 0, 50)
    lock = root / fmt.LOCK_NAME
    if damage is None:
        publish(FSStore(root, fsync=False, max_bytes=50 * size), 999)
        raw = bytearray(lock.read_bytes())
        raw[10] ^= 0xFF  # a torn or flipped byte: the checksum refuses it
        lock.write_bytes(bytes(raw))
    else:
        lock.write_bytes(damage)
    store = FSStore(root, fsync=False, max_bytes=50 * size)
    store.guard._candidates = []  # as if this writer had scanned before: only the accounts can trigger a scan
    scans = store.guard.scans
    publish(store, 1000)
    assert store.guard.scans == scans + 1
    assert published_bytes(root) <= 50 * size
    acc = read_accounts(root)
    assert acc.total_bytes == published_bytes(root)


def test_ttl_reaches_entries_published_after_the_last_scan(root):
    store = FSStore(root, fsync=False, ttl_seconds=1.5)
    for i in range(60):
        publish(store, i)
    time.sleep(2.6)  # ttl + the clock margin the lower bound allows for
    publish(store, 1000)
    assert [p.name for p, _, _ in published_entries(root)] == [key_name(1000)]


def test_replacing_an_entry_counts_it_once(root):
    store = FSStore(root, fsync=False, max_bytes=1 << 20)
    for _ in range(5):
        publish(store, 7)
    acc = read_accounts(root)
    assert (acc.total_bytes, acc.count) == (published_bytes(root), 1)


def test_bounded_publish_guard_directly_keeps_foreign_files(root, size):
    (root / "model.safetensors").write_bytes(b"\0" * size)
    guard = BoundedPublish(root, max_bytes=3 * size, ttl_seconds=None)
    for i in range(10):
        key = fmt.compute_key(IDENT, tokens_of(i))
        kv, hidden = tensors(i)
        blobs = {"token_ids": fmt.TensorBlob("I64", (TOKENS,), fmt.token_bytes(tokens_of(i))),
                 "kv": fmt.TensorBlob("F16", tuple(kv.shape), kv.view(torch.uint8).reshape(-1).numpy()),
                 "hidden": fmt.TensorBlob("F16", tuple(hidden.shape), hidden.view(torch.uint8).reshape(-1).numpy())}
        fmt.write_entry(root, key, IDENT, blobs, fsync=False, guard=guard)
    assert len(published_entries(root)) == 3 and (root / "model.safetensors").exists()


# -- several processes, crashes --

def _producer(root: str, first: int, count: int, bound: int) -> None:
    store = FSStore(root, fsync=False, max_bytes=bound)
    rng = random.Random(first)
    reader = FSStore(root)
    for i in range(first, first + count):
        publish(store, i)
        if rng.random() < 0.3:  # hits make entries recent: eviction must skip them
            try:
                reader.load(IDENT, tokens_of(rng.randrange(first, i + 1)))
            except FileNotFoundError:
                pass


def test_processes_share_one_bound_without_listing_per_publish(root, size):
    fill(root, 0, 200)
    bound = 200 * size
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_producer, args=(str(root), first, 150, bound))
             for first in (10_000, 20_000, 30_000)]
    for p in procs:
        p.start()
    worst = samples = 0
    while any(p.is_alive() for p in procs):
        with store_lock(root):
            worst = max(worst, published_bytes(root))
            acc = read_accounts(root)
            if acc is not None:
                assert acc.total_bytes >= published_bytes(root)  # never under-counted
        samples += 1
        time.sleep(0.01)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert samples > 3 and worst <= bound, (worst, bound)
    acc = read_accounts(root)
    assert acc.total_bytes == published_bytes(root) <= bound


def _endless_producer(root: str, first: int, bound: int, ready) -> None:
    store = FSStore(root, fsync=False, max_bytes=bound)
    ready.set()
    i = first
    while True:
        publish(store, i)
        i += 1


def test_killed_writers_leave_the_bound_held_and_the_accounts_over_counting(root, size):
    fill(root, 0, 40)
    bound = 40 * size
    ctx = mp.get_context("fork")
    rng = random.Random(5)
    for round_ in range(12):
        ready = ctx.Event()
        proc = ctx.Process(target=_endless_producer, args=(str(root), 100_000 * (round_ + 1), bound, ready),
                           daemon=True)
        proc.start()
        assert ready.wait(30)
        time.sleep(rng.uniform(0.01, 0.3))
        proc.kill()
        proc.join(10)
        with store_lock(root):
            assert published_bytes(root) <= bound
            acc = read_accounts(root)
            assert acc is None or acc.total_bytes >= published_bytes(root)
    # a new writer's first publish reconciles
    store = FSStore(root, fsync=False, max_bytes=bound)
    publish(store, 1)
    acc = read_accounts(root)
    assert acc.total_bytes == published_bytes(root) <= bound


def test_concurrent_threads_in_one_process(root, size):
    """FSStore is thread-safe: the guard's candidates change only under the (per-descriptor) flock."""
    store = FSStore(root, fsync=False, max_bytes=30 * size)
    errors = []

    def work(first: int) -> None:
        try:
            for i in range(first, first + 60):
                publish(store, i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(f,)) for f in (0, 1000, 2000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a publishing thread hung"
    assert not errors
    assert published_bytes(root) <= 30 * size
    assert read_accounts(root).total_bytes == published_bytes(root)
