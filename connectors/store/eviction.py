"""Keep a store directory under `max_bytes`, and its entries younger than `ttl_seconds`.

Recency is the entry file's mtime: publishing sets it and every hit (a load
on the consumer, an already-stored send on the producer) touches it, so the
oldest mtime is the least recently used entry.

Removing an entry while a reader loads it is safe: a reader opens an entry
once and reads it whole through that descriptor, and unlinking removes only
the name (POSIX), so the reader still gets the complete file. Eviction
therefore needs no reader coordination.

Producers sharing a directory (several P instances) serialise "make room,
then publish" with an flock on `<root>/.kvctl-store.lock`, so the published
entries never exceed `max_bytes`, not even transiently. (Temp files being
written are not entries and are not counted.) No torch, no vLLM: `kvctl store
prune` uses the same code.

A publish costs the same with 100 or 100 000 entries: it does not list the
directory. The lock file holds the store's accounting (`Accounts`: bytes and
number of published entries, a lower bound of the oldest entry's mtime, and
publishes since the last full scan), which bounded writers update under the
lock; each writer keeps the least recently used entries of its last scan as
eviction candidates, and checks each candidate with one lstat before removing
it (one touched since is no longer least recently used and is skipped). The
directory is listed (`reconcile`) only when the accounts are missing or
damaged, on a process's first bounded publish, when the candidates run out,
and after every `count // RECONCILE_DIVISOR` publishes (amortised O(1) per
publish), so changes made behind the writers' backs (a reader deleting a
corrupt entry, `rm`, an unbounded writer, a backdated mtime) are seen soon.
The accounts only ever over-count between scans: bytes are added before an
entry is renamed into place and subtracted after it is removed, so a writer
killed at any moment leaves the bound held.

Only entries count and only entries are evicted: what an entry is, is the
format's one rule (`format.file_kind`: exact name, regular file by lstat), and
every removal goes through `format.remove_store_file`. A user's
`model.safetensors`, a directory named `x.safetensors` or a symlink are never
counted, removed or followed.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import os
import stat as stat_mod
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import xxhash

from connectors.store import format as fmt

RECONCILE_DIVISOR = 16  # a full scan every count // 16 publishes: amortised 16 lstats a publish
CANDIDATES_MIN = 4096  # least recently used entries a writer keeps from a scan (at least)
_ACCOUNTS = struct.Struct("<8sQQQqQ")  # magic, bytes, count, publishes since scan, oldest mtime ns, scans
_MAGIC = b"KVSTACC1"
_ACCOUNTS_SIZE = _ACCOUNTS.size + 8  # + xxh64 of the fields
# File times come from a coarse clock: an entry created just after time.time_ns() may carry an
# mtime a few ms earlier. Lower bounds taken from the clock are lowered by this much.
_CLOCK_MARGIN_NS = 1_000_000_000


class EntryTooLarge(fmt.StoreError):
    """An entry bigger than the whole bound: never published."""


@dataclass
class EvictionReport:
    removed: list[str] = field(default_factory=list)  # file names
    freed_bytes: int = 0
    total_bytes: int = 0  # published entries left


@contextlib.contextmanager
def store_lock(root: Path | str) -> Iterator[None]:
    """Exclusive lock over the store's publish + eviction (all processes sharing it)."""
    with _locked(root):
        yield


@contextlib.contextmanager
def _locked(root: Path | str) -> Iterator[int]:
    fd = os.open(os.path.join(os.fspath(root), fmt.LOCK_NAME),
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # closing releases the flock


# ---------------------------------------------------------------- listing

@dataclass(frozen=True, order=True)
class _Candidate:
    """An entry as a scan saw it; ordered by recency (oldest first)."""

    mtime_ns: int
    name: str
    stat: os.stat_result = field(compare=False)


def _scan(root: Path | str) -> list[_Candidate]:
    """Every published entry (the format's rule: name + regular file by lstat), unsorted."""
    found = []
    with os.scandir(root) as it:
        for item in it:
            if not fmt.is_entry_name(item.name):
                continue
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # evicted or replaced while we looked
            if fmt.file_kind(item.name, st) is fmt.FileKind.ENTRY:
                found.append(_Candidate(st.st_mtime_ns, item.name, st))
    return found


def _entries_oldest_first(root: Path | str) -> list[fmt.StoreFile]:
    root = Path(root)
    return [fmt.StoreFile(root / c.name, fmt.FileKind.ENTRY, c.stat) for c in sorted(_scan(root))]


def published_entries(root: Path | str) -> list[tuple[Path, int, float]]:
    """(path, bytes, mtime) of every published entry, oldest first (lstat only, headers not read)."""
    return [(f.path, f.stat.st_size, f.stat.st_mtime) for f in _entries_oldest_first(root)]


def evict(root: Path | str, *, max_bytes: int | None = None, ttl_seconds: float | None = None,
          incoming: int = 0, now: float | None = None) -> EvictionReport:
    """Remove expired entries, then the least recently used until `incoming` more bytes fit.

    Lists the whole directory (exact LRU: `kvctl store prune`). The caller
    holds `store_lock` when eviction must be atomic with a publish. Raises
    OSError when an entry cannot be removed (permissions).
    """
    now = time.time() if now is None else now
    entries = _entries_oldest_first(root)
    report = EvictionReport(total_bytes=sum(f.stat.st_size for f in entries))
    for found in entries:
        size = found.stat.st_size
        expired = ttl_seconds is not None and now - found.stat.st_mtime > ttl_seconds
        over = max_bytes is not None and report.total_bytes + incoming > max_bytes
        if not (expired or over):
            break  # oldest first: no newer entry is expired or needed for room either
        fmt.remove_store_file(found)  # False: another producer evicted or replaced it first
        report.removed.append(found.name)
        report.freed_bytes += size
        report.total_bytes -= size
    return report


# ---------------------------------------------------------------- the accounts in the lock file

@dataclass
class Accounts:
    """What the lock file records about the store (read and written under the lock only)."""

    total_bytes: int = 0
    count: int = 0
    since_scan: int = 0  # publishes since the last full scan
    oldest_ns: int = 0  # no entry's mtime is older (a lower bound; touches only make entries newer)
    scans: int = 0

    def pack(self) -> bytes:
        body = _ACCOUNTS.pack(_MAGIC, self.total_bytes, self.count, self.since_scan, self.oldest_ns,
                              self.scans)
        return body + xxhash.xxh64_digest(body)

    @classmethod
    def unpack(cls, raw: bytes) -> "Accounts | None":
        """The accounts in `raw`, or None when there are none (an old or empty lock file) or they are torn."""
        if len(raw) < _ACCOUNTS_SIZE:
            return None
        body, check = raw[:_ACCOUNTS.size], raw[_ACCOUNTS.size:_ACCOUNTS_SIZE]
        if xxhash.xxh64_digest(body) != check:
            return None
        magic, total, count, since, oldest, scans = _ACCOUNTS.unpack(body)
        if magic != _MAGIC:
            return None
        return cls(total, count, since, oldest, scans)


def read_accounts(root: Path | str) -> Accounts | None:
    """The accounts bounded writers keep in the lock file (None: none, or torn by a concurrent write).

    Does not take the lock (a caller may hold it: `store_lock`).
    """
    try:
        fd = os.open(os.path.join(os.fspath(root), fmt.LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return Accounts.unpack(os.pread(fd, _ACCOUNTS_SIZE, 0))
    finally:
        os.close(fd)


class BoundedPublish:
    """The PublishGuard of a bounded store (see format.write_entry).

    Thread-safe: its state changes only under the store lock, which each call
    takes on a descriptor of its own (flock excludes other descriptors of the
    same process too).
    """

    def __init__(self, root: Path | str, max_bytes: int | None, ttl_seconds: float | None):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.ttl_seconds = ttl_seconds
        self.last_report: EvictionReport | None = None
        self.scans = 0  # full scans this writer made (tests, benches)
        self._candidates: deque[_Candidate] | None = None  # None: this process has not scanned yet
        self._complete = False  # the candidates held every entry of the scan
        self._scan_ns = 0  # when the last scan began, less the clock margin
        self._tail_ns = 0  # the newest candidate's mtime: entries the scan did not keep are newer

    def before_write(self, nbytes: int) -> None:
        """Make room before writing, so the temp file fits under the bound too."""
        self._check_size(nbytes)
        with _locked(self.root) as fd:
            acc = self._accounts(fd)
            self._make_room(acc, nbytes)
            self._write(fd, acc)

    @contextlib.contextmanager
    def publishing(self, nbytes: int, final: str | None = None) -> Iterator[None]:
        """Held around the rename: room is made and the entry published under one lock.

        `final` is the entry's name: an entry already there (same key) is
        replaced, and its bytes stop counting once the rename succeeded.
        """
        with _locked(self.root) as fd:
            acc = self._accounts(fd)
            self._make_room(acc, nbytes)
            replaced = _entry_size(final) if final is not None else None
            acc.total_bytes += nbytes  # counted before the name appears: never under-counted
            acc.count += replaced is None
            acc.since_scan += 1
            acc.oldest_ns = min(acc.oldest_ns, time.time_ns() - _CLOCK_MARGIN_NS)
            self._write(fd, acc)
            yield
            if replaced:
                acc.total_bytes = max(0, acc.total_bytes - replaced)
                self._write(fd, acc)

    def free(self, nbytes: int) -> EvictionReport:
        """Evict least recently used entries until `nbytes` were freed (the disk was full)."""
        with _locked(self.root) as fd:
            acc = self._reconcile()
            self.last_report = report = EvictionReport(total_bytes=acc.total_bytes)
            target = max(0, acc.total_bytes - nbytes)
            self._evict_lru(acc, lambda: acc.total_bytes > target, report)
            self._write(fd, acc)
        return report

    # -- under the lock --

    def _accounts(self, fd: int) -> Accounts:
        """The store's accounts; a full scan when they are missing, stale or this writer has none."""
        acc = Accounts.unpack(os.pread(fd, _ACCOUNTS_SIZE, 0))
        if (acc is None or self._candidates is None
                or acc.since_scan >= max(1, acc.count // RECONCILE_DIVISOR)):
            acc = self._reconcile(acc)
        return acc

    def _reconcile(self, old: Accounts | None = None) -> Accounts:
        """List the directory: exact accounts, and this writer's eviction candidates."""
        self._scan_ns = time.time_ns() - _CLOCK_MARGIN_NS
        found = _scan(self.root)
        keep = max(CANDIDATES_MIN, len(found) // 4)
        oldest = heapq.nsmallest(keep, found) if keep < len(found) else sorted(found)
        self._candidates = deque(oldest)
        self._complete = len(oldest) == len(found)
        self._tail_ns = oldest[-1].mtime_ns if oldest else self._scan_ns
        self.scans += 1
        return Accounts(total_bytes=sum(c.stat.st_size for c in found), count=len(found), since_scan=0,
                        oldest_ns=oldest[0].mtime_ns if oldest else self._scan_ns,
                        scans=(old.scans if old else 0) + 1)

    def _make_room(self, acc: Accounts, incoming: int) -> None:
        report = EvictionReport(total_bytes=acc.total_bytes)
        if self.ttl_seconds is not None:
            cutoff = time.time_ns() - int(self.ttl_seconds * 1e9)
            if acc.oldest_ns < cutoff:
                self._expire(acc, cutoff, report)
        if self.max_bytes is not None and acc.total_bytes + incoming > self.max_bytes:
            self._evict_lru(acc, lambda: acc.total_bytes + incoming > self.max_bytes, report)
        if report.removed:
            self.last_report = report

    def _expire(self, acc: Accounts, cutoff: int, report: EvictionReport) -> None:
        """Remove every entry last used before `cutoff` (ns), oldest first."""
        rescanned = False
        while True:
            if not self._candidates:
                # Every entry left is newer than the scan (or than the candidates kept from it):
                # rescan once if those may have expired too.
                if rescanned or (self._scan_ns if self._complete else self._tail_ns) >= cutoff:
                    break
                fresh = self._reconcile(acc)
                acc.__dict__.update(fresh.__dict__)
                rescanned = True
                continue
            head = self._candidates[0]
            if head.mtime_ns >= cutoff:
                break
            self._candidates.popleft()
            now = _lstat(self.root / head.name)
            if now is None or now.st_mtime_ns >= cutoff or (now.st_dev, now.st_ino) != (head.stat.st_dev,
                                                                                            head.stat.st_ino):
                continue  # gone, used since, or another file now
            self._remove(acc, head, now, report)
        acc.oldest_ns = self._lower_bound()

    def _evict_lru(self, acc: Accounts, over, report: EvictionReport) -> None:
        """Remove least recently used entries while `over()`; rescans when the candidates run out."""
        rescanned = False
        while over():
            if not self._candidates:
                if rescanned:
                    break  # nothing left to evict
                fresh = self._reconcile(acc)
                acc.__dict__.update(fresh.__dict__)
                report.total_bytes = acc.total_bytes
                rescanned = True
                continue
            head = self._candidates.popleft()
            now = _lstat(self.root / head.name)
            if now is None:
                continue  # removed by someone else (a bounded writer accounted for it)
            if (now.st_dev, now.st_ino, now.st_mtime_ns) != (head.stat.st_dev, head.stat.st_ino,
                                                             head.stat.st_mtime_ns):
                continue  # used (touched) or replaced since the scan: no longer least recently used
            self._remove(acc, head, now, report)
        acc.oldest_ns = max(acc.oldest_ns, self._lower_bound())

    def _lower_bound(self) -> int:
        """No entry is older (ns): the oldest candidate left; every other entry is newer than it,
        was used since this writer's scan, or was published after it."""
        if self._candidates:
            return min(self._candidates[0].mtime_ns, self._scan_ns)
        return self._scan_ns if self._complete else self._tail_ns

    def _remove(self, acc: Accounts, cand: _Candidate, now: os.stat_result, report: EvictionReport) -> None:
        found = fmt.StoreFile(self.root / cand.name, fmt.FileKind.ENTRY, now)
        if fmt.remove_store_file(found):
            acc.total_bytes = max(0, acc.total_bytes - now.st_size)
            acc.count = max(0, acc.count - 1)
            report.removed.append(cand.name)
            report.freed_bytes += now.st_size
        report.total_bytes = acc.total_bytes

    @staticmethod
    def _write(fd: int, acc: Accounts) -> None:
        os.pwrite(fd, acc.pack(), 0)

    def _check_size(self, nbytes: int) -> None:
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise EntryTooLarge(f"entry of {nbytes} bytes exceeds max_bytes={self.max_bytes}")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st if fmt.file_kind(path.name, st) is fmt.FileKind.ENTRY else None


def _entry_size(path: str) -> int | None:
    """The size of the entry a rename to `path` replaces (None: nothing, or not an entry)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_size if stat_mod.S_ISREG(st.st_mode) else None
