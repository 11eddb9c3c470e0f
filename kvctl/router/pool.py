"""One pool of instances per role: health, outstanding requests, and the choice. Pure.

An instance starts unhealthy ("not checked yet") and becomes healthy when its
/health answers 200. The health checker (health.py) and the request path
(app.py) report what they saw; the pool only keeps state and chooses:

    round_robin        the next healthy instance after the last one chosen
    least_outstanding  the healthy instance with the fewest requests in flight
                       (ties go round robin, so equal loads still rotate)

A connect error marks an instance down at once; a /health check that started
before that moment cannot bring it back (it may have been answered by the
process that just died), only a later one can. A check that answers with
another status, or cannot connect, marks it unhealthy at once too; one that
times out does so only once the instance has not answered 200 for a grace
period (RouterConfig.health_grace_s): on a loaded host a live server's /health
can take longer than the check's timeout for several seconds in a row, and an
instance marked unhealthy then turns requests it would have served into 503s.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvctl.router.config import InstanceConfig


@dataclass
class InstanceState:
    config: InstanceConfig
    healthy: bool = False
    reason: str = "not checked yet"  # why it is unhealthy (empty while healthy)
    outstanding: int = 0  # requests in flight on it now
    served: int = 0  # requests it has been chosen for
    changed_at: float = field(default_factory=time.monotonic)  # last health change
    down_at: float = float("-inf")  # last connect error (monotonic)
    ok_at: float = float("-inf")  # last /health check answered 200 (monotonic)
    missed: int = 0  # /health checks timed out in a row since then

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def url(self) -> str:
        return self.config.url

    def to_json(self) -> dict:
        return {"name": self.name, "role": self.config.role, "url": self.url,
                "healthy": self.healthy, "reason": self.reason or None,
                "outstanding": self.outstanding, "served": self.served}


class Pool:
    """The instances of one role and the policy that picks among them."""

    def __init__(self, role: str, instances: Iterable[InstanceConfig], policy: str):
        self.role = role
        self.policy = policy
        self.instances = [InstanceState(c) for c in instances]
        self._next = 0  # round robin: where the next search starts

    def __iter__(self) -> Iterator[InstanceState]:
        return iter(self.instances)

    def healthy(self) -> list[InstanceState]:
        return [i for i in self.instances if i.healthy]

    def pick(self, exclude: Iterable[InstanceState] = ()) -> InstanceState | None:
        """The instance for the next request, or None when no healthy one is left."""
        skip = {id(i) for i in exclude}
        n = len(self.instances)
        order = [self.instances[(self._next + k) % n] for k in range(n)]
        candidates = [i for i in order if i.healthy and id(i) not in skip]
        if not candidates:
            return None
        if self.policy == "least_outstanding":
            chosen = min(candidates, key=lambda i: i.outstanding)  # min keeps the first of equals
        else:
            chosen = candidates[0]
        self._next = (self.instances.index(chosen) + 1) % n
        return chosen

    @contextmanager
    def lease(self, inst: InstanceState) -> Iterator[InstanceState]:
        """Count a request on `inst` while the block runs."""
        inst.outstanding += 1
        inst.served += 1
        try:
            yield inst
        finally:
            inst.outstanding -= 1

    def unhealthy_summary(self) -> str:
        """`prefill-0 (http://...): connection refused; ...` for error messages."""
        return "; ".join(f"{i.name} ({i.url}): {i.reason}" for i in self.instances if not i.healthy)


def mark_down(inst: InstanceState, reason: str, now: float | None = None) -> bool:
    """A request could not connect: unhealthy at once. Returns True when it was healthy."""
    now = time.monotonic() if now is None else now
    was = inst.healthy
    inst.down_at = now
    inst.reason = reason
    if was:
        inst.healthy = False
        inst.changed_at = now
    return was


def record_check(inst: InstanceState, ok: bool, reason: str, started_at: float, *,
                 timed_out: bool = False, grace_s: float = 0.0, now: float | None = None) -> bool:
    """A /health check that started at `started_at` ended (`ok`: it answered 200).

    Returns True when the instance's health changed. A success from a check
    that started before the last connect error is ignored. A check that
    `timed_out` leaves a healthy instance healthy while its last 200 is less
    than `grace_s` old (`inst.missed` counts such checks); any other failure
    marks it unhealthy at once.
    """
    if ok and started_at < inst.down_at:
        return False
    now = time.monotonic() if now is None else now
    if ok:
        inst.ok_at, inst.missed = now, 0
    elif timed_out and inst.healthy and now - inst.ok_at < grace_s:
        inst.missed += 1
        return False
    if timed_out and inst.missed:
        reason = f"{reason} ({inst.missed + 1} checks in a row; no 200 for {now - inst.ok_at:.1f} s)"
    changed = inst.healthy != ok
    inst.healthy = ok
    inst.reason = "" if ok else reason
    if changed:
        inst.changed_at = now
    return changed
