"""Helpers for tests that drive a real 1P1D cluster of vLLM CPU servers."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from connectors.store import format as fmt
from kvctl.verify import markers
from kvctl.client import VLLMClient, user_messages
from kvctl.router.route_log import RouteRecord, parse_route_line


def slot_lock_path(shared_dir: Path) -> Path:
    """The lock file that lets one vLLM server pair start at a time: per test run, or
    machine-wide when $KVCTL_VLLM_SLOT_LOCK names one (several checkouts testing at once)."""
    return Path(os.environ.get("KVCTL_VLLM_SLOT_LOCK") or shared_dir / "vllm-slot.lock")


@contextlib.contextmanager
def cluster_for_module(tmp_path_factory, shared_dir: Path, rig_python: Path, model: Path,
                       name: str, **spec_kwargs) -> Iterator["Cluster"]:
    """Launch a cluster for a whole test module (holding the run-wide vLLM slot), then tear down."""
    from kvctl.cluster.spec import build_1p1d_spec
    from kvctl.cluster.lifecycle import running_cluster

    home = tmp_path_factory.mktemp(f"home-{name}")
    with open(slot_lock_path(shared_dir), "w") as lock, pytest.MonkeyPatch.context() as mp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        mp.setenv("KVCTL_HOME", str(home))
        mp.setenv("KVCTL_RIG_PYTHON", str(rig_python))
        spec = build_1p1d_spec(name=name, model=model, **spec_kwargs)
        with running_cluster(spec) as state:
            cluster = Cluster(state)
            try:
                yield cluster
            finally:
                cluster.close()


@contextlib.contextmanager
def launched_by_cli(tmp_path_factory, shared_dir: Path, name: str, *launch: str,
                    timeout: float) -> Iterator[tuple["Kvctl", dict]]:
    """`kvctl <launch...> --name NAME --json` in a fresh KVCTL_HOME for a whole test module,
    holding the run-wide vLLM slot; yields the runner and the launch's JSON. Afterwards
    every attached cluster is forgotten, NAME is torn down, and no process is left."""
    from conftest import Kvctl, live_processes_under

    home = tmp_path_factory.mktemp(f"{name}-home")
    kvctl = Kvctl(home)
    with open(slot_lock_path(shared_dir), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        r = kvctl(*launch, "--name", name, "--timeout", str(timeout), "--json", timeout=timeout + 120)
        assert r.rc == 0, r
        try:
            yield kvctl, json.loads(r.stdout)
        finally:
            clusters = home / "clusters"
            for state in clusters.glob("*/cluster.json"):
                if json.loads(state.read_text()).get("managed") is False:
                    kvctl("detach", state.parent.name)
            kvctl("down", "--name", name)
            assert live_processes_under(home) == []


@dataclass
class Routed:
    """Requests sent through a cluster's endpoint (`send_through_endpoint`)."""

    baseline: str  # what prefill-0 alone answers
    served: list[tuple[str, str, str]]  # (request id, prefill instance, decode instance) from the headers
    records: dict[str, RouteRecord]  # the router's log lines written meanwhile, by request id


def send_through_endpoint(state: dict, prompt: str, count: int = 4, *, stream: bool = False,
                          baseline_timeout: float = 120) -> Routed:
    """`count` chat requests through the endpoint of a launch's JSON `state` with the `openai` SDK
    (16 tokens, greedy), each asserted to answer what prefill-0 alone answers (the baseline,
    asked directly first); with `stream`, one more streamed request, asserted likewise."""
    import openai

    client = openai.OpenAI(base_url=f"{state['endpoint']}/v1", api_key="unused", max_retries=0)
    model = state["served_model_name"]
    messages = [{"role": "user", "content": prompt}]
    base = httpx.post(f"{state['instances']['prefill-0']['url']}/v1/chat/completions",
                      timeout=baseline_timeout, json={
        "model": model, "messages": messages, "max_tokens": 16, "temperature": 0,
    }).json()["choices"][0]["message"]["content"]
    assert base
    router_log = Path(state["router"]["log_path"])
    seen_lines = len(router_log.read_text().splitlines())
    served = []
    for _ in range(count):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=16, temperature=0)
        assert raw.parse().choices[0].message.content == base
        served.append((raw.headers["x-request-id"], raw.headers["x-kvctl-prefill"],
                       raw.headers["x-kvctl-decode"]))
    if stream:
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0, stream=True) if c.choices)
        assert streamed == base
    records = {rec.id: rec for line in router_log.read_text().splitlines()[seen_lines:]
               if (rec := parse_route_line(line)) is not None}
    return Routed(base, served, records)


@dataclass
class Exchange:
    """One prompt sent P (1 token) -> D (k tokens), plus the baseline."""

    prompt: str
    tokens: list[int]
    key: str | None
    decode_ids: list[int] | None
    baseline_ids: list[int] | None
    decode_text: str
    baseline_text: str


class Cluster:
    def __init__(self, state):
        self.state = state
        model = state.served_model_name
        self.p = VLLMClient(state.instances["prefill"].url, model, role="prefill")
        self.d = VLLMClient(state.instances["decode"].url, model, role="decode")
        self.store = Path(state.store)

    def close(self) -> None:
        self.p.close()
        self.d.close()

    def log(self, role: str) -> str:
        return Path(self.state.instances[role].log_path).read_text(errors="replace")

    def wait_for(self, role: str, found: Callable[[str], object], timeout: float = 10.0):
        """Poll a log until `found(text)` is truthy (log lines flush asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            result = found(self.log(role))
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.2)

    def send_key(self, tokens: list[int], timeout: float = 10.0) -> str | None:
        """The key P logged for these tokens (token count must match)."""
        lines = self.wait_for("prefill", lambda t: [s for s in markers.kv_sends(t)
                                                     if s.tokens == len(tokens)], timeout)
        return lines[-1].key if lines else None

    def exchange(self, prompt: str, max_tokens: int = 12, baseline: bool = True) -> Exchange:
        messages = user_messages(prompt)
        tokens = self.p.tokenize_chat(messages)
        self.p.chat(messages, max_tokens=1)
        key = self._key_for(tokens)
        dec = self.d.chat(messages, max_tokens=max_tokens)
        base = self.p.chat(messages, max_tokens=max_tokens) if baseline else None
        return Exchange(prompt, tokens, key, dec.token_ids, base.token_ids if base else None,
                        dec.text, base.text if base else "")

    def _key_for(self, tokens: list[int]) -> str | None:
        """The entry holding exactly `tokens` (from its header identity), waiting for the log."""
        def find(_text: str):
            for line in markers.kv_sends(self.log("prefill")):
                path = fmt.entry_path(self.store, line.key)
                try:
                    header, data = fmt.read_entry(path)
                except (FileNotFoundError, fmt.EntryCorrupt):
                    continue
                if fmt.token_ids_of(header, data) == tokens:
                    return line.key
            return None
        return self.wait_for("prefill", find)


def skip_line_for(text: str, key: str):
    return next((s for s in markers.skip_forwards(text) if key in s.keys), None)


def redo_lines_for(text: str, key: str):
    return [r for r in markers.redo_forwards(text) if r.mentions(key)]
