"""Reading an instance's log file from a remembered offset, and waiting for a line to show up.

Each request remembers where P's and D's logs ended when it started and reads
only what came after, so concurrent requests never see each other's start.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

LOG_WAIT_S = 5.0  # how long a log line may lag behind the HTTP response
LOG_POLL_S = 0.1


class LogFile:
    """An instance's log file, read from a remembered byte offset onwards."""

    def __init__(self, path: Path | str):
        self.path = Path(path)

    def offset(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def read_from(self, offset: int) -> str:
        """Text logged since `offset` (from the start if the file was truncated)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(0, 2)
                if f.tell() < offset:
                    offset = 0
                f.seek(offset)
                return f.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""


def poll(read: Callable[[], Any], done: Callable[[Any], bool], timeout_s: float) -> Any:
    """Call read() until done(value) or timeout; returns the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(LOG_POLL_S)
