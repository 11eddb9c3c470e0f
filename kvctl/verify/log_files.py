"""Reading an instance's log file from a remembered offset, and waiting for a line to show up.

Each request remembers where P's and D's logs ended when it started and reads
only what came after, so concurrent requests never see each other's start.

An attached instance's log may be a command's output (`cmd:kubectl logs -f ...`):
`capturing_logs` runs those commands for as long as verify runs, each into its
instance's log file, so the same offset-based reading applies. Each capture
file starts empty and verify starts only once a command's backlog has been
written, so lines logged before verify started never count.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from kvctl.signals import signals_interrupt
from kvctl.verify.cluster_info import ClusterInfo, InstanceInfo

log = logging.getLogger(__name__)

LOG_WAIT_S = 5.0  # how long a log line may lag behind the HTTP response
LOG_POLL_S = 0.1


class LogFile:
    """An instance's log file, read from a remembered byte offset onwards."""

    def __init__(self, path: Path | str | None):
        self.path = Path(path) if path is not None else None  # None: not observable, reads nothing

    @property
    def observable(self) -> bool:
        return self.path is not None

    def offset(self) -> int:
        if self.path is None:
            return 0
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def read_from(self, offset: int) -> str:
        """Text logged since `offset` (from the start if the file was truncated)."""
        if self.path is None:
            return ""
        try:
            with open(self.path, "rb") as f:
                f.seek(0, 2)
                if f.tell() < offset:
                    offset = 0
                f.seek(offset)
                return f.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""


class LogPool:
    """The logs of several instances of one role, read together.

    A request through the endpoint (the router) may land on any instance of a
    pool, so its evidence is looked for in all of their logs. Same interface
    as LogFile, with one offset per instance.
    """

    def __init__(self, instances: Sequence[InstanceInfo]):
        self.instances = tuple(instances)
        self.files = tuple(LogFile(i.log_path) for i in self.instances)

    @property
    def observable(self) -> bool:
        """At least one of the logs can be read."""
        return any(f.observable for f in self.files)

    @property
    def complete(self) -> bool:
        """Every one of the logs can be read."""
        return all(f.observable for f in self.files)

    @property
    def unobservable(self) -> str:
        """Which logs cannot be read, and why ("" when all can)."""
        return "; ".join(f"{i.label}: {i.unobservable}" for i, f in zip(self.instances, self.files)
                         if not f.observable)

    def offset(self) -> tuple[int, ...]:
        return tuple(f.offset() for f in self.files)

    def read_from(self, offsets: tuple[int, ...]) -> str:
        texts = [f.read_from(o) for f, o in zip(self.files, offsets)]
        return "".join(t if t.endswith("\n") or not t else t + "\n" for t in texts)

    def only(self, label: str, offsets: tuple[int, ...]) -> tuple[LogPool, tuple[int, ...]] | None:
        """The pool of just the instance named `label`, with its offset; None when none is.

        A request whose instance is known (the router named it) looks at that log only.
        """
        for k, inst in enumerate(self.instances):
            if inst.label == label:
                return LogPool([inst]), (offsets[k],)
        return None

    def holder(self, offsets: tuple[int, ...], line: str) -> str | None:
        """The label of the instance whose log has `line` since `offsets` (the first one), if any."""
        for inst, f, o in zip(self.instances, self.files, offsets):
            if line and line in f.read_from(o):
                return inst.label
        return None


def poll(read: Callable[[], Any], done: Callable[[Any], bool], timeout_s: float) -> Any:
    """Call read() until done(value) or timeout; returns the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(LOG_POLL_S)


# ------------------------------------------------------------------ log commands

CAPTURE_SETTLE_S = 0.5  # a command's backlog is written once its output has been quiet this long
CAPTURE_START_S = 10.0  # longest wait for that before the first request
CAPTURE_STOP_S = 3.0  # SIGTERM -> SIGKILL when the capture stops
_PR_SET_PDEATHSIG = 1  # prctl option: a signal for the child when its parent dies


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The capture command gets SIGTERM if kvctl itself is killed (SIGKILL leaves no finally)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the `finally` of capturing_logs still stops it


class LogCapture:
    """One instance's log command, its output (stdout and stderr) streamed into a file.

    The command runs with a shell in its own session and process group, so a
    Ctrl-C at the terminal reaches kvctl only, and `stop` ends the whole group.
    """

    def __init__(self, label: str, command: str, path: Path):
        self.label, self.command, self.path = label, command, path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the command; the file starts empty (old lines never count). Raises OSError."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "wb") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(["/bin/sh", "-c", self.command], stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        log.info("capturing the %s log: %s -> %s", self.label, self.command, self.path)

    def failure(self) -> str:
        """Why this capture shows nothing of the log ("" while it is running or ended cleanly)."""
        code = self.proc.poll() if self.proc is not None else None
        if code is None or code == 0:
            return ""
        tail = " | ".join(line.strip() for line in LogFile(self.path).read_from(0).splitlines()[-3:])
        return f"its log command exited with code {code}: {self.command}" + (f" (output: {tail})" if tail else "")

    def stop(self) -> None:
        """Stop the command's process group: SIGTERM, then SIGKILL. Idempotent."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, CAPTURE_STOP_S), (signal.SIGKILL, CAPTURE_STOP_S)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # the shell may be gone while a child it started lingers in the group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def _settle(captures: list[LogCapture]) -> None:
    """Wait until every capture's output has been quiet for CAPTURE_SETTLE_S (a command
    such as `kubectl logs -f` first prints the log so far: those lines must land before
    the first request notes where the log ends), at most CAPTURE_START_S."""
    sizes = {c.path: -1 for c in captures}
    quiet_since = time.monotonic()
    deadline = quiet_since + CAPTURE_START_S
    while True:
        now_sizes = {c.path: LogFile(c.path).offset() for c in captures}
        now = time.monotonic()
        if now_sizes != sizes:
            sizes, quiet_since = now_sizes, now
        if now - quiet_since >= CAPTURE_SETTLE_S or now >= deadline:
            return
        time.sleep(LOG_POLL_S)


@contextlib.contextmanager
def capturing_logs(info: ClusterInfo, every: bool = False) -> Iterator[ClusterInfo]:
    """Run the log commands of `info`'s prefill and decode (`every`: of all its instances,
    for requests through the endpoint) while the block runs.

    Yields the ClusterInfo to verify with: an instance whose command failed to
    start, or exited with an error before the first request, has no log
    (`log_path` None) and the reason in `unobservable`. Every command is
    stopped when the block ends, however it ends (Ctrl-C, SIGTERM and SIGHUP
    included). A cluster without log commands is yielded as it is.
    """
    candidates = (*info.all_instances(), info.prefill, info.decode) if every else (info.prefill, info.decode)
    chosen = {i.label: i for i in candidates if i.log_command and i.log_path is not None}
    if not chosen:
        yield info
        return
    captures: dict[str, LogCapture] = {}
    failed: dict[str, str] = {}
    with signals_interrupt():  # SIGTERM/SIGHUP unwind like Ctrl-C: the captures are stopped
        try:
            for label, inst in chosen.items():
                capture = LogCapture(label, inst.log_command or "", inst.log_path or Path())
                try:
                    capture.start()
                except OSError as e:
                    failed[label] = f"its log command could not start: {e}"
                    continue
                captures[label] = capture
            _settle(list(captures.values()))
            failed.update({label: why for label, c in captures.items() if (why := c.failure())})

            def seen(inst: InstanceInfo) -> InstanceInfo:
                why = failed.get(inst.label)
                return replace(inst, log_path=None, unobservable=why) if why else inst

            yield replace(info, prefill=seen(info.prefill), decode=seen(info.decode),
                          instances=tuple(seen(i) for i in info.instances))
        finally:
            for capture in captures.values():
                capture.stop()
