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

Only entries count and only entries are evicted: what an entry is, is the
format's one rule (`format.file_kind`: exact name, regular file by lstat), and
every removal goes through `format.remove_store_file`. A user's
`model.safetensors`, a directory named `x.safetensors` or a symlink are never
counted, removed or followed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from connectors.store import format as fmt


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
    fd = os.open(Path(root) / fmt.LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _entries_oldest_first(root: Path | str) -> list[fmt.StoreFile]:
    entries = [f for f in fmt.list_store(root) if f.kind is fmt.FileKind.ENTRY]
    entries.sort(key=lambda f: f.stat.st_mtime)
    return entries


def published_entries(root: Path | str) -> list[tuple[Path, int, float]]:
    """(path, bytes, mtime) of every published entry, oldest first (lstat only, headers not read)."""
    return [(f.path, f.stat.st_size, f.stat.st_mtime) for f in _entries_oldest_first(root)]


def evict(root: Path | str, *, max_bytes: int | None = None, ttl_seconds: float | None = None,
          incoming: int = 0, now: float | None = None) -> EvictionReport:
    """Remove expired entries, then the least recently used until `incoming` more bytes fit.

    The caller holds `store_lock` when eviction must be atomic with a publish.
    Raises OSError when an entry cannot be removed (permissions).
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


class BoundedPublish:
    """The PublishGuard of a bounded store (see store_format.write_entry)."""

    def __init__(self, root: Path | str, max_bytes: int | None, ttl_seconds: float | None):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.ttl_seconds = ttl_seconds
        self.last_report: EvictionReport | None = None

    def before_write(self, nbytes: int) -> None:
        """Make room before writing, so the temp file fits under the bound too."""
        self._check_size(nbytes)
        with store_lock(self.root):
            self._evict(nbytes)

    @contextlib.contextmanager
    def publishing(self, nbytes: int) -> Iterator[None]:
        """Held around the rename: room is made and the entry published under one lock."""
        with store_lock(self.root):
            self._evict(nbytes)
            yield

    def free(self, nbytes: int) -> EvictionReport:
        """Evict least recently used entries until `nbytes` were freed (the disk was full)."""
        with store_lock(self.root):
            total = sum(size for _, size, _ in published_entries(self.root))
            self.last_report = evict(self.root, max_bytes=max(0, total - nbytes))
        return self.last_report

    def _evict(self, incoming: int) -> None:
        self.last_report = evict(self.root, max_bytes=self.max_bytes,
                                 ttl_seconds=self.ttl_seconds, incoming=incoming)

    def _check_size(self, nbytes: int) -> None:
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise EntryTooLarge(f"entry of {nbytes} bytes exceeds max_bytes={self.max_bytes}")
