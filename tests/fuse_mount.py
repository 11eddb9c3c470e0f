"""A real filesystem that can hang: tests/passthrough_fuse.py mounted, its daemon stopped at will.

`hangable_mount(backing, mountpoint)` mounts it and yields a `HangableMount`
whose `stop()` (SIGSTOP to the daemon) makes every call on the mount block in
the kernel, as a stalled network filesystem does, until `resume()` (SIGCONT).
The mount is always undone, the daemon resumed and ended, even when the test
fails. Needs fusermount3 and libfuse3 (scripts/ensure-fuse.sh installs them)
and mfusepy (the test extra); without them the test is skipped, unless
KVCTL_REQUIRE_FUSE=1 (make test) makes that a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

DAEMON = Path(__file__).with_name("passthrough_fuse.py")


def require_fuse() -> None:
    """Skip (or fail, under KVCTL_REQUIRE_FUSE=1) when FUSE cannot be mounted here."""
    missing = []
    if shutil.which("fusermount3") is None:
        missing.append("fusermount3 (Debian fuse3)")
    if not Path("/dev/fuse").exists():
        missing.append("/dev/fuse")
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: libfuse not found by its ctypes loader
        missing.append(f"mfusepy ({e})")
    if missing:
        why = "FUSE is not usable here: " + ", ".join(missing) + " (scripts/ensure-fuse.sh installs it)"
        if os.environ.get("KVCTL_REQUIRE_FUSE") == "1":
            pytest.fail(why)
        pytest.skip(why)


@dataclass
class HangableMount:
    path: Path
    backing: Path
    daemon: subprocess.Popen

    def stop(self) -> None:
        os.kill(self.daemon.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.daemon.pid, signal.SIGCONT)


@contextlib.contextmanager
def hangable_mount(backing: Path, mountpoint: Path) -> Iterator[HangableMount]:
    require_fuse()
    backing.mkdir(parents=True, exist_ok=True)
    mountpoint.mkdir(parents=True, exist_ok=True)
    log = open(mountpoint.parent / f"{mountpoint.name}-fuse.log", "wb")
    daemon = subprocess.Popen([sys.executable, str(DAEMON), str(backing), str(mountpoint)],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not os.path.ismount(mountpoint):
            if daemon.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise RuntimeError(f"FUSE mount at {mountpoint} did not come up:\n"
                                   + (mountpoint.parent / f"{mountpoint.name}-fuse.log").read_text()[-2000:])
            time.sleep(0.05)
        yield HangableMount(mountpoint, backing, daemon)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(daemon.pid, signal.SIGCONT)
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True, timeout=30)
        daemon.terminate()
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=10)
        log.close()
