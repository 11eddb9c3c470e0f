"""`python -m kvctl.router.fakes PORT...`: instant fake P/D servers for the router bench (kvctl.router.bench).

Each port gets /health and /v1/chat/completions that answer at once (streamed:
STREAM_EVENTS SSE events), like a vLLM server with nothing to compute. Prints
`ready` once every port listens; runs until killed.
"""

from __future__ import annotations

import asyncio
import json

import typer
from aiohttp import web

STREAM_EVENTS = 16
READY = "ready"


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
    typer.echo(READY)  # the parent waits for this line: every fake is listening
    await asyncio.Event().wait()


def main(ports: list[int] = typer.Argument(..., help="Ports to serve fakes on (127.0.0.1).")) -> None:
    asyncio.run(_serve_fakes(ports))


if __name__ == "__main__":
    typer.run(main)
