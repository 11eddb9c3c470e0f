"""Pending markers (`.<key>.pending`): what they are in a store, how readers and tools treat them,
and how a background save creates and removes them (no vLLM, no torch).

A V1 producer answers before its entry is published; the marker, created before the
answer leaves and removed after the rename, tells a reader that misses the entry
meanwhile to ask again instead of recomputing (docs/store-format.md, "Pending markers").
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from connectors.store import format as fmt
from connectors.v1 import background, transfer
from connectors.v1.background import BackgroundTransfers
from connectors.v1.transfer import SaveSpec
from kvctl.store.inspect import PENDING_GRACE_S, fix_store, inspect_store

IDENT = fmt.KVIdentity(model="m", num_layers=1, kv_parts=2, kv_heads=1, head_size=2, dtype="F32")
TOKENS = [5, 6, 7]
KEY = "0123456789abcdef0123456789abcdef"


def publish(root: Path, identity: fmt.KVIdentity, tokens=TOKENS) -> str:
    """A valid entry of `identity` for `tokens` (format-level, no torch); its key."""
    key = fmt.compute_key(identity, tokens)
    blobs = {"token_ids": fmt.TensorBlob("I64", (len(tokens),), fmt.token_bytes(tokens)),
             "kv": fmt.TensorBlob("F32", (1, 2, len(tokens), 1, 2), bytes(16 * len(tokens))),
             "hidden": fmt.TensorBlob("F32", (1, 0), b"")}
    fmt.write_entry(root, key, identity, blobs, fsync=False)
    return key


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


# ---------------------------------------------------------------- the format's rule

def test_a_marker_is_its_own_kind_never_an_entry_or_foreign(tmp_path):
    marker = fmt.create_pending(tmp_path, KEY, stale_after_s=2.0)
    assert marker is not None and marker.path == tmp_path / f".{KEY}.pending"
    assert marker.path.stat().st_size == 0
    assert fmt.file_kind(marker.name, os.lstat(marker.path)) is fmt.FileKind.PENDING
    (tmp_path / f".{KEY.upper()}.pending").write_bytes(b"")  # not the exact form: foreign
    os.symlink(marker.path, tmp_path / f".{'f' * 32}.pending")  # a symlink under a marker's name: foreign
    scan = fmt.scan_store(tmp_path)
    assert scan.pending == [marker.path] and not scan.entries and len(scan.foreign) == 2


def test_a_second_writer_of_the_same_key_does_not_own_the_marker(tmp_path):
    first = fmt.create_pending(tmp_path, KEY, stale_after_s=2.0)
    assert fmt.create_pending(tmp_path, KEY, stale_after_s=2.0) is None
    assert fmt.remove_store_file(first) and not first.path.exists()


def test_a_stale_marker_is_taken_over(tmp_path):
    first = fmt.create_pending(tmp_path, KEY, stale_after_s=2.0)
    age(first.path, 5.0)
    second = fmt.create_pending(tmp_path, KEY, stale_after_s=2.0)
    assert second is not None and fmt.pending_age(second) < 1.0
    # The dead writer's marker is gone; the new one is not its to remove (its owner removes it unchanged).
    assert not fmt.remove_store_file(first, unchanged=True)
    assert second.path.exists()


def test_a_marker_name_held_by_a_directory_is_left_alone(tmp_path):
    fmt.pending_path(tmp_path, KEY).mkdir()
    with pytest.raises(fmt.NameTaken):
        fmt.create_pending(tmp_path, KEY, stale_after_s=2.0)
    assert fmt.pending_path(tmp_path, KEY).is_dir()


def test_removing_a_marker_removes_only_that_same_file(tmp_path):
    first = fmt.create_pending(tmp_path, KEY, stale_after_s=2.0)
    os.unlink(first.path)
    time.sleep(0.05)  # past the filesystem clock's tick: the inode number may be reused, the mtime is not
    again = fmt.create_pending(tmp_path, KEY, stale_after_s=2.0)  # another save's marker now
    assert not fmt.remove_store_file(first, unchanged=True) and again.path.exists()


# ---------------------------------------------------------------- the reader (the scheduler's lookup)

def test_a_miss_with_a_fresh_marker_is_pending(tmp_path):
    own = transfer.lookup_identities(IDENT)[0]
    fmt.create_pending(tmp_path, fmt.compute_key(own, TOKENS), stale_after_s=2.0)
    check = transfer.find_entry(tmp_path, IDENT, TOKENS, 1, pending_s=2.0)
    assert check.pending and not check.found and check.reason.startswith("pending: its save is under way")
    assert check.key == fmt.compute_key(own, TOKENS)
    # Without pending_s (no waiting reader) the marker is not looked at: a plain miss.
    plain = transfer.find_entry(tmp_path, IDENT, TOKENS, 1)
    assert not plain.pending and plain.reason == "miss"


def test_a_stale_marker_is_a_miss_and_is_removed(tmp_path):
    own = transfer.lookup_identities(IDENT)[0]
    marker = fmt.create_pending(tmp_path, fmt.compute_key(own, TOKENS), stale_after_s=2.0)
    age(marker.path, 3.0)
    check = transfer.find_entry(tmp_path, IDENT, TOKENS, 1, pending_s=2.0)
    assert not check.pending and check.reason.startswith("miss (its pending marker was stale, 3.0 s old"), check
    assert not marker.path.exists()


def test_an_entry_wins_over_its_marker(tmp_path):
    own = transfer.lookup_identities(IDENT)[0]
    key = publish(tmp_path, own)
    fmt.create_pending(tmp_path, key, stale_after_s=2.0)
    check = transfer.find_entry(tmp_path, IDENT, TOKENS, 1, pending_s=2.0)
    assert check.found and not check.pending


def test_an_entry_published_between_the_two_looks_is_found(tmp_path, monkeypatch):
    """The writer renames, then removes its marker: a reader that missed the entry and then finds no
    marker looks again, and finds it."""
    own = transfer.lookup_identities(IDENT)[0]
    real = fmt.find_pending

    def publish_then_look(root, key):
        publish(tmp_path, own)  # the rename, and the marker's removal, happen between the reader's looks
        return real(root, key)

    monkeypatch.setattr(fmt, "find_pending", publish_then_look)
    check = transfer.find_entry(tmp_path, IDENT, TOKENS, 1, pending_s=2.0)
    assert check.found and check.identity == own


def test_a_v0_entry_is_found_without_looking_at_markers(tmp_path, monkeypatch):
    publish(tmp_path, IDENT)  # a V0 producer's full entry
    monkeypatch.setattr(fmt, "find_pending", lambda *a: pytest.fail("a hit looked for a marker"))
    assert transfer.find_entry(tmp_path, IDENT, TOKENS, 1, pending_s=2.0).found


def test_a_marker_of_another_rank_makes_the_prompt_pending(tmp_path):
    ranked = transfer.rank_identity(dataclass_replace(IDENT, tp_size=2), 0)
    own = transfer.lookup_identities(ranked)[0]
    publish(tmp_path, own)  # rank 0 published, rank 1 still saving
    rank1 = transfer.rank_identity(own, 1)
    fmt.create_pending(tmp_path, fmt.compute_key(rank1, TOKENS), stale_after_s=2.0)
    check = transfer.find_entry(tmp_path, ranked, TOKENS, 2, pending_s=2.0)
    assert check.pending, check


def dataclass_replace(identity, **changes):
    import dataclasses

    return dataclasses.replace(identity, **changes)


# ---------------------------------------------------------------- the tools

def test_inspect_lists_markers_and_check_fails_only_on_stale_ones(tmp_path):
    fresh = fmt.create_pending(tmp_path, KEY, stale_after_s=2.0)
    stale = fmt.create_pending(tmp_path, "f" * 32, stale_after_s=2.0)
    age(stale.path, PENDING_GRACE_S + 5)
    report = inspect_store(tmp_path)
    assert {m.path for m in report.pending} == {fresh.path, stale.path}
    assert [m.path for m in report.stale_pending] == [stale.path] and report.problems == 1
    doc = report.to_json()
    assert [m["file"] for m in doc["pending_markers"]] == sorted([fresh.name, stale.name])
    assert doc["num_stale_pending"] == 1 and doc["foreign_files"] == [] and doc["num_entries"] == 0
    fixed = fix_store(report)
    assert [p for p, _ in fixed.removed] == [stale.path]
    assert fresh.path in [p for p, _ in fixed.kept] and fresh.path.exists()
    assert inspect_store(tmp_path).problems == 0


def test_store_check_cli_names_a_stale_marker_and_fix_removes_it(tmp_path, kvctl):
    stale = fmt.create_pending(tmp_path, KEY, stale_after_s=2.0)
    age(stale.path, PENDING_GRACE_S + 5)
    res = kvctl("store", "check", str(tmp_path))
    assert res.rc == 1 and "1 stale pending marker(s)" in res.stdout and "--fix" in res.stdout, res
    res = kvctl("store", "check", str(tmp_path), "--fix", "--json")
    assert res.rc == 0 and json.loads(res.stdout)["passed"], res
    assert not stale.path.exists()


# ---------------------------------------------------------------- the writer (a background save)

class Saves:
    """BackgroundTransfers with real markers in `root` and a write that waits for `release`."""

    def __init__(self, root: Path, timeout_s: float = 2.0, mark_fn=None, gather_fn=None):
        self.root, self.release, self.dropped, self.written = root, threading.Event(), [], []
        self.bg = BackgroundTransfers(timeout_s, None, gather_fn or (lambda spec: b"kv"), self.write,
                                      None, lambda job, why: self.dropped.append(why),
                                      mark_fn or self.mark,
                                      lambda marker: fmt.remove_store_file(marker, unchanged=True))

    def key(self, spec: SaveSpec) -> str:
        return fmt.compute_key(IDENT, spec.token_ids)

    def mark(self, spec: SaveSpec):
        return fmt.create_pending(self.root, self.key(spec), stale_after_s=2.0)

    def write(self, spec: SaveSpec, kv, job) -> None:
        if not self.release.wait(10):
            raise OSError("never released")
        if kv == b"fail":
            raise OSError("ENOSPC")
        publish(self.root, IDENT, spec.token_ids)
        self.written.append(spec.req_id)

    def close(self) -> None:
        """Release the writes, shut the pools down and wait until every thread of theirs has exited."""
        self.release.set()
        self.bg.shutdown()
        threads = self.bg.io.threads() + self.bg.marker.threads() + self.bg.copier.threads() + [self.bg._watchdog]
        for t in threads:
            t.join(10)
        assert not [t.name for t in threads if t.is_alive()]

    def marker(self, spec: SaveSpec) -> Path:
        return fmt.pending_path(self.root, self.key(spec))

    def wait_gone(self, path: Path) -> bool:
        for _ in range(200):
            if not path.exists():
                return True
            time.sleep(0.01)
        return False


def spec(req_id: str, tokens=TOKENS) -> SaveSpec:
    return SaveSpec(req_id=req_id, token_ids=list(tokens), block_ids=[0])


def test_the_marker_exists_when_the_step_ends_and_goes_after_the_rename(tmp_path):
    saves = Saves(tmp_path)
    s = spec("r1")
    saves.bg.start_saves([s])
    marker = saves.marker(s)
    assert marker.exists() and not fmt.entry_path(tmp_path, saves.key(s)).exists()  # P may answer now
    saves.release.set()
    assert saves.wait_gone(marker)
    assert fmt.entry_path(tmp_path, saves.key(s)).exists() and saves.written == ["r1"]
    saves.close()


def test_a_failed_write_removes_its_marker(tmp_path):
    saves = Saves(tmp_path, gather_fn=lambda spec: b"fail")
    s = spec("r1")
    saves.bg.start_saves([s])
    assert saves.marker(s).exists()
    saves.release.set()
    assert saves.wait_gone(saves.marker(s)) and not saves.written
    saves.close()


def test_a_failed_copy_removes_its_marker(tmp_path):
    def gather(spec):
        raise RuntimeError("cache gone")

    saves = Saves(tmp_path, gather_fn=gather)
    s = spec("r1")
    saves.bg.start_saves([s])
    assert saves.wait_gone(saves.marker(s))
    saves.close()


def test_a_write_dropped_before_it_started_removes_its_marker(tmp_path, monkeypatch):
    """Two saves hold both I/O threads past the deadline; a third is queued, then given up on unstarted."""
    monkeypatch.setattr(background, "WATCHDOG_INTERVAL_S", 0.02)
    saves = Saves(tmp_path, timeout_s=0.3)
    specs = [spec(f"r{i}", [i, i + 1]) for i in range(3)]
    saves.bg.start_saves(specs)
    assert all(saves.marker(s).exists() for s in specs)
    time.sleep(0.3 + 0.3)
    assert len(saves.dropped) == 3, saves.dropped  # every write past its deadline: dropped, logged
    assert saves.wait_gone(saves.marker(specs[2]))  # never started: its marker removed at once
    assert saves.marker(specs[0]).exists()  # a write still running keeps its marker until it returns
    saves.release.set()
    assert saves.wait_gone(saves.marker(specs[0])) and saves.wait_gone(saves.marker(specs[1]))
    saves.close()


def test_a_hung_marker_costs_one_step_the_budget_and_later_steps_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(background, "MARK_BUDGET_S", 0.4)  # well above this machine's scheduling noise
    hang = threading.Event()

    def mark(spec):
        hang.wait(10)  # the store stopped answering
        return None

    saves = Saves(tmp_path, mark_fn=mark)
    begin = time.monotonic()
    saves.bg.start_saves([spec("r1")])
    first = time.monotonic() - begin
    time.sleep(background.MARK_BUDGET_S)
    begin = time.monotonic()
    saves.bg.start_saves([spec("r2", [1, 2]), spec("r3", [3, 4])])
    later = time.monotonic() - begin
    assert background.MARK_BUDGET_S <= first < background.MARK_BUDGET_S + 0.5, first
    assert later < background.MARK_BUDGET_S / 2, later  # a marker creation is slow: not waited behind
    hang.set()
    saves.release.set()
    saves.close()


def test_one_budget_for_a_step_of_several_saves(tmp_path, monkeypatch):
    monkeypatch.setattr(background, "MARK_BUDGET_S", 0.2)

    def slow_mark(spec):
        time.sleep(0.5)
        return None

    saves = Saves(tmp_path, mark_fn=slow_mark)
    begin = time.monotonic()
    saves.bg.start_saves([spec(f"r{i}", [i, i + 1]) for i in range(4)])
    assert 0.2 <= time.monotonic() - begin < 0.2 + 0.4  # one budget, not 4 x 0.2
    saves.release.set()
    saves.close()
