"""Entries get the mode the store directory's policy asks for, whatever the writer's umask
(format.entry_mode); tested with real users: a writer and a reader sharing a group through a
setgid directory, and a user outside the group, whose reads fail (a recompute, not garbage).

The users are plain uids/gids in forked children (no accounts needed); the store code is
imported before the fork (this python's files may not be readable by them).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from array import array
from pathlib import Path

import pytest

from connectors.store import format as fmt

IDENTITY = fmt.KVIdentity(model="m", num_layers=1, kv_parts=2, kv_heads=1, head_size=4, dtype="F32")
GROUP, WRITER, READER, OUTSIDER = 61000, 61001, 61002, 61003

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")


def as_user(uid: int, groups: list[int], umask: int, work) -> dict:
    """`work()` in a forked child running as `uid` (primary group groups[0]) with `umask`; its result."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become the user, work, report, exit
        try:
            os.close(read_fd)
            os.setgroups(groups)
            os.setgid(groups[0])
            os.setuid(uid)
            os.umask(umask)
            try:
                result = {"ok": work()}
            except Exception as e:  # noqa: BLE001 - reported to the parent
                result = {"error": type(e).__name__, "errno": getattr(e, "errno", None), "text": str(e)}
            os.write(write_fd, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return json.loads(out)


def publish(root: Path, tokens: list[int]):
    def work():
        n = len(tokens)
        blobs = {"token_ids": fmt.TensorBlob("I64", (n,), fmt.token_bytes(tokens)),
                 "kv": fmt.TensorBlob("F32", (1, 2, n, 1, 4), array("f", [0.25] * (8 * n))),
                 "hidden": fmt.TensorBlob("F32", (1, 4), array("f", [0.5] * 4))}
        path = fmt.write_entry(root, fmt.compute_key(IDENTITY, tokens), IDENTITY, blobs, fsync=False)
        return str(path)
    return work


def read(path: str):
    return lambda: fmt.read_entry(path)[0].num_tokens


@pytest.fixture
def top():
    """A directory every user may traverse (pytest's tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="kvctl-perm-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def shared(top):
    """A store shared by a group: root:GROUP, mode 2770 (setgid: entries get the group)."""
    root = top / "store"
    root.mkdir()
    os.chown(root, 0, GROUP)
    os.chmod(root, 0o2770)
    return root


def test_shared_group_setgid_store_readable_by_the_group_whatever_the_umask(shared):
    assert fmt.entry_mode(shared) == 0o640
    made = as_user(WRITER, [WRITER, GROUP], 0o077, publish(shared, [1, 2, 3]))
    assert "ok" in made, made
    path = Path(made["ok"])
    st = path.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o640, WRITER, GROUP)
    assert as_user(READER, [READER, GROUP], 0o022, read(str(path))) == {"ok": 3}
    # Outside the group: the directory keeps it out, and so does the entry's mode.
    outsider = as_user(OUTSIDER, [OUTSIDER], 0o022, read(str(path)))
    assert outsider["error"] == "PermissionError", outsider
    os.chmod(shared, 0o2775)  # the directory now lets others in: entries follow (0644)
    assert fmt.entry_mode(shared) == 0o644
    later = Path(as_user(WRITER, [WRITER, GROUP], 0o077, publish(shared, [4, 5]))["ok"])
    assert stat.S_IMODE(later.stat().st_mode) == 0o644
    assert as_user(OUTSIDER, [OUTSIDER], 0o022, read(str(later))) == {"ok": 2}
    assert [n for n in os.listdir(shared) if not fmt.is_entry_name(n)] == []  # no temp files


def test_private_store_keeps_entries_to_their_owner(top):
    root = top / "private"
    root.mkdir()
    os.chown(root, WRITER, WRITER)
    os.chmod(root, 0o700)
    assert fmt.entry_mode(root) == 0o600
    path = Path(as_user(WRITER, [WRITER], 0o000, publish(root, [7, 8]))["ok"])  # even with umask 000
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
