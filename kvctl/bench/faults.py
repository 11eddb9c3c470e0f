"""Fault figures: kill -9 one instance of a running xPyD cluster under load through its router.

    kvctl bench faults NAME --kill decode-1 [--requests 40] [--concurrency 4]
        [--max-tokens 16] [--json]

What it does, on a cluster kvctl launched (it kills one of its servers, so never
on one that serves anyone else):

1. baselines: each prompt once, directly on a prefill instance that survives
   (max_tokens tokens, greedy), as verify's baseline does;
2. load: `concurrency` clients send `requests` chat completions through the
   endpoint (the router), each prompt's answer compared with its baseline by
   token id;
3. once a quarter of the requests are done and the victim has requests in
   flight (the router's /kvctl/instances), its runtime kills it (`Instance.kill`:
   SIGKILL to a local server's process group, to a container's server);
4. the router's view is polled until it marks the victim unhealthy.

Reported (`measure_fault` returns it; kvctl.views.router renders it, `--json` as one object):

    failed             requests that did not get a 200 answer
    failed_in_flight   of those, the ones sent while the router still chose the victim
                       (before it marked it down: in flight on it, or sent to it while
                       it was dying)
    failed_later       the ones sent after the router marked it down (must be 0)
    failed_sent_after_kill  failures sent after the kill signal (the dying window)
    outstanding_at_kill     the victim's requests in flight at the kill (the router's count)
    errors_name_victim every failure's body is OpenAI-style JSON naming the victim
    recovery_s         seconds from the kill until the router stopped choosing the
                       victim (it marked it unhealthy; the "recovery time" of
                       Dynamo's fault-tolerance tests)
    chosen_after_down  requests the router sent to the victim after that (must be 0:
                       from its per-instance request counter in /metrics)
    wrong_answers      200 answers that differ from the baseline (must be 0)

A cluster launched with an API key: every request (baselines, load, the router's
/metrics and /kvctl/instances) carries `Authorization: Bearer KEY`, the key from
the cluster's `api_key` file (kvctl.cluster.state.cluster_api_key).

Library code: nothing here prints.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvctl.client import SEED_TOP_P, VLLMClient, auth_headers, user_messages
from kvctl.cluster.state import ClusterState, cluster_api_key, load_cluster
from kvctl.errors import BadInput, RuntimeFailure
from kvctl.runtime import Instance, get_runtime
from kvctl.verify.load_mode import generate_prompts

REQUESTS = 40
CONCURRENCY = 4
MAX_TOKENS = 16
PROMPTS = 8  # distinct prompts, cycled
KILL_AFTER = 0.25  # fraction of the requests done before the kill
POLL_S = 0.05  # polling the router's view of the instances
REQUEST_TIMEOUT_S = 300.0
RECOVERY_LIMIT_S = 60.0  # longest wait for the router to mark the victim down


@dataclass
class Outcome:
    index: int
    started: float  # time.time()
    ended: float = 0.0
    status: int | None = None  # None: no HTTP answer at all
    error: str = ""
    prefill: str | None = None
    decode: str | None = None
    token_ids: list[int] | None = None
    text: str = ""


@dataclass
class _Shared:
    next_index: int = 0
    done: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "messages": user_messages(prompt), "max_tokens": max_tokens,
            "temperature": 0.0, "top_p": SEED_TOP_P, "logprobs": True, "top_logprobs": 0,
            "return_tokens_as_token_ids": True}


def _token_ids(choice: dict) -> list[int] | None:
    content = (choice.get("logprobs") or {}).get("content") or []
    ids = [int(str(c.get("token", "")).split(":", 1)[1]) for c in content
           if str(c.get("token", "")).startswith("token_id:")]
    return ids or None


def _send(client: httpx.Client, endpoint: str, body: dict, index: int) -> Outcome:
    out = Outcome(index=index, started=time.time())
    try:
        resp = client.post(f"{endpoint}/v1/chat/completions", json=body,
                           headers={"X-Request-Id": f"fault-{os.getpid()}-{index}"})
        out.status = resp.status_code
        out.prefill, out.decode = resp.headers.get("x-kvctl-prefill"), resp.headers.get("x-kvctl-decode")
        if resp.status_code == 200:
            choice = resp.json()["choices"][0]
            out.token_ids, out.text = _token_ids(choice), choice["message"].get("content") or ""
        else:
            out.error = resp.text[:1000]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.ended = time.time()
    return out


def _instances(client: httpx.Client, endpoint: str) -> dict[str, dict]:
    try:
        return {i["name"]: i for i in client.get(f"{endpoint}/kvctl/instances", timeout=5).json()["instances"]}
    except (httpx.HTTPError, ValueError, KeyError):
        return {}


_COUNTER_RE = re.compile(r'^kvctl_router_instance_requests_total\{role="\w+",instance="([^"]+)"\} (\S+)$', re.M)


def _chosen(client: httpx.Client, endpoint: str, name: str) -> float:
    """How many times the router has sent a request to instance `name` (its /metrics counter)."""
    try:
        text = client.get(f"{endpoint}/metrics", timeout=5).text
    except httpx.HTTPError:
        return float("nan")
    return sum(float(v) for n, v in _COUNTER_RE.findall(text) if n == name)


def _victim(state: ClusterState, name: str) -> Instance:
    """Instance `name` of `state`, which its runtime can kill. Raises BadInput (field `kill`)."""
    rec = state.instances.get(name)
    if rec is None:
        raise BadInput(f"cluster {state.name!r} has no instance {name!r}", field="kill",
                       fix=f"name one of: {', '.join(state.instances)}")
    runtime = get_runtime(state.runtime)
    if not runtime.starts_servers:
        raise BadInput(f"instance {name!r} is not a server kvctl started", field="kill",
                       fix="run the fault test on a cluster kvctl launched")
    if len(state.by_role(rec.role)) < 2:
        raise BadInput(f"{name!r} is the only {rec.role} instance: nothing could take over", field="kill",
                       fix="launch pools of two or more instances of each role (`kvctl launch pd`)")
    return runtime.attach(name, rec.role, rec.url, Path(rec.log_path), rec.runtime_fields)


def measure_fault(name: str, victim: str, requests: int = REQUESTS, concurrency: int = CONCURRENCY,
                  max_tokens: int = MAX_TOKENS) -> dict:
    """Kill `victim` (an instance of cluster `name`) under load; the figures (module docstring).

    Raises BadInput (unknown cluster or instance, an instance kvctl did not start,
    the last of its role), RuntimeFailure (no baseline, the router never
    marked the victim down).
    """
    state = load_cluster(name)
    if not state.endpoint:
        raise BadInput(f"cluster {name!r} has no endpoint", field="name", fix="launch it with its router")
    target = _victim(state, victim)
    role = target.role
    survivor = next(n for n in state.by_role("prefill") if n != victim)
    prompts = generate_prompts(PROMPTS)
    model = state.served_model_name
    api_key = cluster_api_key(name)  # the cluster's, sent by every client (None: it needs none)
    with VLLMClient(state.instances[survivor].url, model, role="prefill", api_key=api_key) as p:
        baselines = [p.chat(user_messages(text), max_tokens=max_tokens).token_ids for text in prompts]
    if any(b is None for b in baselines):
        raise RuntimeFailure("the baseline answers carry no token ids", where=state.instances[survivor].url)

    shared = _Shared()
    outcomes: list[Outcome] = []
    kill: dict[str, float] = {}
    endpoint = state.endpoint

    def client_loop(client: httpx.Client) -> None:
        while True:
            with shared.lock:
                if shared.next_index >= requests:
                    return
                i = shared.next_index
                shared.next_index += 1
            outcome = _send(client, endpoint, _body(model, prompts[i % PROMPTS], max_tokens), i)
            with shared.lock:
                outcomes.append(outcome)
                shared.done += 1

    def killer(client: httpx.Client) -> None:
        while shared.done < max(1, int(requests * KILL_AFTER)) and shared.next_index < requests:
            time.sleep(POLL_S)
        deadline = time.monotonic() + 30
        while (outstanding := _instances(client, endpoint).get(victim, {}).get("outstanding", 0)) < 1 \
                and time.monotonic() < deadline and shared.next_index < requests:
            time.sleep(0.01)
        kill["outstanding"] = outstanding
        kill["at"] = time.time()
        target.kill()
        limit = time.monotonic() + RECOVERY_LIMIT_S
        while time.monotonic() < limit:
            if _instances(client, endpoint).get(victim, {}).get("healthy") is False:
                kill["down_at"] = time.time()
                kill["chosen_at_down"] = _chosen(client, endpoint, victim)
                return
            time.sleep(POLL_S)

    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    headers = auth_headers(api_key)
    with httpx.Client(timeout=timeout, headers=headers) as watch, ThreadPoolExecutor(concurrency + 1) as pool:
        clients = [httpx.Client(timeout=timeout, headers=headers) for _ in range(concurrency)]
        try:
            futures = [pool.submit(client_loop, c) for c in clients] + [pool.submit(killer, watch)]
            for f in futures:
                f.result()
        finally:
            for c in clients:
                c.close()
        chosen_end = _chosen(watch, endpoint, victim)
    if "down_at" not in kill:
        raise RuntimeFailure(f"the router did not mark {victim} unhealthy within {RECOVERY_LIMIT_S:g} s of "
                             "its kill", where=f"{endpoint}/kvctl/instances",
                             fix="read the router's log (`kvctl logs router`)")

    at, down_at = kill["at"], kill["down_at"]
    failed = [o for o in outcomes if o.status != 200]
    in_flight = [o for o in failed if o.started < down_at]  # sent while the router still chose it
    wrong = [o for o in outcomes if o.status == 200 and o.token_ids != baselines[o.index % PROMPTS]]
    return {
        "cluster": name, "victim": victim, "role": role, "requests": requests,
        "concurrency": concurrency, "max_tokens": max_tokens,
        "succeeded": len(outcomes) - len(failed),
        "failed": len(failed),
        "failed_in_flight": len(in_flight),
        "failed_later": len(failed) - len(in_flight),
        "failed_sent_after_kill": sum(1 for o in failed if o.started >= at),
        "outstanding_at_kill": kill.get("outstanding"),
        "errors_name_victim": all(_names(o.error, victim) for o in failed),
        "errors": [{"index": o.index, "status": o.status, "body": o.error[:400]} for o in failed],
        "recovery_s": round(down_at - at, 3),
        "chosen_after_down": chosen_end - kill["chosen_at_down"],
        "wrong_answers": len(wrong),
        "served_after_kill": sorted({o.decode if role == "decode" else o.prefill
                                     for o in outcomes if o.status == 200 and o.started > down_at}
                                    - {None}),
    }


def _names(body: str, victim: str) -> bool:
    """An OpenAI-style error (JSON with error.message) that names `victim`."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and victim in str(error.get("message", "")) \
        and error.get("instance") in (None, victim)
