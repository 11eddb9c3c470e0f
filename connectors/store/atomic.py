"""Replacing a small file whole or not at all: the one temp-file-then-rename writer.

A reader sees the old content or the new, never half a file: the bytes go to a
temp file beside the target (a unique name: concurrent writers, even in one
process, never share one), which is renamed over it. On any failure, an
interrupt included, the temp file is removed and the error raised.

Store entries are not written here: connectors.store.format's publish has its
own rules (the entry's temp-name pattern, O_NOFOLLOW, the eviction guard around
the rename). Standard library only: kvctl's rig recipe runs this in a bare python.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def temp_path(path: Path) -> Path:
    """A fresh temp name beside `path`: hidden, this process's pid, random."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, fsync: bool = False,
                 mode: int | None = None) -> Path:
    """Replace `path` with `data` (text is UTF-8) atomically; returns the path.

    fsync: flush the data to disk before the rename, so a crash leaves the old
    file or the whole new one (without it a crash may leave an empty file; the
    rename itself is atomic either way). mode: the file's permission bits,
    exactly (umask ignored), set before any byte is written: 0o600 keeps a
    secret unreadable by others even for a moment. None: 0o666 less the umask.
    """
    path = Path(path)
    tmp = temp_path(path)
    payload = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600 if mode is not None else 0o666)
    try:
        try:
            if mode is not None:
                os.fchmod(fd, mode)
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path
