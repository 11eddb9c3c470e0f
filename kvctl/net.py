"""Loopback ports and /health waits: what every start of an HTTP server here needs.

`free_ports` picks ports for servers kvctl starts (a launch's instances and its
router, the bench's plain server, the router bench's fakes). `wait_healthy`
polls servers' processes and their `/health` until every one answers 200; the
callers (a launch, `bench serve`'s plain server, the router bench) turn a
`NotHealthy` into their own error and progress lines.

Library code: nothing here prints or logs. May import: httpx.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping

import httpx

HEALTH_TIMEOUT_S = 2.0  # one /health request
POLL_S = 0.5  # how often the processes and /health are checked

# name -> (base URL, exited): `exited()` is None while the process runs, else how it ended
Servers = Mapping[str, tuple[str, Callable[[], str | None]]]


class NotHealthy(Exception):
    """A server that exited (`exited` says how) or was not healthy in time (`exited` is None)."""

    def __init__(self, name: str, exited: str | None, ready: dict[str, float]):
        super().__init__(f"{name} {exited}" if exited else f"{name} was not healthy in time")
        self.name = name
        self.exited = exited
        self.ready = ready  # the servers healthy before, with their seconds


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (all held open together while choosing)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def answers_health(client: httpx.Client, url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """True when GET `url`/health answers 200 (False on any HTTP error)."""
    return unhealthy_reason(client, url, timeout_s) is None


def unhealthy_reason(client: httpx.Client, url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """Why `url`/health does not answer 200 (None when it does): the HTTP error or status, and the
    error message when the body has one (a kvctl router names the instances it holds unhealthy, and why)."""
    try:
        resp = client.get(f"{url}/health", timeout=timeout_s)
    except httpx.HTTPError as e:
        return f"{url}/health: {type(e).__name__}"
    if resp.status_code == 200:
        return None
    try:
        error = resp.json().get("error")
    except ValueError:
        error = None
    message = error.get("message") if isinstance(error, dict) else None
    return f"{url}/health answers {resp.status_code}" + (f": {message}" if message else "")


def wait_healthy(servers: Servers, timeout_s: float, *, t0: float | None = None, poll_s: float = POLL_S,
                 on_poll: Callable[[float, dict[str, float]], None] | None = None) -> dict[str, float]:
    """Poll each server's process and /health until all answer 200; seconds from `t0` to each one's 200.

    `on_poll(elapsed_s, ready)` runs after each pass (`ready`: the servers healthy
    so far, with their seconds). Raises NotHealthy for the first server that
    exits, or, `timeout_s` after `t0` (default: now), the first not yet healthy.
    """
    t0 = time.monotonic() if t0 is None else t0
    ready: dict[str, float] = {}
    with httpx.Client() as client:
        while True:
            for name, (url, exited) in servers.items():
                if name in ready:
                    continue
                how = exited()
                if how is not None:
                    raise NotHealthy(name, how, ready)
                if answers_health(client, url):
                    ready[name] = time.monotonic() - t0
            elapsed = time.monotonic() - t0
            if on_poll:
                on_poll(elapsed, dict(ready))
            if len(ready) == len(servers):
                return ready
            if elapsed > timeout_s:
                raise NotHealthy(next(n for n in servers if n not in ready), None, ready)
            time.sleep(poll_s)
