"""Store calls with a deadline (connectors.store.deadline) against a real filesystem that hangs.

The store lives on a passthrough FUSE mount (tests/fuse_mount.py) whose
daemon is stopped: the calls block in the kernel, as on a stalled network
filesystem. Nothing here starts vLLM; the V1 connector's own hung-store test
is tests/test_hung_store_e2e.py.
"""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import pytest

from connectors.store import format as fmt
from connectors.store.deadline import LoadAbandoned, StoreCallPool, StoreTimeout, WriteGate
from connectors.v1 import transfer
from fuse_mount import hangable_mount

IDENT = fmt.KVIdentity(model="m;hidden=none", num_layers=1, kv_parts=2, kv_heads=1, head_size=4, dtype="F32")
TOKENS = list(range(10, 30))
TIMEOUT_S = 0.5


def _publish(root: Path) -> None:
    kv = bytes(4 * 2 * len(TOKENS) * 4)
    raw = fmt.token_bytes(TOKENS)
    blobs = {"token_ids": fmt.TensorBlob("I64", (len(TOKENS),), raw),
             "kv": fmt.TensorBlob("F32", (1, 2, len(TOKENS), 1, 4), kv),
             "hidden": fmt.TensorBlob("F32", (1, 0), b"")}
    fmt.write_entry(root, fmt.compute_key(IDENT, TOKENS), IDENT, blobs, fsync=False)


@pytest.fixture
def mount(tmp_path):
    with hangable_mount(tmp_path / "backing", tmp_path / "mnt") as m:
        yield m


def test_a_call_on_a_hung_mount_times_out_and_the_pool_recovers_with_the_same_threads(mount):
    _publish(mount.path)
    pool = StoreCallPool("t", 2, TIMEOUT_S)
    threads = {t.ident for t in pool.threads()}
    before = threading.active_count()
    check = pool.run(transfer.find_entry, mount.path, IDENT, TOKENS, 1)
    assert check.found and check.reason == ""  # the mount works
    mount.stop()
    try:
        begin = time.monotonic()
        with pytest.raises(StoreTimeout, match=r"the store did not answer within 500 ms"):
            pool.run(functools.partial(transfer.find_entry, full=False), mount.path, IDENT, TOKENS, 1)
        waited = time.monotonic() - begin
        assert TIMEOUT_S <= waited < TIMEOUT_S + 2.0, waited  # the deadline (on a loaded machine), not the hang
        assert pool.stalled() >= TIMEOUT_S * 1e3 and pool.busy == 1  # one thread stuck in the kernel
        # Queued behind nothing (a second thread is free) but on the same hung mount: times out too.
        with pytest.raises(StoreTimeout):
            pool.run(functools.partial(transfer.find_entry, full=False), mount.path, IDENT, TOKENS, 1)
        assert pool.busy == 2
        # Both threads stuck: a third call is queued, times out and is cancelled (never runs).
        third = pool.submit(transfer.find_entry, mount.path, IDENT, TOKENS, 1)
        with pytest.raises(StoreTimeout):
            third.result()
        assert third.future.cancelled()
    finally:
        mount.resume()
    deadline = time.monotonic() + 10
    while pool.busy and time.monotonic() < deadline:  # the stuck calls return once the daemon runs
        time.sleep(0.02)
    assert pool.busy == 0 and pool.stalled() == 0.0
    assert pool.run(transfer.find_entry, mount.path, IDENT, TOKENS, 1).found  # the store is used again
    assert {t.ident for t in pool.threads()} == threads and all(t.is_alive() for t in pool.threads())
    assert threading.active_count() == before  # no thread was started per call, none leaked
    pool.shutdown()


def test_the_header_check_reads_no_data_and_the_full_check_finds_damage(tmp_path):
    _publish(tmp_path)
    path = fmt.entry_path(tmp_path, fmt.compute_key(IDENT, TOKENS))
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # in the data section: the header and token ids still check out
    path.write_bytes(bytes(raw))
    assert transfer.find_entry(tmp_path, IDENT, TOKENS, 1, full=False).found
    full = transfer.find_entry(tmp_path, IDENT, TOKENS, 1)
    assert not full.found and full.reason.startswith("corrupt: checksum mismatch")
    other = transfer.find_entry(tmp_path, IDENT, TOKENS[:-1] + [7], 1, full=False)
    assert other.reason == "miss"


def test_a_closed_write_gate_refuses_writes_and_waits_for_one_in_progress():
    gate, written = WriteGate(), []
    started, release = threading.Event(), threading.Event()

    def slow_write(i):
        started.set()
        release.wait(5)
        written.append(i)

    t = threading.Thread(target=gate.write, args=(slow_write, 1))
    t.start()
    started.wait(5)
    closer = threading.Thread(target=gate.close)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive()  # close waits for the write in progress
    release.set()
    closer.join(5)
    t.join(5)
    with pytest.raises(LoadAbandoned):
        gate.write(written.append, 2)
    assert written == [1]
