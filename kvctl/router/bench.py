"""The router's added latency per request, against instant fake P and D servers.

    python -m kvctl.router.bench [--requests 500] [--warmup 50] [--json]

Three processes: fake P and D servers (this module with `serve-fakes`: answer at
once, like a vLLM server with nothing to compute), the real router
(`python -m kvctl.router`), and this client (httpx, keep-alive). For each request
the client goes (a) directly, as a client without a router would: P with
max_tokens=1, then D; and (b) through the router, alternating a and b so that
drift hits both alike. Reported per mode (non-streamed; streamed, 16 SSE events,
read to the end): p50/p99/mean of each path and of the per-request difference,
the router's added latency. A front end: it prints its report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx
from aiohttp import web

from kvctl.net import NotHealthy, free_ports, wait_healthy
from kvctl.router.bodies import encode, prefill_request

MODULE = "kvctl.router.bench"
STREAM_EVENTS = 16


# --- the fakes (their own process) ---

async def _fake_completion(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    base = {"id": "chatcmpl-" + request.headers.get("X-Request-Id", "x"), "object": "chat.completion",
            "created": 1, "model": body.get("model")}
    if not body.get("stream"):
        return web.json_response({**base, "choices": [{"index": 0, "finish_reason": "length",
                                                       "message": {"role": "assistant", "content": "ok " * 8}}]})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    for _ in range(STREAM_EVENTS):
        chunk = {**base, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "ok "}}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _health(request: web.Request) -> web.Response:
    return web.Response()


async def _serve_fakes(ports: list[int]) -> None:
    runners = []
    for port in ports:
        app = web.Application()
        app.router.add_get("/health", _health)
        app.router.add_post("/v1/chat/completions", _fake_completion)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    print("ready", flush=True)
    await asyncio.Event().wait()


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
        fakes = subprocess.Popen([sys.executable, "-m", MODULE, "serve-fakes", str(p_port), str(d_port)],
                                 stdout=subprocess.PIPE, text=True)
        assert fakes.stdout is not None
        fakes.stdout.readline()  # "ready": the router's first health check finds them up
        router = subprocess.Popen([sys.executable, "-m", "kvctl.router", "--prefill", p_url,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    fakes = sub.add_parser("serve-fakes", help="(internal) serve instant fake P/D servers")
    fakes.add_argument("ports", type=int, nargs="+")
    parser.add_argument("--requests", type=int, default=500, help="measured requests per path and mode")
    parser.add_argument("--warmup", type=int, default=50, help="unmeasured requests first")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.cmd == "serve-fakes":
        asyncio.run(_serve_fakes(args.ports))
        return 0
    report = measure(args.requests, args.warmup)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"router added latency, {args.requests} requests per path (fake P/D answering at once)")
    print(f"{'mode':<14}{'path':<10}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}")
    for mode, rows in report["modes"].items():
        for name, key in (("direct", "direct_ms"), ("router", "router_ms"), ("added", "added_ms")):
            s = rows[key]
            print(f"{mode:<14}{name:<10}{s['p50']:>9.3f}{s['p99']:>9.3f}{s['mean']:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
