"""A size-limited tmpfs for tests that need a disk that fills up (we run as root)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """Mount a `size` tmpfs on `mnt`, always unmounted after. Fails under CI=true if not permitted."""
    mnt.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        why = f"cannot mount a tmpfs (need root or CAP_SYS_ADMIN): {proc.stderr.strip()}"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
