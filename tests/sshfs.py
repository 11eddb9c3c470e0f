"""A real network filesystem for the store-across-hosts tests: sshfs over an sshd on loopback.

`scripts/ensure-sshfs.sh` installs openssh-server and sshfs (once), makes the
keys and starts the sshd (idempotent); `sshfs_mount` mounts a directory
through it the way a decode host mounts the prefill host's store, and always
unmounts. Without root or FUSE the tests are skipped, and fail instead under
KVCTL_REQUIRE_SSHFS=1 (make test).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ensure-sshfs.sh"
REQUIRE = os.environ.get("KVCTL_REQUIRE_SSHFS") == "1"
# What a mount caches decides how soon D sees what P published (docs/store-format.md,
# "Network filesystems"): sshfs's defaults, the options the docs recommend, and a negative
# lookup cache (as NFS's default lookupcache=all has) that hides a new entry after a miss.
DEFAULT_OPTIONS = ""
RECOMMENDED_OPTIONS = "dir_cache=no,entry_timeout=0,attr_timeout=0,negative_timeout=0"
NEGATIVE_CACHE_OPTIONS = "negative_timeout=3"


def _unavailable(why: str) -> None:
    if REQUIRE:
        pytest.fail(f"sshfs test cannot run (KVCTL_REQUIRE_SSHFS=1): {why}")
    pytest.skip(why)


def ensure_sshd(state: Path) -> int:
    """The port of the loopback sshd (started when it is not running). Skips/fails without it."""
    if os.geteuid() != 0:
        _unavailable("sshfs over a loopback sshd needs root (apt-get, sshd, /dev/fuse)")
    proc = subprocess.run(["bash", str(SCRIPT), str(state)], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        _unavailable(f"ensure-sshfs.sh failed: {proc.stderr.strip()[-500:]}")
    return int(proc.stdout.split()[-1])


@contextlib.contextmanager
def sshfs_mount(state: Path, port: int, export: Path, mnt: Path, options: str = DEFAULT_OPTIONS) -> Iterator[Path]:
    """`export` mounted on `mnt` through the loopback sshd (as another host would), unmounted after."""
    mnt.mkdir(parents=True, exist_ok=True)
    opts = (f"IdentityFile={state / 'client_key'},StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,"
            f"BatchMode=yes" + (f",{options}" if options else ""))
    proc = subprocess.run(["sshfs", "-p", str(port), "-o", opts, f"root@127.0.0.1:{export}", str(mnt)],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        _unavailable(f"sshfs mount failed: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["fusermount", "-u", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["fusermount", "-u", "-z", str(mnt)], check=False)
