"""FSConnector (V1) worker side: loads and saves off the forward path, each with a deadline.

vLLM's async contract (KVConnectorBase_V1), as this module keeps it:

- A load the scheduler offered with ``load_kv_async=True`` is submitted in
  `start_load_kv` and runs on the store I/O pool: read, verify (checksum,
  token ids), scatter into the request's blocks, layer by layer. Each poll
  (`get_finished`, once per engine step) reports the requests whose load
  ended, as finished receiving; a load that failed, or did not end by its
  deadline, also reports its blocks as failed in the same step, and vLLM's
  `kv_load_failure_policy` decides (recompute or fail). A load given up on
  can write nothing more: its scatter goes through a `WriteGate` that the
  poll closes (waiting out a layer write in progress) before reporting.
- A save is submitted in `wait_for_save`. First its pending marker is
  created (connectors.store.format: `.<key>.pending`, on a pool of its own so
  that it never queues behind a write) and waited for MARK_BUDGET_S at most,
  so it exists before the request's answer leaves: a decode instance that
  misses the entry meanwhile sees the marker and asks again instead of
  recomputing. A copy thread gathers the prompt's KV out of the paged cache
  (memory only, never the store), then the I/O pool publishes it (atomic:
  temp file, fsync, rename) and removes the marker after the rename (also
  when the write fails or is dropped; a marker the store never let us remove
  goes stale after the deadline, and readers ignore it). The
  scheduler's `request_finished` returned True for it, so vLLM holds the
  blocks until the poll reports the request as finished sending, which it
  does once the copy is done and vLLM has named the request finished. P's
  step never waits for the write or its fsync. A write that has not ended by
  its deadline is dropped (logged); if the store answers later, the entry it
  publishes is whole (rename) and logged as late.

The pools have fixed threads (connectors.store.deadline): a hung store holds
them, never more, and never the engine's threads. One watchdog thread drops
writes past their deadline while the engine is idle.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from connectors.store.deadline import LoadAbandoned, StoreCall, StoreCallPool, StoreTimeout, WriteGate

IO_THREADS = 2  # store I/O pool: loads and writes of one worker
MARK_THREADS = 1  # pending markers: created and removed off the I/O pool (never behind a write)
MARK_BUDGET_S = 0.05  # how long P's step waits for a save's pending marker (a create: well under 1 ms healthy)
COPY_TIMEOUT_S = 3600.0  # the copy thread never touches the store: no deadline of its own
MAX_PENDING_WRITES = 16  # saves waiting on the store beyond this are dropped (bounds copied memory)
WATCHDOG_INTERVAL_S = 0.1  # how often writes are checked against their deadline


@dataclass
class LoadJob:
    spec: Any  # connectors.v1.transfer.LoadSpec
    call: StoreCall
    gate: WriteGate
    blocks: set[int]  # the blocks this load writes (reported failed if it fails)
    started: float = field(default_factory=time.perf_counter)


@dataclass
class LoadOutcome:
    """How a load ended, for the connector's log line."""

    spec: Any
    result: Any = None  # load_fn's value when it succeeded
    error: BaseException | None = None  # else why it failed (StoreTimeout past the deadline)
    seconds: float = 0.0


@dataclass
class SaveJob:
    spec: Any  # connectors.v1.transfer.SaveSpec
    copy: StoreCall
    write: StoreCall | None = None
    mark: StoreCall | None = None  # the pending marker's creation (its value: the marker, None if not ours)
    dropped: bool = False  # given up on past its deadline
    started: float = field(default_factory=time.perf_counter)


class BackgroundTransfers:
    """One worker's loads and saves in flight (see the module docstring).

    `load_fn(spec, gate)` loads one request (writing only through `gate`);
    `mark_fn(spec)` creates one save's pending marker and returns it (None:
    not created by this call); `unmark_fn(marker)` removes it;
    `gather_fn(spec)` copies one prompt's KV out of the paged cache;
    `write_fn(spec, kv, job)` publishes it; `on_load(outcome)` and
    `on_save_dropped(job, error)` log. Every callable may raise; what they
    raise is reported, never lost.
    """

    def __init__(self, timeout_s: float, load_fn: Callable, gather_fn: Callable, write_fn: Callable,
                 on_load: Callable[[LoadOutcome], None], on_save_dropped: Callable[[SaveJob, str], None],
                 mark_fn: Callable, unmark_fn: Callable):
        self.io = StoreCallPool("fs-store-io", IO_THREADS, timeout_s)
        self.marker = StoreCallPool("fs-store-mark", MARK_THREADS, timeout_s)
        self.copier = StoreCallPool("fs-kv-copy", 1, COPY_TIMEOUT_S)
        self._mark_fn, self._unmark_fn = mark_fn, unmark_fn
        self._load_fn, self._gather_fn, self._write_fn = load_fn, gather_fn, write_fn
        self._on_load, self._on_save_dropped = on_load, on_save_dropped
        self._loads: dict[str, LoadJob] = {}
        self._held: dict[str, SaveJob] = {}  # saves whose blocks vLLM holds for us
        self._writes: list[SaveJob] = []  # saves whose write has not ended
        self._finished: set[str] = set()  # requests vLLM named finished whose copy is not done
        self._failed_blocks: set[int] = set()
        self._writes_lock = threading.Lock()
        # Writes past their deadline are dropped (and logged) on time even when the engine is idle.
        self._watchdog = threading.Thread(target=self._watch_writes, name="fs-store-watchdog", daemon=True)
        self._stopping = threading.Event()
        self._watchdog.start()

    # ------------------------------------------------------------ loads

    def start_load(self, spec: Any, blocks: set[int]) -> None:
        gate = WriteGate()
        stalled = self.io.stalled()
        if stalled:  # a call is stuck past its deadline: fail this load now (reported at the next poll)
            call = StoreCall(_failed_future(StoreTimeout(self.io.timeout_ms, stalled)), 0.0, self.io.timeout_ms)
        else:
            call = self.io.submit(self._load_fn, spec, gate)
        self._loads[spec.req_id] = LoadJob(spec, call, gate, blocks)

    def _poll_loads(self) -> set[str]:
        ended = set()
        now = time.monotonic()
        for req_id, job in list(self._loads.items()):
            if job.call.done():
                try:
                    outcome = LoadOutcome(job.spec, result=job.call.future.result())
                except BaseException as e:
                    outcome = LoadOutcome(job.spec, error=e)
            elif job.call.expired(now):
                job.gate.close()
                outcome = LoadOutcome(job.spec, error=job.call.give_up())
            else:
                continue
            outcome.seconds = time.perf_counter() - job.started
            if outcome.error is not None:
                self._failed_blocks |= job.blocks
            del self._loads[req_id]
            ended.add(req_id)
            self._on_load(outcome)
        return ended

    # ------------------------------------------------------------ saves

    def start_saves(self, specs: list) -> None:
        """Queue each prompt's copy (then write), after its pending marker exists (MARK_BUDGET_S at most).

        The markers of one step are created together and waited for with one
        budget: the step ends (and the requests' answers leave) once they
        exist or the budget is spent. A slow or hung store costs one step
        MARK_BUDGET_S at most; while a marker's creation runs past the budget,
        later saves do not wait for theirs.
        """
        jobs = [job for job in (self._start_save(spec) for spec in specs) if job is not None]
        budget_end = time.monotonic() + MARK_BUDGET_S
        for job in jobs:
            if job.mark is not None:
                job.mark.wait(max(0.0, budget_end - time.monotonic()))

    def _start_save(self, spec: Any) -> SaveJob | None:
        """Mark and queue one save; None when dropped at once (the store stalled, too many writes pending)."""
        self._reap_writes()
        stalled = self.io.stalled()
        if stalled or len(self._writes) >= MAX_PENDING_WRITES:
            job = SaveJob(spec, StoreCall(_done_future(None), 0.0, 0.0), dropped=True)
            self._held[spec.req_id] = job
            self._on_save_dropped(job, str(StoreTimeout(self.io.timeout_ms, stalled)) if stalled else
                                  f"{len(self._writes)} saves still wait for the store")
            return None
        job = SaveJob(spec, StoreCall(_done_future(None), 0.0, 0.0))
        if not self.marker.stalled(MARK_BUDGET_S):  # else a marker creation is slow: no marker for this one
            job.mark = self.marker.submit(self._mark_fn, spec)
        job.copy = self.copier.submit(self._copy_then_write, job)
        self._held[spec.req_id] = job
        with self._writes_lock:
            self._writes.append(job)
        return job

    def _copy_then_write(self, job: SaveJob) -> None:
        try:
            kv = self._gather_fn(job.spec)  # the blocks are read here and nowhere later
        except BaseException:
            self.marker.submit(self._unmark, job)
            raise
        if job.dropped:
            self.marker.submit(self._unmark, job)
        else:
            job.write = self.io.submit(self._write_unless_dropped, job, kv)

    def _write_unless_dropped(self, job: SaveJob, kv: Any) -> Any:
        try:
            if job.dropped:
                return None
            return self._write_fn(job.spec, kv, job)
        finally:
            self._unmark(job)  # after the rename (or the failure): a reader finds the entry, or nothing

    def _unmark(self, job: SaveJob) -> None:
        """Remove the save's pending marker, if its creation made one (waiting for that, to its deadline)."""
        mark, job.mark = job.mark, None
        if mark is None or not mark.wait() or mark.future.cancelled() or mark.future.exception() is not None:
            return
        marker = mark.future.result()
        if marker is not None:
            self._unmark_fn(marker)

    def wait_copied(self, req_ids: set[str]) -> None:
        """Block until these requests' copies are done (their blocks are about to be reused: preemption)."""
        for req_id in req_ids:
            job = self._held.get(req_id)
            if job is not None:
                job.copy.future.exception()  # the copy never waits on the store

    def _poll_saves(self, finished_req_ids: set[str]) -> set[str]:
        self._finished |= finished_req_ids & self._held.keys()
        sending = {r for r in self._finished if self._held[r].copy.done()}
        for req_id in sending:
            job = self._held.pop(req_id)
            error = job.copy.future.exception()
            if error is not None and not job.dropped:
                job.dropped = True
                self._on_save_dropped(job, f"copying the KV out of the cache failed: {type(error).__name__}: {error}")
        self._finished -= sending
        self._reap_writes()
        return sending

    def _watch_writes(self) -> None:
        while not self._stopping.wait(WATCHDOG_INTERVAL_S):
            if self._writes:
                self._reap_writes()

    def _reap_writes(self) -> None:
        with self._writes_lock:
            self._reap_writes_locked()

    def _reap_writes_locked(self) -> None:
        now = time.monotonic()
        pending = []
        for job in self._writes:
            if job.dropped or (job.copy.done() and job.write is None):
                continue  # dropped, or the copy failed (reported with the request)
            call = job.write if job.write is not None else job.copy
            if call.done():
                continue  # write_fn logged its own outcome
            if job.write is not None and job.write.expired(now):
                job.dropped = True
                self._on_save_dropped(job, str(job.write.give_up()))
                if job.write.future.cancelled():  # never started: nothing else removes its marker
                    self.marker.submit(self._unmark, job)
                continue
            pending.append(job)
        self._writes = pending

    # ------------------------------------------------------------ per step

    def poll(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) request ids; failed blocks go to take_failed_blocks."""
        return self._poll_saves(set(finished_req_ids or ())), self._poll_loads()

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    @property
    def in_flight(self) -> tuple[int, int]:
        """(loads, writes) not yet ended."""
        return len(self._loads), len(self._writes)

    def shutdown(self) -> None:
        self._stopping.set()
        for job in self._loads.values():
            job.gate.close()
        self.io.shutdown()
        self.marker.shutdown()
        self.copier.shutdown()


def _done_future(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _failed_future(error: BaseException) -> Future:
    f: Future = Future()
    f.set_exception(error)
    return f


__all__ = ["BackgroundTransfers", "LoadAbandoned", "LoadOutcome", "SaveJob", "StoreTimeout", "WriteGate"]
