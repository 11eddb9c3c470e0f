"""connectors.store.atomic.write_atomic: whole or not at all, a unique temp name, no temp left behind."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from connectors.store import atomic
from connectors.store.atomic import write_atomic


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(atomic.TEMP_SUFFIX))


def test_replaces_the_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old")
    assert write_atomic(target, '{"new": 1}\n') == target
    assert target.read_text() == '{"new": 1}\n'
    write_atomic(target, b"\x00\x01bytes")
    assert target.read_bytes() == b"\x00\x01bytes"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("failing", ["write", "fsync", "replace"])
def test_a_failure_keeps_the_old_file_and_removes_the_temp(tmp_path, monkeypatch, failing):
    target = tmp_path / "marker.json"
    target.write_text("old")

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, failing, boom)
    with pytest.raises(OSError):
        write_atomic(target, "new", fsync=True)
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert _leftovers(tmp_path) == []


def test_an_interrupt_removes_the_temp_too(tmp_path, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "x", "new")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_fsync_is_the_callers_choice(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    write_atomic(tmp_path / "a", "x")
    assert calls == []
    write_atomic(tmp_path / "a", "y", fsync=True)
    assert len(calls) == 1


def test_temp_names_are_unique_per_call(tmp_path):
    names = {atomic.temp_path(tmp_path / "f").name for _ in range(50)}
    assert len(names) == 50 and all(n.startswith(f".f.{os.getpid()}.") for n in names)


def test_concurrent_writers_in_one_process_never_share_a_temp(tmp_path):
    target = tmp_path / "cluster.json"
    errors = []

    def writer(i: int) -> None:
        try:
            for _ in range(30):
                write_atomic(target, f"writer {i}\n" * 100)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and not any(t.is_alive() for t in threads)
    text = target.read_text()
    assert text == text.splitlines(keepends=True)[0] * 100  # one writer's whole content
    assert _leftovers(tmp_path) == []


def test_mode_is_exact_and_set_before_the_content(tmp_path, monkeypatch):
    old_umask = os.umask(0o077)
    try:
        path = write_atomic(tmp_path / "tool", b"#!/bin/sh\n", mode=0o755)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    seen = []
    real_write = os.write
    monkeypatch.setattr(atomic.os, "write", lambda fd, data: (seen.append(stat.S_IMODE(os.fstat(fd).st_mode)),
                                                              real_write(fd, data))[1])
    write_atomic(tmp_path / "api_key", "secret\n", mode=0o600)
    assert seen and set(seen) == {0o600}
    assert stat.S_IMODE((tmp_path / "api_key").stat().st_mode) == 0o600
