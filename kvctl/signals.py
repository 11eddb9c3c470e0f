"""Ctrl-C, SIGTERM and SIGHUP all mean "stop and clean up": the one place they become exceptions.

`signals_interrupt` turns them into KeyboardInterrupt (SIGTERM/SIGHUP as its
subclass Terminated), so `finally` blocks and cleanup run; `run_to_completion`
runs a cleanup with them ignored, so a second Ctrl-C cannot leave servers
running. Only the main thread can set handlers: elsewhere both are no-ops and
the caller owns signals.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP; handled exactly like Ctrl-C."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(signal.Signals(signum).name)


@contextlib.contextmanager
def _handlers(handlers: dict[signal.Signals, Any]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, h) for s, h in handlers.items()}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def signals_interrupt() -> contextlib.AbstractContextManager[None]:
    """Turn SIGINT, SIGTERM and SIGHUP into exceptions, so cleanup runs.

    SIGINT gets Python's own handler even when it was inherited as ignored
    (a background job of a non-interactive shell): a Ctrl-C or `kill -INT`
    sent to a launch must still stop the servers.
    """
    return _handlers({signal.SIGINT: signal.default_int_handler,
                      signal.SIGTERM: _raise_terminated, signal.SIGHUP: _raise_terminated})


def signals_ignored() -> contextlib.AbstractContextManager[None]:
    """Cleanup must finish: no signal of SIGNALS interrupts the block."""
    return _handlers({s: signal.SIG_IGN for s in SIGNALS})


def run_to_completion(cleanup: Callable[[], None]) -> None:
    """Run `cleanup` with signals ignored; a signal that slips in before the
    handlers are swapped restarts it (cleanup must be idempotent)."""
    while True:
        try:
            with signals_ignored():
                cleanup()
            return
        except KeyboardInterrupt:
            continue
