"""The router as an aiohttp application: `create_app(config)`, `start_router`, `serve`.

Routes:

    POST /v1/chat/completions, /v1/completions   P (max_tokens=1) then D, D's answer relayed
    GET  /v1/models, POST /tokenize, /detokenize  one healthy decode instance answers
    GET  /health                                  200 while >= 1 P and >= 1 D are healthy, else 503
    GET  /live                                    200 while the router runs (a liveness probe)
    GET  /metrics                                 Prometheus text (metrics.py)
    GET  /kvctl/instances                         every instance: role, URL, health, load, served

A completion, step by step:

1. With an API key configured, `Authorization: Bearer <key>` is required on /v1/*
   (401 otherwise). The client's `Authorization` goes to P and D as it came.
2. One request id: the client's `X-Request-Id`, or a new one; it goes to P and D
   (vLLM names the request `chatcmpl-<id>` / `cmpl-<id>` in its log) and back.
3. No healthy P or no healthy D: 503 at once (no prefill is spent on a request
   no D could finish). P gets the prefill body (bodies.py). A connect error marks
   that P down and the next healthy P is tried (the request never reached it);
   none left: 502 naming every P tried. P's 4xx goes back to the client unchanged
   and D is not called; P's 5xx, a timeout or a cut answer give 502 naming it.
4. Once P has answered, D gets the client's body byte for byte (with the handshake,
   RouterConfig.kv_transfer_params: P is asked for `kv_transfer_params`, D gets the
   client's request with the ones P answered, and a P answer without them is a 502
   naming P; bodies.py; when D then fails before answering, P's /health is checked at
   once: a P that is gone is the instance the 502 names, code `kv_source_down`, since D
   could not pull from it). D's answer is
   relayed chunk by chunk as it arrives (SSE events unbuffered). Before D's first
   body byte, D failing gives 502 like P (its 4xx passes through); after it, a
   stream gets an SSE `data: {"error": ...}` event and a plain answer is cut off
   (the client sees a truncated response, never a clean one).
5. A client that goes away cancels the upstream request: the connection to P or
   D is closed, and vLLM aborts the request.
6. An instance that resets or drops a connection (a failure that is not a timeout)
   gets its /health checked at once, not at the next interval: a server killed
   with kill -9 leaves its pool as soon as it is gone. Its own requests in flight
   fail as described above; the router never resends a request.
7. The answer carries `X-Request-Id`, `X-Kvctl-Prefill` and `X-Kvctl-Decode` (the
   instances' names) and `X-Kvctl-Prefill-Ms` (P's part; headers.py), and one
   ROUTED line is logged (route_log.py).

Errors the router makes are OpenAI-style JSON: {"error": {"message", "type", "code"}}.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from kvctl.router.bodies import (
    BadRequestBody,
    answered_params,
    encode,
    error_body,
    handshake_decode_request,
    handshake_prefill_request,
    parse_request,
    prefill_request,
)
from kvctl.router.config import KEEPALIVE_S, RouterConfig
from kvctl.router.headers import DECODE_HEADER, PREFILL_HEADER, PREFILL_MS_HEADER, REQUEST_ID
from kvctl.router.health import check_all, check_instance, describe, log_change, run_health_checks
from kvctl.router.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvctl.router.metrics import Metrics
from kvctl.router.pool import InstanceState, Pool, mark_down
from kvctl.router.route_log import CLIENT_CLOSED, RouteRecord

log = logging.getLogger("kvctl.router")

# Client headers P and D get (besides X-Request-Id); nothing else crosses the router.
FORWARDED = ("Authorization", "Content-Type", "Accept", "Accept-Encoding", "User-Agent",
             "traceparent", "tracestate")
# Upstream answer headers the client gets (besides ours); the body is relayed as received.
RELAYED = ("Content-Type", "Content-Encoding")
MAX_BODY_BYTES = 256 * 1024 * 1024  # one request's body (long prompts, images as base64)
SNIPPET = 500  # characters of an upstream error body quoted in ours
LISTENING = "kvctl-router listening on"  # the start-up line: `... http://HOST:PORT`


class UpstreamError(Exception):
    """An instance failed (or none was usable) before the client got a byte."""

    def __init__(self, status: int, message: str, code: str, instance: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.instance = instance

    def response(self, headers: dict[str, str]) -> web.Response:
        kind = "service_unavailable" if self.status == 503 else "upstream_error"
        extra = {"instance": self.instance} if self.instance else {}
        return _json(self.status, error_body(self.message, type=kind, code=self.code, **extra), headers)


def _json(status: int, body: dict, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json",
                        headers=headers)


def _snippet(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace").strip()
    return text[:SNIPPET] + ("..." if len(text) > SNIPPET else "")


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000


class Router:
    """The state behind one application: pools, metrics, the upstream client session."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.pools = {"prefill": Pool("prefill", config.prefill, config.policy),
                      "decode": Pool("decode", config.decode, config.policy)}
        self.metrics = Metrics()
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._rechecks: dict[str, asyncio.Task] = {}  # instance name -> its pending re-check
        self._p_timeout = aiohttp.ClientTimeout(total=config.prefill_timeout_s,
                                                connect=config.connect_timeout_s)
        self._d_timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s,
                                                sock_read=config.decode_idle_timeout_s)

    @property
    def instances(self) -> list[InstanceState]:
        return [*self.pools["prefill"], *self.pools["decode"]]

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the router's session exists while the app runs"
        return self._session

    # --- lifecycle (an aiohttp cleanup context) ---

    async def lifespan(self, app: web.Application):
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              timeout=aiohttp.ClientTimeout(total=None))
        await check_all(self.session, self.instances, self.config.health_timeout_s)
        for inst in self.instances:
            if not inst.healthy:  # a change to healthy was logged by the check itself
                log_change(inst)
        self._health_task = asyncio.create_task(run_health_checks(
            self.session, self.instances, self.config.health_interval_s, self.config.health_timeout_s,
            self.config.health_grace_s))
        try:
            yield
        finally:
            tasks = [self._health_task, *self._rechecks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._session.close()

    # --- /v1/chat/completions, /v1/completions ---

    async def completion(self, request: web.Request) -> web.StreamResponse:
        start = time.perf_counter()
        rid = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        rec = RouteRecord(id=rid, path=request.path)
        headers = {REQUEST_ID: rid}
        try:
            resp = await self._completion(request, rec, headers)
            if rec.status is None:
                rec.status = resp.status
            return resp
        except asyncio.CancelledError:
            rec.status = CLIENT_CLOSED
            rec.error = rec.error or "the client closed the connection"
            raise
        finally:
            rec.total_ms = _ms(start)
            self.metrics.inc(self.metrics.requests, path=rec.path, status=rec.status)
            self.metrics.observe(self.metrics.total, rec.total_ms / 1000, path=rec.path)
            log.info("%s", rec.line())

    async def _completion(self, request: web.Request, rec: RouteRecord,
                          headers: dict[str, str]) -> web.StreamResponse:
        denied = self._check_key(request, headers)
        if denied is not None:
            rec.error = "unauthorized"
            return denied
        raw = await request.read()
        try:
            body = parse_request(raw)
        except BadRequestBody as e:
            rec.error = str(e)
            return _json(400, error_body(str(e), type="invalid_request_error", code="invalid_json"), headers)
        rec.stream = body.get("stream") is True
        upstream_headers = self._upstream_headers(request, rec.id)
        try:
            for pool in self.pools.values():  # no prefill is spent when no decode could follow
                if not pool.healthy():
                    raise UpstreamError(503, f"no healthy {pool.role} instance: {pool.unhealthy_summary()}",
                                        code=f"no_healthy_{pool.role}")
            handshake = self.config.kv_transfer_params
            p_body = handshake_prefill_request(body) if handshake else prefill_request(body)
            early, params = await self._prefill(request, encode(p_body), upstream_headers, rec, headers)
            if early is not None:
                return early
            if params is None:
                return await self._decode(request, raw, upstream_headers, rec, headers)
            try:
                return await self._decode(request, encode(handshake_decode_request(body, params)),
                                          upstream_headers, rec, headers)
            except UpstreamError as e:
                raise await self._kv_source(e, rec) from None
        except UpstreamError as e:
            rec.error = e.message
            return e.response(headers)

    async def _prefill(self, request: web.Request, body: bytes, upstream_headers: dict[str, str],
                       rec: RouteRecord, headers: dict[str, str],
                       ) -> tuple[web.Response | None, dict | None]:
        """P's part. Returns P's 4xx answer for the client (or None when D goes next), and
        with the handshake the kv_transfer_params P answered with (else None).

        Raises UpstreamError when no P answered well, or (handshake) P's answer has no
        kv_transfer_params.
        """
        pool = self.pools["prefill"]
        sent = time.perf_counter()

        def picked(inst: InstanceState) -> None:  # named before it answers: a timeout or a client
            rec.prefill = headers[PREFILL_HEADER] = inst.name  # gone meanwhile still says which P

        inst, resp = await self._open(pool, "POST", request.raw_path, body, upstream_headers, self._p_timeout,
                                      picked)
        try:
            answer = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise self._failed(inst, e) from None
        finally:
            resp.close()  # read to the end or abandoned: either way this request is over
            inst.outstanding -= 1
        rec.prefill_ms = _ms(sent)
        headers[PREFILL_MS_HEADER] = f"{rec.prefill_ms:.1f}"
        self.metrics.observe(self.metrics.prefill, rec.prefill_ms / 1000, instance=inst.name)
        if 400 <= resp.status < 500:
            rec.error = f"prefill answered {resp.status}: {_snippet(answer)}"
            return web.Response(status=resp.status, body=answer, headers={**_relayed(resp), **headers}), None
        if not 200 <= resp.status < 300:
            raise self._bad_status(inst, resp.status, answer)
        if not self.config.kv_transfer_params:
            return None, None
        params = answered_params(answer)
        if params is None:  # D would recompute the whole prompt without them: never silently
            self.metrics.inc(self.metrics.errors, role="prefill", instance=inst.name,
                             kind="no_kv_transfer_params")
            raise UpstreamError(
                502, f"prefill instance {inst.name} ({inst.url}) answered without kv_transfer_params: "
                     "this cluster's transfer connector needs them for D to pull the KV (is P's "
                     f"--kv-transfer-config a NIXL one?); P answered: {_snippet(answer)}",
                code="prefill_no_kv_transfer_params", instance=inst.name)
        return None, params

    async def _kv_source(self, err: UpstreamError, rec: RouteRecord) -> UpstreamError:
        """D failed before answering a handshake request: say where its KV was to come from.

        D pulls the blocks from the P that answered (its kv_transfer_params name it), so a
        D that fails may be a P that died after its prefill (vLLM's default
        kv_load_failure_policy fails the request). P's /health is checked now: a P that
        does not answer is the instance named (code `kv_source_down`); a healthy one is
        mentioned in D's error.
        """
        inst = next((i for i in self.pools["prefill"] if i.name == rec.prefill), None)
        if inst is None or err.instance != rec.decode:
            return err
        await check_instance(self.session, inst, self.config.health_timeout_s)  # no grace: D just failed on it
        source = f"D was to pull this request's KV from prefill instance {inst.name} ({inst.url})"
        if inst.healthy:
            return UpstreamError(err.status, f"{err.message}; {source}, which is healthy", code=err.code,
                                 instance=err.instance)
        self.metrics.inc(self.metrics.errors, role="prefill", instance=inst.name, kind="kv_source_down")
        return UpstreamError(502, f"prefill instance {inst.name} ({inst.url}) is down ({inst.reason}) and "
                                  f"decode instance {rec.decode} could not pull this request's KV from it: "
                                  f"{err.message}", code="kv_source_down", instance=inst.name)

    async def _decode(self, request: web.Request, body: bytes, upstream_headers: dict[str, str],
                      rec: RouteRecord, headers: dict[str, str]) -> web.StreamResponse:
        """D's part: the client's body as received, D's answer relayed as it arrives."""
        pool = self.pools["decode"]
        sent = time.perf_counter()

        def picked(inst: InstanceState) -> None:
            rec.decode = headers[DECODE_HEADER] = inst.name

        inst, resp = await self._open(pool, "POST", request.raw_path, body, upstream_headers, self._d_timeout,
                                      picked)
        try:
            if not 200 <= resp.status < 300:
                try:
                    answer = await resp.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    raise self._failed(inst, e) from None
                if 400 <= resp.status < 500:
                    rec.error = f"decode answered {resp.status}: {_snippet(answer)}"
                    return web.Response(status=resp.status, body=answer, headers={**_relayed(resp), **headers})
                raise self._bad_status(inst, resp.status, answer)
            return await self._relay(request, inst, resp, rec, headers, sent)
        finally:
            resp.close()  # after EOF this only drops the connection; before it, it aborts D's request
            inst.outstanding -= 1
            if rec.decode_first_byte_ms is not None or rec.status is not None:
                rec.decode_ms = _ms(sent)
                self.metrics.observe(self.metrics.decode, rec.decode_ms / 1000, instance=inst.name)

    async def _relay(self, request: web.Request, inst: InstanceState, resp: aiohttp.ClientResponse,
                     rec: RouteRecord, headers: dict[str, str], sent: float) -> web.StreamResponse:
        out = web.StreamResponse(status=resp.status, headers={**_relayed(resp), **headers})
        if resp.content_length is not None and "chunked" not in resp.headers.get("Transfer-Encoding", ""):
            out.content_length = resp.content_length
        while True:
            try:
                chunk = await resp.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                if not out.prepared:
                    raise self._failed(inst, e) from None
                return await self._broken(request, out, inst, e, rec)
            if not out.prepared:
                rec.decode_first_byte_ms = _ms(sent)
                self.metrics.observe(self.metrics.decode_first, rec.decode_first_byte_ms / 1000,
                                     instance=inst.name)
                await out.prepare(request)
            if not chunk:
                return out
            try:
                await out.write(chunk)
            except ConnectionError:  # the client went away (without handler cancellation)
                rec.status, rec.error = CLIENT_CLOSED, "the client closed the connection"
                return out

    async def _broken(self, request: web.Request, out: web.StreamResponse, inst: InstanceState,
                      e: BaseException, rec: RouteRecord) -> web.StreamResponse:
        """D failed after the client got bytes: say so in the stream, or cut the answer off."""
        message = f"decode instance {inst.name} ({inst.url}) failed mid-answer: {describe(e)}"
        if not isinstance(e, asyncio.TimeoutError):
            self._recheck(inst)
        log.warning("request %s: %s", rec.id, message)
        self.metrics.inc(self.metrics.errors, role="decode", instance=inst.name, kind="broken")
        rec.error = message
        if out.content_type == "text/event-stream":
            event = error_body(message, type="upstream_error", code="decode_broken", instance=inst.name)
            try:
                await out.write(f"data: {json.dumps(event)}\n\n".encode())
            except ConnectionError:
                pass
        elif request.transport is not None:
            request.transport.abort()  # a truncated body must not look complete
        return out

    # --- choosing and calling an instance ---

    async def _open(self, pool: Pool, method: str, path: str, body: bytes | None,
                    headers: dict[str, str], timeout: aiohttp.ClientTimeout,
                    picked: Callable[[InstanceState], None] | None = None,
                    ) -> tuple[InstanceState, aiohttp.ClientResponse]:
        """Send to the pool's next instance; returns it (its lease held: the caller
        decrements `outstanding`) and its response with the headers read.

        A connect error marks that instance down and tries the next healthy one.
        Raises UpstreamError: 503 when no instance is healthy, 502 when none could
        be reached or the one reached failed before answering. `picked(inst)` is
        called for each instance tried, before it answers.
        """
        tried: list[InstanceState] = []
        unreachable: list[str] = []
        while (inst := pool.pick(exclude=tried)) is not None:
            tried.append(inst)
            if picked is not None:
                picked(inst)
            inst.outstanding += 1
            inst.served += 1
            self.metrics.inc(self.metrics.instance_requests, role=pool.role, instance=inst.name)
            try:
                return inst, await self.session.request(method, inst.url + path, data=body,
                                                         headers=headers, timeout=timeout)
            except aiohttp.ClientConnectorError as e:
                inst.outstanding -= 1
                reason = describe(e)
                if mark_down(inst, reason):
                    log_change(inst)
                self.metrics.inc(self.metrics.errors, role=pool.role, instance=inst.name, kind="connect")
                unreachable.append(f"{inst.name} ({inst.url}): {reason}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                inst.outstanding -= 1
                raise self._failed(inst, e) from None
            except BaseException:
                inst.outstanding -= 1
                raise
        if unreachable:
            raise UpstreamError(502, f"no {pool.role} instance could be reached: {'; '.join(unreachable)}",
                                code=f"{pool.role}_unreachable", instance=tried[-1].name)
        raise UpstreamError(503, f"no healthy {pool.role} instance: {pool.unhealthy_summary()}",
                            code=f"no_healthy_{pool.role}")

    def _recheck(self, inst: InstanceState) -> None:
        """Check `inst`'s /health now, not at the next interval: a connection it reset or
        dropped may mean the process died (kill -9, OOM), and until a check says so the
        pool keeps choosing it. One pending re-check per instance; a live instance that
        merely dropped one connection stays healthy (no request-path guess marks it down)."""
        if inst.name in self._rechecks or self._session is None:
            return
        task = asyncio.get_running_loop().create_task(
            check_instance(self.session, inst, self.config.health_timeout_s, self.config.health_grace_s))
        self._rechecks[inst.name] = task
        task.add_done_callback(lambda _: self._rechecks.pop(inst.name, None))

    def _failed(self, inst: InstanceState, e: BaseException) -> UpstreamError:
        kind = "timeout" if isinstance(e, asyncio.TimeoutError) else "failed"
        if kind == "failed":
            self._recheck(inst)
        self.metrics.inc(self.metrics.errors, role=inst.config.role, instance=inst.name, kind=kind)
        what = "timed out" if kind == "timeout" else f"failed: {describe(e)}"
        return UpstreamError(502, f"{inst.config.role} instance {inst.name} ({inst.url}) {what}",
                             code=f"{inst.config.role}_{kind}", instance=inst.name)

    def _bad_status(self, inst: InstanceState, status: int, answer: bytes) -> UpstreamError:
        self.metrics.inc(self.metrics.errors, role=inst.config.role, instance=inst.name, kind="status")
        return UpstreamError(502, f"{inst.config.role} instance {inst.name} ({inst.url}) answered "
                                  f"{status}: {_snippet(answer)}",
                             code=f"{inst.config.role}_failed", instance=inst.name)

    def _upstream_headers(self, request: web.Request, rid: str) -> dict[str, str]:
        out = {h: request.headers[h] for h in FORWARDED if h in request.headers}
        out.setdefault("Content-Type", "application/json")
        out.setdefault("Accept-Encoding", "identity")  # relay bytes as they are; never re-encode
        out[REQUEST_ID] = rid
        return out

    def _check_key(self, request: web.Request, headers: dict[str, str]) -> web.Response | None:
        """401 unless the configured API key came as `Authorization: Bearer <key>`."""
        key = self.config.api_key
        if key is None:
            return None
        given = request.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return None
        message = ("Incorrect API key provided." if given else
                   "No API key provided: send `Authorization: Bearer <key>`.")
        return _json(401, error_body(message, type="invalid_request_error", code="invalid_api_key"),
                     {**headers, "WWW-Authenticate": "Bearer"})

    # --- the other endpoints ---

    async def to_decode(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/models, POST /tokenize, /detokenize: one healthy D answers, as it answers."""
        rid = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        headers = {REQUEST_ID: rid}
        status = 500
        try:
            if request.path.startswith("/v1/") and (denied := self._check_key(request, headers)) is not None:
                status = denied.status
                return denied
            body = await request.read() if request.can_read_body else None
            try:
                inst, resp = await self._open(self.pools["decode"], request.method, request.raw_path, body,
                                              self._upstream_headers(request, rid), self._p_timeout)
            except UpstreamError as e:
                status = e.status
                return e.response(headers)
            headers[DECODE_HEADER] = inst.name
            try:
                answer = await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                err = self._failed(inst, e)
                status = err.status
                return err.response(headers)
            finally:
                resp.close()
                inst.outstanding -= 1
            status = resp.status
            return web.Response(status=resp.status, body=answer, headers={**_relayed(resp), **headers})
        finally:
            self.metrics.inc(self.metrics.requests, path=request.path, status=status)

    async def health(self, request: web.Request) -> web.Response:
        missing = [role for role, pool in self.pools.items() if not pool.healthy()]
        instances = [i.to_json() for i in self.instances]
        if not missing:
            return _json(200, {"status": "ok", "instances": instances})
        message = "; ".join(f"no healthy {role} instance: {self.pools[role].unhealthy_summary()}"
                            for role in missing)
        body = error_body(message, type="service_unavailable",
                          code="no_healthy_" + "_".join(missing), missing=missing)
        return _json(503, {**body, "instances": instances})

    async def live(self, request: web.Request) -> web.Response:
        return _json(200, {"status": "alive"})

    async def instances_view(self, request: web.Request) -> web.Response:
        return _json(200, {"policy": self.config.policy, "instances": [i.to_json() for i in self.instances]})

    async def metrics_view(self, request: web.Request) -> web.Response:
        gauges = [("kvctl_router_instance_healthy", "1 while the instance's /health answers 200.",
                   {"role": i.config.role, "instance": i.name}, float(i.healthy)) for i in self.instances]
        gauges += [("kvctl_router_instance_outstanding", "Requests in flight on the instance.",
                    {"role": i.config.role, "instance": i.name}, float(i.outstanding)) for i in self.instances]
        return web.Response(body=self.metrics.render(gauges).encode(),
                            headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def not_found(self, request: web.Request) -> web.Response:
        return _json(404, error_body(f"no route for {request.method} {request.path}",
                                     type="invalid_request_error", code="not_found"))


def _relayed(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {h: resp.headers[h] for h in RELAYED if h in resp.headers}


ROUTER = web.AppKey("router", Router)


def create_app(config: RouterConfig) -> web.Application:
    """The router's aiohttp application (the health checker runs while the app does).

    Serve it with `start_router` (or an AppRunner with `handler_cancellation=True`,
    so that a client that goes away cancels the upstream request at once).
    """
    router = Router(config)
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[ROUTER] = router
    app.cleanup_ctx.append(router.lifespan)
    app.router.add_post("/v1/chat/completions", router.completion)
    app.router.add_post("/v1/completions", router.completion)
    app.router.add_get("/v1/models", router.to_decode)
    app.router.add_post("/tokenize", router.to_decode)
    app.router.add_post("/detokenize", router.to_decode)
    app.router.add_get("/health", router.health)
    app.router.add_get("/live", router.live)
    app.router.add_get("/metrics", router.metrics_view)
    app.router.add_get("/kvctl/instances", router.instances_view)
    app.router.add_route("*", "/{tail:.*}", router.not_found)
    return app


@dataclass
class RunningRouter:
    """A router serving on a socket; `url` is where clients send requests."""

    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def router(self) -> Router:
        return self.runner.app[ROUTER]

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_router(config: RouterConfig) -> RunningRouter:
    """Start serving `config` on its host and port (port 0: a free one) in the running loop.

    Raises OSError when the address cannot be bound.
    """
    runner = web.AppRunner(create_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = runner.addresses[0][1]
    return RunningRouter(runner=runner, host=config.host, port=port)


async def serve(config: RouterConfig) -> None:
    """Serve until SIGINT or SIGTERM, logging the LISTENING line once bound."""
    running = await start_router(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pools = ", ".join(f"{i.name}={i.url}" for i in running.router.instances)
    log.info("%s %s (policy %s; %s)", LISTENING, running.url, config.policy, pools)
    try:
        await stop.wait()
    finally:
        log.info("kvctl-router stopping")
        await running.stop()
