"""The P/D router (kvctl.router) end to end: real sockets, fake vLLM servers, the openai SDK.

Fake P and D servers are small aiohttp apps that answer like vLLM's OpenAI server
(chat and completions, streamed as SSE or not) and record what they got: each
body byte for byte, its headers, and whether the caller went away mid-answer.
The router runs for real on loopback (in-process on a background loop, or as a
`python -m kvctl.router` subprocess); clients are the `openai` SDK and httpx.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
from aiohttp import web
from multidict import CIMultiDictProxy
from prometheus_client.parser import text_string_to_metric_families

from kvctl.cluster.router_process import router_instance
from kvctl.cluster.router_process import start_router as start_launched_router
from kvctl.net import free_ports, unhealthy_reason
from kvctl.router.app import LISTENING, RunningRouter, start_router
from kvctl.router.config import build_config
from kvctl.router.route_log import parse_route_line

openai = pytest.importorskip("openai")

MODEL = "fake-model"
WAIT_S = 10.0  # generous: the machine may be busy


# --- a loop in a thread: the fakes and the in-process router live there ---

class Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def aloop() -> Iterator[Loop]:
    loop = Loop()
    yield loop
    loop.close()


# --- a fake vLLM OpenAI server ---

@dataclass
class Got:
    method: str
    path: str
    headers: CIMultiDictProxy  # case-insensitive, as received
    body: bytes
    at: float = field(default_factory=time.monotonic)

    def json(self) -> dict:
        return json.loads(self.body)


def tokens_for(body: dict) -> list[str]:
    """The fake's deterministic answer: max_tokens tokens derived from the prompt."""
    prompt = body.get("prompt") or " ".join(m.get("content", "") for m in body.get("messages", []))
    seed = sum(prompt.encode()) % 97
    n = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    return [f"t{(seed + i) % 97} " for i in range(n)]


class FakeVLLM:
    """Answers like `vllm serve`; `status`/`body` override the answer, `fail_after` cuts it."""

    def __init__(self, role: str, *, api_key: str | None = None, model: str = MODEL):
        self.role = role
        self.api_key = api_key
        self.model = model
        self.got: list[Got] = []
        self.status = 200  # a non-200 answers every completion with `error_json`
        self.error_json: bytes = b'{"object":"error","message":"bad","type":"BadRequestError","param":null,"code":400}'
        self.health_status = 200
        self.health_hits = 0  # GET /health requests answered (the router's checks)
        self.health_delay_s = 0.0  # before answering /health (a live server on a loaded host)
        self.delay_s = 0.0  # before answering a completion
        self.chunk_delay_s = 0.0  # between streamed chunks
        self.fail_after: int | None = None  # cut the connection after this many chunks
        # Fields added to a non-streamed answer, from the request's body (NIXL's P answers
        # with kv_transfer_params).
        self.answer_fields: Callable[[dict, str], dict] = lambda body, rid: {}
        self.closed_early: list[str] = []  # request ids whose caller went away mid-answer
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def completions(self) -> list[Got]:
        return [g for g in self.got if g.path.startswith("/v1/") and g.method == "POST"]

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/completions", self._completion)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Close the listening socket and every connection: a killed server."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        self.health_hits += 1
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        return web.Response(status=self.health_status)

    def _denied(self, request: web.Request) -> web.Response | None:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return None

    async def _models(self, request: web.Request) -> web.Response:
        self.got.append(Got("GET", request.path, request.headers, b""))
        if (denied := self._denied(request)) is not None:
            return denied
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model",
                                                              "owned_by": self.role}]})

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.got.append(Got("POST", request.path, request.headers, raw))
        if (denied := self._denied(request)) is not None:
            return denied
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.status != 200:
            return web.Response(status=self.status, body=self.error_json, content_type="application/json")
        body = json.loads(raw)
        chat = request.path.endswith("/chat/completions")
        rid = request.headers.get("X-Request-Id", "none")
        toks = tokens_for(body)
        if not body.get("stream"):
            text = "".join(toks)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            answer = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                      "object": "chat.completion" if chat else "text_completion", "created": 1,
                      "model": body.get("model"), "choices": [choice],
                      "usage": {"prompt_tokens": 3, "completion_tokens": len(toks), "total_tokens": 3 + len(toks)},
                      **self.answer_fields(body, rid)}
            data = json.dumps(answer).encode()
            if self.fail_after is not None:  # declare the whole length, send half, cut
                resp = web.StreamResponse(headers={"Content-Type": "application/json"})
                resp.content_length = len(data)
                await resp.prepare(request)
                await resp.write(data[: len(data) // 2])
                request.transport.abort()
                return resp
            return web.Response(body=data, content_type="application/json")
        return await self._stream(request, body, chat, rid, toks)

    async def _stream(self, request: web.Request, body: dict, chat: bool, rid: str,
                      toks: list[str]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": obj, "created": 1,
                "model": body.get("model")}

        def event(choice: dict, **extra) -> bytes:
            return f"data: {json.dumps({**base, 'choices': [choice] if choice else [], **extra})}\n\n".encode()

        events = []
        if chat:
            events.append(event({"index": 0, "delta": {"role": "assistant", "content": ""}}))
        for t in toks:
            events.append(event({"index": 0, "delta": {"content": t}} if chat else {"index": 0, "text": t}))
        events.append(event({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                            else {"index": 0, "text": "", "finish_reason": "length"}))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(event({}, usage={"prompt_tokens": 3, "completion_tokens": len(toks),
                                           "total_tokens": 3 + len(toks)}))
        events.append(b"data: [DONE]\n\n")
        done = False
        try:
            for k, ev in enumerate(events):
                if self.fail_after is not None and k == self.fail_after:
                    request.transport.abort()
                    return resp
                await resp.write(ev)
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            done = True
            return resp
        finally:
            if not done and self.fail_after is None:
                self.closed_early.append(rid)


# --- fixtures: P and D pools, a router over them ---

@dataclass
class Cluster:
    aloop: Loop
    prefill: list[FakeVLLM]
    decode: list[FakeVLLM]
    router: RunningRouter | None = None

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=30, **kw)

    def start_router(self, **cfg) -> RunningRouter:
        config = build_config([p.url for p in self.prefill], [d.url for d in self.decode],
                              port=0, **cfg)
        self.router = self.aloop.run(start_router(config))
        return self.router

    def instances(self) -> dict[str, dict]:
        data = httpx.get(f"{self.url}/kvctl/instances").json()
        return {i["name"]: i for i in data["instances"]}


@pytest.fixture
def make_cluster(aloop: Loop) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(n_prefill: int = 1, n_decode: int = 1, *, fake_key: str | None = None, **cfg) -> Cluster:
        c = Cluster(aloop, [FakeVLLM("prefill", api_key=fake_key) for _ in range(n_prefill)],
                    [FakeVLLM("decode", api_key=fake_key, model=MODEL) for _ in range(n_decode)])
        made.append(c)
        for f in (*c.prefill, *c.decode):
            aloop.run(f.start())
        c.start_router(**cfg)
        return c

    yield make
    for c in made:
        if c.router is not None:
            aloop.run(c.router.stop())
        for f in (*c.prefill, *c.decode):
            aloop.run(f.stop())


def wait_for(predicate: Callable[[], bool], timeout: float = WAIT_S, what: str = "condition") -> float:
    """Seconds until `predicate()` held; fails after `timeout`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def recording_client(cluster: Cluster, **kw) -> tuple[openai.OpenAI, list[bytes]]:
    """An SDK client whose request bodies (as sent on the wire) are kept."""
    sent: list[bytes] = []

    def keep(request: httpx.Request) -> None:
        sent.append(request.read())

    http = httpx.Client(event_hooks={"request": [keep]}, timeout=30)
    return cluster.client(http_client=http, **kw), sent


MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


# --- the flow: P (max_tokens=1) then D (the body unchanged) ---

@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_p_then_d_non_streaming(make_cluster, kind):
    c = make_cluster()
    client, sent = recording_client(c)
    if kind == "chat":
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0.7)
        text = raw.parse().choices[0].message.content
    else:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="Why?", max_tokens=5,
                                                          temperature=0.7)
        text = raw.parse().choices[0].text
    (p_got,), (d_got,) = c.prefill[0].completions(), c.decode[0].completions()
    assert p_got.at <= d_got.at
    assert d_got.body == sent[0]  # byte for byte
    assert p_got.json()["max_tokens"] == 1 and p_got.json()["stream"] is False
    assert p_got.json()["temperature"] == 0.7  # never 0.699999988
    assert text == "".join(tokens_for(json.loads(sent[0])))  # D's answer, not P's one token
    assert raw.headers["X-Kvctl-Prefill"] == "prefill-0"
    assert raw.headers["X-Kvctl-Decode"] == "decode-0"
    assert float(raw.headers["X-Kvctl-Prefill-Ms"]) > 0  # P's part, for a client that splits latency


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_streamed_text_equals_non_streamed(make_cluster, kind):
    c = make_cluster()
    client, sent = recording_client(c)
    if kind == "chat":
        whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
        expected = whole.choices[0].message.content
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        whole = client.completions.create(model=MODEL, prompt="Why?", max_tokens=12)
        expected = whole.choices[0].text
        stream = client.completions.create(model=MODEL, prompt="Why?", max_tokens=12, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert streamed == expected and len(expected.split()) == 12
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    p_stream = c.prefill[0].completions()[1].json()
    assert p_stream["stream"] is False and "stream_options" not in p_stream
    assert c.decode[0].completions()[1].body == sent[1]


def test_stream_is_relayed_chunk_by_chunk(make_cluster):
    """The client sees D's first event long before D's last one: nothing is buffered."""
    c = make_cluster()
    c.decode[0].chunk_delay_s = 0.2
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "stream": True}
    arrivals = []
    start = time.monotonic()
    with httpx.stream("POST", f"{c.url}/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic() - start)
    assert len(arrivals) == 13  # role, 10 tokens, finish, [DONE]
    assert arrivals[-1] - arrivals[0] > 1.5  # spread out as D sent them
    assert arrivals[0] < arrivals[-1] / 2


def test_prefill_body_rules_and_decode_bytes_unchanged(make_cluster):
    c = make_cluster()
    raw = (b'{ "model" : "fake-model",  "messages": [{"role":"user","content":"caf\\u00e9 \xe2\x98\x95"}],\n'
           b' "max_completion_tokens": 50, "max_tokens": 40, "min_tokens": 5, "temperature": 0.7,'
           b' "top_p": 0.95, "seed": 12345678901234567890, "stream": true,'
           b' "stream_options": {"include_usage": true}, "vendor_field": [1, 2.50, null] }')
    with httpx.stream("POST", f"{c.url}/v1/chat/completions", content=raw,
                      headers={"Content-Type": "application/json"}, timeout=30) as resp:
        assert resp.status_code == 200
        resp.read()
    p = c.prefill[0].completions()[0].json()
    assert p == {"model": "fake-model", "messages": [{"role": "user", "content": "café ☕"}],
                 "max_completion_tokens": 1, "max_tokens": 1, "min_tokens": 1, "temperature": 0.7,
                 "top_p": 0.95, "seed": 12345678901234567890, "stream": False, "vendor_field": [1, 2.5, None]}
    assert c.decode[0].completions()[0].body == raw


@pytest.mark.parametrize("given, expected", [
    ({"max_tokens": 9}, {"max_tokens": 1, "stream": False}),  # no max_completion_tokens added
    ({"min_tokens": 0}, {"max_tokens": 1, "min_tokens": 0, "stream": False}),
    ({"min_tokens": 1, "stream": False}, {"max_tokens": 1, "min_tokens": 1, "stream": False}),
    ({}, {"max_tokens": 1, "stream": False}),
])
def test_prefill_body_variants(make_cluster, given, expected):
    c = make_cluster()
    body = {"model": MODEL, "prompt": "Hi", **given}
    assert httpx.post(f"{c.url}/v1/completions", json=body, timeout=30).status_code == 200
    assert c.prefill[0].completions()[0].json() == {"model": MODEL, "prompt": "Hi", **expected}


# --- request ids and authorization ---

def test_client_request_id_reaches_p_d_and_comes_back(make_cluster):
    c = make_cluster()
    raw = c.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, extra_headers={"X-Request-Id": "req-abc-123"})
    assert raw.headers["X-Request-Id"] == "req-abc-123"
    assert c.prefill[0].completions()[0].headers["X-Request-Id"] == "req-abc-123"
    assert c.decode[0].completions()[0].headers["X-Request-Id"] == "req-abc-123"
    assert raw.parse().id == "chatcmpl-req-abc-123"  # vLLM's own request id names it too


def test_generated_request_id_is_one_per_request(make_cluster):
    c = make_cluster()
    client = c.client()
    ids = [client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2)
           .headers["X-Request-Id"] for _ in range(3)]
    assert len(set(ids)) == 3 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert [g.headers["X-Request-Id"] for g in c.prefill[0].completions()] == ids
    assert [g.headers["X-Request-Id"] for g in c.decode[0].completions()] == ids


def test_authorization_is_forwarded(make_cluster):
    c = make_cluster(fake_key="tok-1")  # P and D require it; the router does not
    out = c.client(api_key="tok-1").chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert out.choices[0].message.content
    for f in (*c.prefill, *c.decode):
        assert f.completions()[0].headers["Authorization"] == "Bearer tok-1"
    # A wrong key: P's 401 comes back as P gave it, D is never called.
    with pytest.raises(openai.AuthenticationError):
        c.client(api_key="wrong").chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert len(c.decode[0].completions()) == 1


def test_api_key_required_by_the_router(make_cluster):
    c = make_cluster(fake_key="sekret", api_key="sekret")
    for headers in ({}, {"Authorization": "Bearer nope"}):
        r = httpx.post(f"{c.url}/v1/chat/completions", headers=headers, timeout=30,
                       json={"model": MODEL, "messages": MESSAGES})
        assert r.status_code == 401
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "code"} and err["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        c.client(api_key="nope").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert c.prefill[0].completions() == [] and c.decode[0].completions() == []
    out = c.client(api_key="sekret").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert out.choices[0].text
    assert c.decode[0].completions()[0].headers["Authorization"] == "Bearer sekret"
    assert httpx.get(f"{c.url}/health").status_code == 200  # like vLLM: only /v1 needs the key
    assert httpx.get(f"{c.url}/live").status_code == 200
    assert httpx.get(f"{c.url}/v1/models").status_code == 401
    assert [m.id for m in c.client(api_key="sekret").models.list()] == [MODEL]


# --- errors ---

def test_prefill_4xx_goes_back_unchanged_and_d_is_not_called(make_cluster):
    c = make_cluster()
    c.prefill[0].status = 400
    r = httpx.post(f"{c.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, timeout=30)
    assert r.status_code == 400 and r.content == c.prefill[0].error_json
    assert r.headers["X-Kvctl-Prefill"] == "prefill-0" and "X-Kvctl-Decode" not in r.headers
    with pytest.raises(openai.BadRequestError):
        c.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert c.decode[0].completions() == []


def test_prefill_5xx_gives_502_naming_it(make_cluster):
    c = make_cluster()
    c.prefill[0].status = 500
    c.prefill[0].error_json = b'{"object":"error","message":"engine dead"}'
    r = httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert r.status_code == 502
    err = r.json()["error"]
    assert "prefill-0" in err["message"] and c.prefill[0].url in err["message"]
    assert "engine dead" in err["message"] and err["code"] == "prefill_failed"
    assert c.decode[0].completions() == []


def test_prefill_down_gives_502_then_503_naming_it(make_cluster, aloop):
    c = make_cluster(health_interval_s=60)  # only the request itself can notice
    aloop.run(c.prefill[0].stop())
    r = httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert r.status_code == 502
    err = r.json()["error"]
    assert "prefill-0" in err["message"] and c.prefill[0].url in err["message"]
    assert err["code"] == "prefill_unreachable" and err["instance"] == "prefill-0"
    # marked down at once: the next request and /health say no prefill instance is healthy
    r = httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert r.status_code == 503 and "prefill-0" in r.json()["error"]["message"]
    h = httpx.get(f"{c.url}/health")
    assert h.status_code == 503 and h.json()["error"]["missing"] == ["prefill"]
    assert "prefill-0" in h.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError):
        c.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert c.decode[0].completions() == []


def test_prefill_dying_mid_answer_gives_502_naming_it(make_cluster):
    c = make_cluster()
    c.prefill[0].fail_after = 1  # half its JSON, then the connection drops (a kill -9)
    r = httpx.post(f"{c.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, timeout=30)
    assert r.status_code == 502
    err = r.json()["error"]
    assert "prefill-0" in err["message"] and err["code"] == "prefill_failed"
    assert c.decode[0].completions() == []


def test_prefill_timing_out_is_named_in_the_answer_and_the_route_line(make_cluster, caplog):
    c = make_cluster(prefill_timeout_s=0.5)
    c.prefill[0].delay_s = 3.0  # no answer (not even headers) before the router gives up
    with caplog.at_level("INFO", logger="kvctl.router"):
        r = httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["code"] == "prefill_timeout"
    assert r.headers["X-Kvctl-Prefill"] == "prefill-0"
    lines = [parse_route_line(m.getMessage()) for m in caplog.records]
    routed = [x for x in lines if x is not None and x.id == r.headers["X-Request-Id"]]
    assert len(routed) == 1 and routed[0].prefill == "prefill-0" and routed[0].decode is None, routed
    assert c.decode[0].completions() == []


def test_decode_5xx_gives_502_naming_it(make_cluster):
    c = make_cluster()
    c.decode[0].status = 503
    r = httpx.post(f"{c.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, timeout=30)
    assert r.status_code == 502
    err = r.json()["error"]
    assert "decode-0" in err["message"] and err["code"] == "decode_failed"
    assert r.headers["X-Kvctl-Prefill"] == "prefill-0" and r.headers["X-Kvctl-Decode"] == "decode-0"
    assert len(c.prefill[0].completions()) == 1


def test_decode_4xx_goes_back_unchanged(make_cluster):
    c = make_cluster()
    c.decode[0].status = 422
    r = httpx.post(f"{c.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, timeout=30)
    assert r.status_code == 422 and r.content == c.decode[0].error_json


def test_bad_json_is_400_and_unknown_path_404(make_cluster):
    c = make_cluster()
    r = httpx.post(f"{c.url}/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{c.url}/v1/completions", content=b"[1, 2]", timeout=30)
    assert r.status_code == 400
    r = httpx.get(f"{c.url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert c.prefill[0].completions() == []


def test_decode_dying_mid_stream_is_an_error_event(make_cluster):
    c = make_cluster()
    c.decode[0].fail_after = 3
    with pytest.raises(openai.APIError, match="decode-0"):
        for _ in c.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, stream=True):
            pass


def test_decode_dying_mid_answer_cuts_the_answer(make_cluster):
    c = make_cluster()
    c.decode[0].fail_after = 1
    with pytest.raises(httpx.HTTPError):  # a truncated body, never a clean one
        httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 50},
                   timeout=30)


def test_client_disconnect_mid_stream_cancels_decode(make_cluster):
    c = make_cluster()
    c.decode[0].chunk_delay_s = 0.1
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{c.url}/v1/chat/completions", json=body, timeout=30,
                      headers={"X-Request-Id": "gone-1"}) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
    # 200 tokens at 0.1 s would take 20 s; D sees its caller go away at once
    wait_for(lambda: c.decode[0].closed_early == ["gone-1"], timeout=5, what="D to see the close")
    metrics = httpx.get(f"{c.url}/metrics").text
    wait_for(lambda: 'status="499"' in httpx.get(f"{c.url}/metrics").text, what="the 499 count")
    assert "kvctl_router_instance_outstanding" in metrics


# --- pools, health, balancing ---

def test_health_gating(make_cluster):
    c = make_cluster(health_interval_s=0.2)
    assert httpx.get(f"{c.url}/health").status_code == 200
    c.decode[0].health_status = 503
    wait_for(lambda: httpx.get(f"{c.url}/health").status_code == 503, what="/health to be 503")
    h = httpx.get(f"{c.url}/health").json()
    assert h["error"]["missing"] == ["decode"] and "decode-0" in h["error"]["message"]
    with httpx.Client() as client:  # what `kvctl bench serve` adds to "no request succeeded"
        reason = unhealthy_reason(client, c.url)
    assert reason.startswith(f"{c.url}/health answers 503: no healthy decode instance") and "decode-0" in reason
    r = httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_decode"
    assert c.prefill[0].completions() == []  # no prefill spent when no decode could follow
    c.decode[0].health_status = 200
    wait_for(lambda: httpx.get(f"{c.url}/health").status_code == 200, what="/health to be 200")
    assert httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": "x"},
                      timeout=30).status_code == 200
    with httpx.Client() as client:
        assert unhealthy_reason(client, c.url) is None


def test_a_slow_health_answer_is_forgiven_for_the_grace_period(make_cluster):
    # D's /health answers later than the check's timeout (a live server on 2 loaded cores):
    # within the grace D stays healthy and serves; without a grace the same D gets a 503
    body = {"model": MODEL, "prompt": "x"}
    for grace, served in ((30.0, True), (0.0, False)):
        c = make_cluster(health_interval_s=0.1, health_timeout_s=0.2, health_grace_s=grace)
        c.decode[0].health_delay_s = 1.0
        hits = c.decode[0].health_hits
        wait_for(lambda: c.decode[0].health_hits >= hits + 3, what="three timed-out checks")
        r = httpx.post(f"{c.url}/v1/completions", json=body, timeout=30)
        if served:
            assert r.status_code == 200 and c.instances()["decode-0"]["healthy"] is True, r.text
            assert httpx.get(f"{c.url}/health").status_code == 200
        else:
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_decode", r.text
            assert "decode-0" in r.json()["error"]["message"] and "timed out" in r.json()["error"]["message"]


def test_a_health_check_timing_out_past_the_grace_marks_the_instance_down(make_cluster):
    c = make_cluster(health_interval_s=0.1, health_timeout_s=0.2, health_grace_s=1.0)
    c.decode[0].health_delay_s = 5.0  # hung: no answer at all
    waited = wait_for(lambda: not c.instances()["decode-0"]["healthy"], timeout=10, what="decode-0 down")
    assert waited >= 0.9  # not before the grace
    assert "timed out (" in c.instances()["decode-0"]["reason"] and "checks in a row" in c.instances()["decode-0"]["reason"]
    c.decode[0].health_delay_s = 0.0
    wait_for(lambda: c.instances()["decode-0"]["healthy"], what="decode-0 back")


def test_health_503_before_instances_are_up(aloop):
    config = build_config(["http://127.0.0.1:9"], ["d=http://127.0.0.1:7"], port=0)
    router = aloop.run(start_router(config))
    try:
        h = httpx.get(f"{router.url}/health")
        assert h.status_code == 503 and h.json()["error"]["missing"] == ["prefill", "decode"]
        assert "prefill-0 (http://127.0.0.1:9)" in h.json()["error"]["message"]
        assert "d (http://127.0.0.1:7): cannot connect: connection refused" in h.json()["error"]["message"]
        assert httpx.get(f"{router.url}/live").status_code == 200  # alive, just not ready
    finally:
        aloop.run(router.stop())


def test_round_robin_2p2d(make_cluster):
    c = make_cluster(2, 2)
    client = c.client()
    served = []
    for _ in range(8):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2)
        served.append((raw.headers["X-Kvctl-Prefill"], raw.headers["X-Kvctl-Decode"]))
    assert [p for p, _ in served] == ["prefill-0", "prefill-1"] * 4
    assert [d for _, d in served] == ["decode-0", "decode-1"] * 4
    assert [len(f.completions()) for f in (*c.prefill, *c.decode)] == [4, 4, 4, 4]
    inst = c.instances()
    assert {n: i["served"] for n, i in inst.items()} == {"prefill-0": 4, "prefill-1": 4,
                                                         "decode-0": 4, "decode-1": 4}


def test_least_outstanding_avoids_the_busy_decode(make_cluster):
    c = make_cluster(1, 2, policy="least_outstanding")
    c.decode[0].chunk_delay_s = 0.2  # decode-0 is chosen first and stays busy
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 15, "stream": True}
    with httpx.stream("POST", f"{c.url}/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.headers["X-Kvctl-Decode"] == "decode-0"
        lines = resp.iter_lines()  # kept: a dropped iterator closes the connection
        next(lines)
        picks = [httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                            timeout=30).headers["X-Kvctl-Decode"] for _ in range(3)]
    assert picks == ["decode-1"] * 3


def test_killed_instance_is_skipped_and_comes_back(make_cluster, aloop):
    c = make_cluster(2, 2, health_interval_s=0.2)
    client = c.client()
    victim = c.decode[1]
    aloop.run(victim.stop())
    # the first request that meets it retries on decode-0 (it never reached decode-1)
    started = time.monotonic()
    picks = [client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2)
             .headers["X-Kvctl-Decode"] for _ in range(6)]
    assert picks == ["decode-0"] * 6
    assert c.instances()["decode-1"]["healthy"] is False
    assert time.monotonic() - started < 5
    aloop.run(victim.start())  # same port
    wait_for(lambda: c.instances()["decode-1"]["healthy"], what="decode-1 back")
    picks = {client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2)
             .headers["X-Kvctl-Decode"] for _ in range(4)}
    assert picks == {"decode-0", "decode-1"}


def test_a_dropped_connection_rechecks_the_instance_at_once(make_cluster):
    c = make_cluster(1, 2, health_interval_s=60)  # the interval alone would take a minute
    victim = c.decode[1]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    first = httpx.post(f"{c.url}/v1/completions", json=body, timeout=30)
    victim.fail_after, victim.health_status = 1, 503  # dies mid-answer; its /health fails too
    with pytest.raises(httpx.RemoteProtocolError):  # decode-1's answer cut off, as it was
        httpx.post(f"{c.url}/v1/completions", json=body, timeout=30)
    assert first.status_code == 200 and first.headers["X-Kvctl-Decode"] == "decode-0"
    assert wait_for(lambda: not c.instances()["decode-1"]["healthy"], timeout=5, what="decode-1 down") < 5
    picks = [httpx.post(f"{c.url}/v1/completions", json=body, timeout=30) for _ in range(3)]
    assert [(r.status_code, r.headers["X-Kvctl-Decode"]) for r in picks] == [(200, "decode-0")] * 3


def test_a_dropped_connection_of_a_live_instance_keeps_it(make_cluster):
    c = make_cluster(1, 2, health_interval_s=60)
    c.decode[1].fail_after = 1  # one answer cut off, but /health still answers 200
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert httpx.post(f"{c.url}/v1/completions", json=body, timeout=30).status_code == 200
    checks = c.decode[1].health_hits
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{c.url}/v1/completions", json=body, timeout=30)
    # the re-check, not the 60 s interval: decode-1's /health is asked again at once
    assert wait_for(lambda: c.decode[1].health_hits > checks, timeout=5, what="the re-check") < 5
    c.decode[1].fail_after = None
    assert c.instances()["decode-1"]["healthy"] is True
    picks = [httpx.post(f"{c.url}/v1/completions", json=body, timeout=30).headers["X-Kvctl-Decode"]
             for _ in range(2)]
    assert sorted(picks) == ["decode-0", "decode-1"]


def test_concurrent_streams_through_2p2d(make_cluster):
    c = make_cluster(2, 2)
    c.decode[0].chunk_delay_s = c.decode[1].chunk_delay_s = 0.01
    client = c.client()

    def one(k: int) -> tuple[str, str]:
        msgs = [{"role": "user", "content": f"prompt {k}"}]
        stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        return text, "".join(tokens_for({"messages": msgs, "max_tokens": 8}))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(24)))
    assert all(got == want for got, want in results)
    assert sum(len(d.completions()) for d in c.decode) == 24


def test_models_come_from_decode(make_cluster):
    c = make_cluster()
    c.prefill[0].model = "not-this-one"
    assert [m.id for m in c.client().models.list()] == [MODEL]
    r = httpx.get(f"{c.url}/v1/models")
    assert r.headers["X-Kvctl-Decode"] == "decode-0"


def test_metrics_are_prometheus_text(make_cluster):
    c = make_cluster(1, 2)
    client = c.client()
    for _ in range(4):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    c.decode[0].status = c.decode[1].status = 500
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    r = httpx.get(f"{c.url}/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    values = {(s.name, frozenset(s.labels.items())): s.value for f in families.values() for s in f.samples}

    class Samples:  # samples['name{k="v",...}'], whatever order the labels were written in
        def __getitem__(self, key: str) -> float:
            name, _, labels = key.partition("{")
            return values[(name, frozenset(re.findall(r'(\w+)="([^"]*)"', labels)))]

    samples = Samples()
    assert samples['kvctl_router_requests_total{path="/v1/completions",status="200"}'] == 4
    assert samples['kvctl_router_requests_total{path="/v1/completions",status="502"}'] == 1
    assert samples['kvctl_router_instance_requests_total{role="prefill",instance="prefill-0"}'] == 5
    assert samples['kvctl_router_instance_requests_total{role="decode",instance="decode-0"}'] == 3
    assert samples['kvctl_router_instance_requests_total{role="decode",instance="decode-1"}'] == 2
    assert samples['kvctl_router_errors_total{role="decode",instance="decode-0",kind="status"}'] == 1
    assert samples['kvctl_router_prefill_seconds_count{instance="prefill-0"}'] == 5
    assert samples['kvctl_router_prefill_seconds_bucket{instance="prefill-0",le="+Inf"}'] == 5
    assert samples['kvctl_router_decode_first_byte_seconds_count{instance="decode-1"}'] == 2
    assert samples['kvctl_router_decode_seconds_count{instance="decode-0"}'] == 2
    assert samples['kvctl_router_request_seconds_count{path="/v1/completions"}'] == 5
    assert samples['kvctl_router_instance_healthy{role="decode",instance="decode-1"}'] == 1
    assert families["kvctl_router_prefill_seconds"].type == "histogram"
    assert families["kvctl_router_instance_healthy"].type == "gauge"


# --- the process: python -m kvctl.router ---

def test_router_process(make_cluster, aloop, tmp_path):
    fakes = make_cluster()  # its own in-process router is not used here
    log_path = tmp_path / "router.log"
    port = free_ports(1)[0]
    argv = [sys.executable, "-m", "kvctl.router", "--prefill", f"p-main={fakes.prefill[0].url}",
            "--decode", fakes.decode[0].url, "--port", str(port), "--health-interval", "0.5"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: LISTENING in log_path.read_text() or proc.poll() is not None, what="LISTENING")
        assert proc.poll() is None, log_path.read_text()
        assert f"{LISTENING} http://127.0.0.1:{port}" in log_path.read_text()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"X-Request-Id": "proc-1"})
        assert raw.headers["X-Kvctl-Prefill"] == "p-main" and raw.headers["X-Kvctl-Decode"] == "decode-0"
        wait_for(lambda: "id=proc-1" in log_path.read_text(), what="the ROUTED line")
        rec = next(r for line in log_path.read_text().splitlines() if (r := parse_route_line(line)))
        assert (rec.id, rec.prefill, rec.decode, rec.status, rec.stream) == ("proc-1", "p-main", "decode-0",
                                                                             200, False)
        assert rec.prefill_ms is not None and rec.decode_ms is not None and rec.total_ms >= rec.prefill_ms
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(10)
    assert rc == 0, log_path.read_text()


def test_a_launched_router_listens_where_it_is_told(make_cluster, tmp_path):
    """launch --router-host 0.0.0.0 --router-port N: the router listens on every interface at N,
    and its recorded URL is the loopback one clients here use."""
    fakes = make_cluster()
    port = free_ports(1)[0]
    record = start_launched_router({"prefill-0": ("prefill", fakes.prefill[0].url),
                                    "decode-0": ("decode", fakes.decode[0].url)}, tmp_path, port, host="0.0.0.0")
    try:
        assert record["url"] == f"http://127.0.0.1:{port}"
        assert record["command"][record["command"].index("--host") + 1] == "0.0.0.0"
        listening = Path("/proc/net/tcp").read_text().splitlines()[1:]
        assert any(f.split()[1] == f"00000000:{port:04X}" and f.split()[3] == "0A" for f in listening), \
            "not listening on 0.0.0.0"
        assert httpx.get(f"{record['url']}/health", timeout=5).status_code == 200
    finally:
        router_instance(record).stop(5.0)


@pytest.mark.parametrize("args, flag", [
    (["--decode", "http://127.0.0.1:1", "--prefill", "ftp://x", "--port", "0"], "--prefill"),
    (["--decode", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:1", "--port", "0"], "--decode"),
    (["--decode", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2", "--port", "0",
      "--health-interval", "0"], "--health-interval"),
])
def test_router_process_bad_arguments(args, flag):
    r = subprocess.run([sys.executable, "-m", "kvctl.router", *args], check=False,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert flag in r.stderr


def test_bench_reports_added_latency(capsys):
    from kvctl.cli import main

    assert main(["bench", "router", "--requests", "5", "--warmup", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for mode in ("non_streamed", "streamed"):
        rows = report["modes"][mode]
        assert set(rows) == {"direct_ms", "router_ms", "added_ms"}
        assert rows["router_ms"]["p50"] > 0 and rows["direct_ms"]["p99"] >= rows["direct_ms"]["p50"]
