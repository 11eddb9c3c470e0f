"""Store calls with a deadline, on a fixed pool of daemon threads.

A call on a stalled filesystem (a network mount whose server stopped
answering, a FUSE daemon that is stopped) blocks its thread in the kernel, and
nothing in Python can take it back. So the engine never makes a store call on
its own thread: it submits the call here and looks at it again later, or
waits for it at most until its deadline. Past the deadline the caller gives up
on the call (D recomputes, P drops the save) and serving goes on.

The pool has a fixed number of threads, started once: a hung store holds at
most that many, no thread is started per call (nothing leaks), calls queued
behind the stuck ones time out in turn (queue time counts against the
deadline) and, when not yet started, are cancelled so that they never run.
Once the store answers again, the stuck threads finish their call and return
to work. While a call is stuck past its deadline the pool reports itself
`stalled`: callers then give up at once instead of queueing behind it, so only
the requests that met the stall wait for a deadline, and the first call that
returns ends it. Threads are daemons: a process shutting down does not wait for a
call the store never answers.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable


class StoreTimeout(TimeoutError):
    """A store call did not finish within its deadline (or was not made: the store is stalled)."""

    def __init__(self, timeout_ms: float, stalled_ms: float = 0.0):
        tail = f" (not asked: a call is waiting for it since {stalled_ms:.0f} ms)" if stalled_ms else ""
        super().__init__(f"the store did not answer within {timeout_ms:.0f} ms{tail}")
        self.timeout_ms = timeout_ms


class StoreCall:
    """One submitted call: its future and its deadline (time.monotonic seconds)."""

    def __init__(self, future: Future, deadline: float, timeout_ms: float):
        self.future = future
        self.deadline = deadline
        self.timeout_ms = timeout_ms

    def done(self) -> bool:
        return self.future.done()

    def expired(self, now: float | None = None) -> bool:
        """Past the deadline and not finished (a finished call never expires)."""
        return not self.future.done() and (time.monotonic() if now is None else now) >= self.deadline

    def wait(self, budget_s: float | None = None) -> bool:
        """Wait at most `budget_s` (None: until the deadline) for the call; True when it finished."""
        limit = max(0.0, self.deadline - time.monotonic())
        if budget_s is not None:
            limit = min(limit, budget_s)
        try:
            self.future.exception(timeout=limit)
        except TimeoutError:
            return False
        except BaseException:  # cancelled
            return True
        return True

    def result(self) -> Any:
        """The call's value once done (re-raises its exception); StoreTimeout when it did not finish in time."""
        if not self.wait():
            self.future.cancel()  # never runs, if still queued
            raise StoreTimeout(self.timeout_ms)
        return self.future.result()

    def give_up(self) -> StoreTimeout:
        """Abandon the call (cancelled if still queued; a running one finishes on its own); the error to report."""
        self.future.cancel()
        return StoreTimeout(self.timeout_ms)


class StoreCallPool:
    """`threads` daemon threads running submitted store calls, each with `timeout_s` to finish."""

    def __init__(self, name: str, threads: int, timeout_s: float):
        if threads < 1 or timeout_s <= 0:
            raise ValueError(f"a store call pool needs threads >= 1 and a positive timeout, got {threads}, {timeout_s}")
        self.name = name
        self.timeout_s = timeout_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        self._busy = 0
        self._running: dict[int, float] = {}  # thread ident -> when its current call started (monotonic)
        self._lock = threading.Lock()
        self._closed = False
        for t in self._threads:
            t.start()

    @property
    def timeout_ms(self) -> float:
        return self.timeout_s * 1e3

    def submit(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> StoreCall:
        """Queue `fn(*args)`; its deadline is now + timeout_s (default: the pool's)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        future: Future = Future()
        if self._closed:
            future.set_exception(RuntimeError(f"{self.name}: pool is shut down"))
        else:
            self._queue.put((future, fn, args))
        return StoreCall(future, time.monotonic() + timeout, timeout * 1e3)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the pool, waiting at most the deadline. Raises StoreTimeout or what fn raises."""
        return self.submit(fn, *args).result()

    @property
    def busy(self) -> int:
        """Threads inside a call now (stuck ones included)."""
        return self._busy

    def stalled(self, after_s: float | None = None) -> float:
        """How long the oldest call still running has run, in ms, when that is past `after_s`
        (default: the deadline); else 0."""
        with self._lock:
            oldest = min(self._running.values(), default=None)
        if oldest is None:
            return 0.0
        age = time.monotonic() - oldest
        return age * 1e3 if age >= (self.timeout_s if after_s is None else after_s) else 0.0

    def threads(self) -> list[threading.Thread]:
        return list(self._threads)

    def shutdown(self) -> None:
        """Stop taking calls; idle threads exit, stuck ones when their call returns (never joined)."""
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue  # given up on before it started
            me = threading.get_ident()
            with self._lock:
                self._busy += 1
                self._running[me] = time.monotonic()
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the caller, never lost
                future.set_exception(e)
            finally:
                with self._lock:
                    self._busy -= 1
                    del self._running[me]


class LoadAbandoned(Exception):
    """The caller gave up on this load (its deadline passed): it must not write into the cache any more."""


class WriteGate:
    """Lets one load write into the paged cache until the caller that gave up on it closes it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open = True

    def write(self, fn: Callable[..., None], *args: Any) -> None:
        """Run one cache write, or raise LoadAbandoned once closed."""
        with self._lock:
            if not self._open:
                raise LoadAbandoned()
            fn(*args)

    def close(self) -> None:
        """No write after this returns (a write in progress finishes first: memory only, bounded)."""
        with self._lock:
            self._open = False
