"""The router's added latency per request, against instant fake P and D servers.

    kvctl bench router [--requests 500] [--warmup 50] [--json]

Three processes: fake P and D servers (`python -m kvctl.router.fakes`: answer at
once, like a vLLM server with nothing to compute), the real router
(`python -m kvctl.router`), and this client (httpx, keep-alive). For each request
the client goes (a) directly, as a client without a router would: P with
max_tokens=1, then D; and (b) through the router, alternating a and b so that
drift hits both alike. Reported per mode (non-streamed; streamed, 16 SSE events,
read to the end): p50/p99/mean of each path and of the per-request difference,
the router's added latency. Library code: `measure` returns the report
(kvctl.views.router renders it).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx

from kvctl.net import NotHealthy, free_ports, wait_healthy
from kvctl.router.bodies import encode, prefill_request

FAKES_MODULE = "kvctl.router.fakes"
ROUTER_MODULE = "kvctl.router"
REQUESTS = 500  # measured requests per path and mode
WARMUP = 50  # unmeasured requests first


# --- the measurement ---

def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    def exited() -> str | None:
        return None if proc.poll() is None else f"exited with {proc.returncode}"

    try:
        wait_healthy({url: (url, exited)}, timeout_s, poll_s=0.1)
    except NotHealthy as e:
        raise RuntimeError(f"{url} {e.exited}" if e.exited else
                           f"{url}/health did not answer 200 within {timeout_s} s") from None


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _summary(values: list[float]) -> dict[str, float]:
    return {"p50": round(_pct(values, 50), 3), "p99": round(_pct(values, 99), 3),
            "mean": round(statistics.fmean(values), 3)}


def _measure_mode(client: httpx.Client, p_url: str, d_url: str, r_url: str, stream: bool,
                  requests: int, warmup: int) -> dict:
    body = {"model": "fake", "messages": [{"role": "user", "content": "Why is the sky blue?"}],
            "max_tokens": 16, "temperature": 0.0, "stream": stream}
    raw, p_raw = encode(body), encode(prefill_request(body))
    headers = {"Content-Type": "application/json"}

    def post(url: str, data: bytes) -> None:
        with client.stream("POST", f"{url}/v1/chat/completions", content=data, headers=headers) as resp:
            resp.raise_for_status()
            for _ in resp.iter_raw():
                pass

    def direct() -> None:  # what a client without a router does
        post(p_url, p_raw)
        post(d_url, raw)

    def routed() -> None:
        post(r_url, raw)

    for _ in range(warmup):
        direct()
        routed()
    d_ms, r_ms = [], []
    for _ in range(requests):
        d_ms.append(_timed(direct))
        r_ms.append(_timed(routed))
    return {"direct_ms": _summary(d_ms), "router_ms": _summary(r_ms),
            "added_ms": _summary([r - d for r, d in zip(r_ms, d_ms)])}


def measure(requests: int, warmup: int) -> dict:
    """Start fakes and a router, measure both modes, stop them. Returns the report."""
    p_port, d_port, r_port = free_ports(3)
    p_url, d_url, r_url = (f"http://127.0.0.1:{p}" for p in (p_port, d_port, r_port))
    with tempfile.TemporaryFile() as router_log:  # the router logs a line per request, as in use
        fakes = subprocess.Popen([sys.executable, "-m", FAKES_MODULE, str(p_port), str(d_port)],
                                 stdout=subprocess.PIPE, text=True)
        assert fakes.stdout is not None
        fakes.stdout.readline()  # "ready": the router's first health check finds them up
        router = subprocess.Popen([sys.executable, "-m", ROUTER_MODULE, "--prefill", p_url,
                                   "--decode", d_url, "--port", str(r_port)],
                                  stdout=router_log, stderr=router_log)
        try:
            _wait_healthy(r_url, router)
            with httpx.Client(timeout=30) as client:
                modes = {mode: _measure_mode(client, p_url, d_url, r_url, mode == "streamed", requests, warmup)
                         for mode in ("non_streamed", "streamed")}
            return {"requests": requests, "warmup": warmup, "modes": modes}
        finally:
            for proc in (router, fakes):
                proc.terminate()
                proc.wait(10)
