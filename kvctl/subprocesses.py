"""Run a command while its output streams line by line, keeping the tail for an error.

One runner serves the rig install (pip), the base-image build (mmdebstrap) and
the rig-side benches: each line goes to a callback as it arrives (a log file,
a progress display), and the last TAIL_LINES lines come back for the error's
details. Whatever interrupts the caller (an exception, Ctrl-C) kills the
command first: nothing keeps running behind kvctl's back.

Standard library only: `kvctl.provision.rig` imports this inside an image
build, where the bare system python has none of kvctl's dependencies.
"""

from __future__ import annotations

import collections
import os
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

TAIL_LINES = 30  # lines of a command's (or a server's) output carried in an error's details


@dataclass
class Streamed:
    """How a streamed command ended."""

    returncode: int
    tail: list[str]  # its last TAIL_LINES streamed lines
    stdout: str = ""  # stdout, when it was captured apart from the streamed stderr
    timed_out: bool = False  # killed after `timeout_s`

    @property
    def details(self) -> str:
        return "\n".join(self.tail)


def run_streamed(argv: Sequence[str], on_line: Callable[[str], None], *,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
                 input_text: str | None = None, capture_stdout: bool = False,
                 timeout_s: float | None = None, tail_lines: int = TAIL_LINES) -> Streamed:
    """Run `argv`, handing each output line (without its newline) to `on_line`.

    The streamed lines are stdout and stderr together, or stderr alone with
    `capture_stdout` (stdout is then read whole, into `Streamed.stdout`).
    `input_text` is written to its stdin, which is closed after it (without
    it, stdin is /dev/null). After `timeout_s` the command is killed and
    `timed_out` is set. Raises OSError (FileNotFoundError for a missing
    program) when it cannot start; any exception while it runs, Ctrl-C
    included, kills and reaps it before propagating.
    """
    proc = subprocess.Popen(
        list(argv), stdin=subprocess.DEVNULL if input_text is None else subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE if capture_stdout else subprocess.STDOUT,
        text=True, errors="replace", env=None if env is None else dict(env), cwd=cwd)
    streamed = proc.stderr if capture_stdout else proc.stdout
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    stdout: list[str] = []
    reader = None
    if capture_stdout:  # read apart, so a full stdout pipe never blocks the stderr lines
        reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()), daemon=True)
        reader.start()
    timed_out = threading.Event()

    def kill_on_timeout() -> None:  # a hung command must not hang kvctl
        timed_out.set()
        proc.kill()

    watchdog = threading.Timer(timeout_s, kill_on_timeout) if timeout_s is not None else None
    if watchdog is not None:
        watchdog.start()
    try:
        if input_text is not None:
            proc.stdin.write(input_text)
            proc.stdin.close()
        for line in streamed:
            line = line.rstrip("\n")
            tail.append(line)
            on_line(line)
        rc = proc.wait()
    finally:
        if watchdog is not None:
            watchdog.cancel()
        if proc.poll() is None:  # interrupted: do not leave it running
            proc.kill()
            proc.wait()
        if reader is not None:
            reader.join(timeout=10)
    return Streamed(rc, list(tail), "".join(stdout), timed_out.is_set())
