"""The background health checker: GET /health on every instance, every interval.

200 means healthy; anything else (another status, a connect error, a timeout)
means unhealthy, with the reason kept for /health and error messages, except
that a timeout is forgiven for `grace_s` after the instance's last 200
(pool.record_check: a live server on a loaded host answers late). Each change
is logged once (`instance prefill-0 (URL) is healthy` / `... is unhealthy:
REASON`), and so is the first forgiven timeout of a run of them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable

import aiohttp

from kvctl.router.pool import InstanceState, record_check

log = logging.getLogger(__name__)


def describe(e: BaseException) -> str:
    """A short reason for a failed upstream call: `connection refused`, `timed out`, ..."""
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    if isinstance(e, aiohttp.ClientConnectorError):
        err = e.os_error
        if err is not None and err.errno and err.errno > 0:
            text = os.strerror(err.errno)  # "Connection refused", not asyncio's wording
        elif err is not None and err.strerror:
            text = err.strerror  # a name lookup: "Name or service not known"
        else:
            text = str(err or e)
        return f"cannot connect: {text.lower()}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def log_change(inst: InstanceState) -> None:
    if inst.healthy:
        log.info("instance %s (%s) is healthy", inst.name, inst.url)
    else:
        log.warning("instance %s (%s) is unhealthy: %s", inst.name, inst.url, inst.reason)


async def check_instance(session: aiohttp.ClientSession, inst: InstanceState, timeout_s: float,
                         grace_s: float = 0.0) -> None:
    """One /health request; the result goes into `inst` (and a change is logged). A timeout
    leaves a healthy instance healthy until `grace_s` have passed since its last 200."""
    started = time.monotonic()
    timed_out = False
    try:
        async with session.get(f"{inst.url}/health",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            ok, reason = resp.status == 200, f"/health answered {resp.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        ok, reason, timed_out = False, describe(e), isinstance(e, asyncio.TimeoutError)
    if record_check(inst, ok, reason, started, timed_out=timed_out, grace_s=grace_s):
        log_change(inst)
    elif inst.missed == 1 and inst.healthy:
        log.warning("instance %s (%s): /health timed out after %g s; still healthy until %g s without a 200",
                    inst.name, inst.url, timeout_s, grace_s)


async def check_all(session: aiohttp.ClientSession, instances: Iterable[InstanceState],
                    timeout_s: float, grace_s: float = 0.0) -> None:
    await asyncio.gather(*(check_instance(session, i, timeout_s, grace_s) for i in instances))


async def run_health_checks(session: aiohttp.ClientSession, instances: list[InstanceState],
                            interval_s: float, timeout_s: float, grace_s: float = 0.0) -> None:
    """Check each instance every `interval_s`, each on its own loop, until cancelled.

    A hung instance (a check waiting for its timeout) never delays the others.
    """
    async def one(inst: InstanceState) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await check_instance(session, inst, timeout_s, grace_s)

    await asyncio.gather(*(one(i) for i in instances))
