"""NIXL faults on real CPU servers: what a NIXL user hits, each with its outcome asserted.

One module-scoped 1P1D cluster (`--transfer nixl` through the library, vLLM 0.32 with
vLLM's NixlConnector, UCX over tcp+cma, kvctl's router doing the handshake), holding the
run-wide vLLM slot; P's lease is short (LEASE_S) and P's KV cache small (P_BLOCKS
blocks of 128 tokens) so that freed blocks are reused at once. Each fault holds D's
engine back (SIGSTOP to the processes of D's group but its API server: D's /health
still answers, so the router hands D the request, and D's engine neither pulls nor
sends lease heartbeats), then:

1. the lease: P's lease runs out while D is paused, P serves other prompts that take
   the freed blocks, D resumes and reads them: verify fails the request, naming the
   expired lease and quoting P's line (never a pass, whatever the answer);
2. P killed (Instance.kill) after its prefill, before D's pull: D's request fails
   (kv_load_failure_policy "fail", vLLM's default), the client gets a 502 that names
   D (which failed) and P (whose KV it could not read), never a wrong answer; P is
   restarted (restart_instances) and the cluster serves again;
3. D killed mid-pull (as soon as D's scheduler logged the pull's allocation): the
   client gets a 502 naming D; P is unaffected and releases the blocks it held for D
   (its lease or D's read); the router then answers 503 naming the missing decode.

The failed handshake (a wrong side channel) is tests/test_nixl_e2e.py's. Each test
prints its figures (timings, status codes, what each side logged). Skipped without the
V1 rig or the nixl extra; failed under KVCTL_REQUIRE_RIG_V1=1.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from conftest import live_processes_under
from e2e_helpers import slot_lock_path
from test_nixl_e2e import require_nixl
from test_v1_e2e import V1_PYTHON_ENV, _python_or_skip

from kvctl.cluster import nixl
from kvctl.cluster.lifecycle import restart_instances, running_cluster
from kvctl.cluster.spec import ClusterSpec, build_1p1d_spec
from kvctl.cluster.state import ClusterState, load_cluster
from kvctl.router.headers import DECODE_HEADER, PREFILL_HEADER, REQUEST_ID
from kvctl.runtime import get_runtime
from kvctl.runtime.base import Instance
from kvctl.runtime.processes import group_members
from kvctl.verify import nixl as nixl_evidence
from kvctl.verify.cluster_info import cluster_info
from kvctl.verify.checks import CheckResult
from kvctl.verify.verifier import ClusterVerifier, RunOptions, run_verify

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(3600)]

NAME = "nxf"
LEASE_S = 12  # P's kv_lease_duration (kvctl's default here is 120 s)
P_BLOCKS = 20  # P's KV cache: 20 blocks of 128 tokens, the tiny model's 2,048 and a few more
MAX_TOKENS = 12
WAIT_S = 120.0


def _prompt(tag: str, words: int) -> str:
    """A prompt that shares no first block with any other (prefix caching stays out of it)."""
    return f"{tag}: " + " ".join(f"{tag}{i % 97} word{i % 13}" for i in range(words))


@dataclass
class Faults:
    spec: ClusterSpec
    home: Path

    @property
    def state(self) -> ClusterState:
        return load_cluster(NAME)

    def instance(self, name: str) -> Instance:
        rec = self.state.instances[name]
        return get_runtime(self.state.runtime).attach(name, rec.role, rec.url, Path(rec.log_path),
                                                      rec.runtime_fields)

    def url(self, name: str) -> str:
        return self.state.instances[name].url

    def log(self, name: str) -> str:
        return Path(self.state.instances[name].log_path).read_text(errors="replace")

    def offset(self, name: str) -> int:
        return Path(self.state.instances[name].log_path).stat().st_size

    def log_since(self, name: str, offset: int) -> str:
        with open(self.state.instances[name].log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def engine_pids(self, name: str) -> list[int]:
        """Every process of the instance's group but its leader (the API server)."""
        leader = int(self.state.instances[name].runtime_fields["pid"])
        return [pid for pid in group_members(leader) if pid != leader]

    def chat_body(self, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
        return {"model": self.state.served_model_name, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0}

    def direct(self, name: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
        r = httpx.post(f"{self.url(name)}/v1/chat/completions", json=self.chat_body(prompt, max_tokens),
                       timeout=WAIT_S)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def faults(tmp_path_factory, shared_dir: Path, tiny_model: Path) -> Iterator[Faults]:
    python = _python_or_skip("v1")
    require_nixl(str(python))
    home = tmp_path_factory.mktemp("nixl-faults-home")
    configs = {role: {**nixl.default_config(role, 2), "kv_connector_extra_config": {"kv_lease_duration": LEASE_S}}
               for role in ("prefill", "decode")}
    with open(slot_lock_path(shared_dir), "w") as lock, pytest.MonkeyPatch.context() as mp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        mp.setenv("KVCTL_HOME", str(home))
        mp.setenv(V1_PYTHON_ENV, str(python))
        spec = build_1p1d_spec(name=NAME, model=tiny_model, prefill_engine="v1", decode_engine="v1",
                               transfer="nixl", prefill_config=configs["prefill"], decode_config=configs["decode"],
                               prefill_args=("--num-gpu-blocks-override", str(P_BLOCKS)))
        t0 = time.monotonic()
        with running_cluster(spec):
            print(f"launch: {time.monotonic() - t0:.1f} s")
            yield Faults(spec, home)
    assert live_processes_under(home) == []


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait(what: str, found: Callable[[], object], timeout: float = WAIT_S, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = found()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def _line(text: str, *parts: str) -> str | None:
    return next((ln.strip() for ln in text.splitlines() if all(p in ln for p in parts)), None)


def _p_finished(f: Faults, p_off: int, request_id: str) -> str | None:
    """P's scheduler logged the request finished (P answered with kv_transfer_params; its blocks
    are now held for D under the lease)."""
    return _line(f.log_since("prefill", p_off), "request_finished(", request_id)


def _send(pool: ThreadPoolExecutor, f: Faults, prompt: str, request_id: str) -> Future:
    return pool.submit(httpx.post, f"{f.state.endpoint}/v1/chat/completions", json=f.chat_body(prompt),
                       headers={REQUEST_ID: request_id}, timeout=WAIT_S * 3)


@contextlib.contextmanager
def _held_after_prefill(f: Faults, pool: ThreadPoolExecutor, prompt: str, request_id: str) -> Iterator[Future]:
    """D's engine paused, the request sent through the router and prefilled by P (its blocks now
    held for D under the lease): yields the client's pending answer; D's engine resumes on exit."""
    d_engine = f.engine_pids("decode")
    assert d_engine, "D has no engine process besides its API server"
    p_off = f.offset("prefill")
    _signal(d_engine, signal.SIGSTOP)
    try:
        answer = _send(pool, f, prompt, request_id)
        _wait("P's request_finished line", lambda: _p_finished(f, p_off, request_id))
        yield answer
    finally:
        _signal(d_engine, signal.SIGCONT)


def _routed(f: Faults, request_id: str) -> str:
    """The router's ROUTED line of the request (its status, P's and D's parts in ms, its error)."""
    return _line(Path(f.state.router["log_path"]).read_text(), "routed", request_id) or "(no ROUTED line)"


def _nixl_lines(text: str, request_id: str) -> list[str]:
    keys = ("KV transfer", "Releasing expired", "Potentially invalid", "NIXL transfer failure",
            "num_external_tokens", "KV load failure", "Failing", "heartbeat", "Heartbeat")
    return [ln.strip()[:400] for ln in text.splitlines()
            if any(k in ln for k in keys) and (request_id in ln or "NIXL transfer failure" in ln
                                               or "Failing" in ln)]


def test_d_paused_past_the_lease_is_named_by_verify(faults: Faults):
    """D's engine paused past P's lease while P serves prompts that take the freed blocks:
    verify fails the request on the expired lease, quoting P's line, whatever D answered."""
    f = faults
    d_engine = f.engine_pids("decode")
    assert d_engine, "D has no engine process besides its API server"
    prompt = _prompt("lease", 100)  # ~510 tokens: 4 blocks on P
    p_off = f.offset("prefill")
    stages: list[str] = []
    with ThreadPoolExecutor(1) as pool:
        _signal(d_engine, signal.SIGSTOP)
        paused_at = time.monotonic()
        try:
            run = pool.submit(run_verify, cluster_info(f.state), [prompt],
                              RunOptions(max_tokens=MAX_TOKENS, via_endpoint=True, log_wait_s=30.0),
                              lambda i, n, stage: stages.append(stage))
            finished = _wait("P's request_finished line", lambda: _line(f.log_since("prefill", p_off),
                                                                        "request_finished(", "do_remote_decode"))
            answered_at = time.monotonic()
            request_id = re.search(r"request_finished\((?:chat)?cmpl-([0-9a-f]+)", finished)[1]
            expired = _wait("P's expired-lease line",
                            lambda: _line(f.log_since("prefill", p_off), nixl_evidence.LEASE_EXPIRED, request_id),
                            timeout=LEASE_S + 60)
            expired_at = time.monotonic()
            others = [f.direct("prefill", _prompt(f"other{i}", 300), max_tokens=1) for i in range(3)]
            assert all(isinstance(o, str) for o in others)
        finally:
            _signal(d_engine, signal.SIGCONT)
        resumed_at = time.monotonic()
        report = run.result(timeout=WAIT_S * 3).report
    req = report.requests[0]
    checks = {c.name: c for c in req.checks}
    d_text = f.log("decode")
    p_text = f.log("prefill")
    print(f"lease fault: request {request_id}; P answered {answered_at - paused_at:.1f} s after D's pause, "
          f"lease expired {expired_at - answered_at:.1f} s later (lease {LEASE_S} s); D paused "
          f"{resumed_at - paused_at:.1f} s; D answered {req.decode_output!r}, baseline {req.baseline_output!r}, "
          f"equal={req.decode_output == req.baseline_output}")
    print("P: " + "\n   ".join(_nixl_lines(p_text, request_id)))
    print("D: " + "\n   ".join(_nixl_lines(d_text, request_id)))
    for c in req.checks:
        print(f"  {c.name}: {'pass' if c.passed else 'FAIL'}: {c.evidence[:400]}")
    assert not report.passed and not req.passed
    sent = checks["kv_send_logged"]
    assert not sent.passed
    assert "lease" in sent.evidence and expired in sent.evidence, sent.evidence
    if req.decode_output != req.baseline_output:  # a wrong answer: never passed, and named
        output = checks["output_matches_baseline"]
        assert not output.passed and "P's lease on this request's KV expired before D read it" in output.evidence


def _nixl_checks(f: Faults, request_id: str, prompt: str, starts) -> dict[str, CheckResult]:
    """Verify's NIXL checks of one request sent meanwhile (`starts`: `_log_starts` before it)."""
    with ClusterVerifier(cluster_info(f.state), log_wait_s=15.0) as v:
        tokens = v.decode.tokenize_chat([{"role": "user", "content": prompt}])
        checks = v.nixl_checks(request_id, tokens, v.p_log, starts[0], v.d_log, starts[1])
    return {c.name: c for c in checks}


def _log_starts(f: Faults):
    with ClusterVerifier(cluster_info(f.state)) as v:
        return v.p_log.offset(), v.d_log.offset()


def test_p_killed_before_ds_pull(faults: Faults):
    """P killed after its prefill, before D pulled: D's request fails (kv_load_failure_policy
    "fail"), the client gets a 502 naming P as the instance that is gone, verify names the
    failed pull, never a wrong answer."""
    f = faults
    prompt = _prompt("pkill", 100)
    request_id = "pkill-" + uuid.uuid4().hex[:12]
    d_off = f.offset("decode")
    starts = _log_starts(f)
    p = f.instance("prefill")
    with ThreadPoolExecutor(1) as pool:
        with _held_after_prefill(f, pool, prompt, request_id) as answer:
            p.kill()
            killed_at = time.monotonic()
            _wait("P's processes gone", lambda: not p.status().running, timeout=30)
        resumed_at = time.monotonic()
        resp = answer.result(timeout=WAIT_S * 3)
    answered_s, after_resume_s = time.monotonic() - killed_at, time.monotonic() - resumed_at
    d_text = f.log_since("decode", d_off)
    body = resp.text
    print(f"P killed: client got {resp.status_code} {answered_s:.2f} s after the kill, {after_resume_s:.2f} s "
          f"after D resumed; headers "
          f"{ {k: v for k, v in resp.headers.items() if k.lower().startswith('x-')} }; body {body[:600]}")
    print("D: " + "\n   ".join(_nixl_lines(d_text, request_id)))
    print("router: " + _routed(f, request_id))
    assert resp.status_code != 200, "D answered although P died before it could pull"
    assert resp.status_code == 502, body
    assert resp.headers[PREFILL_HEADER] == "prefill" and resp.headers[DECODE_HEADER] == "decode"
    error = resp.json()["error"]
    assert error["code"] == "kv_source_down" and error["instance"] == "prefill", error
    assert error["message"].startswith("prefill instance prefill (") and "is down" in error["message"]
    assert "decode instance decode could not pull this request's KV from it" in error["message"]
    checks = _nixl_checks(f, request_id, prompt, starts)
    for c in checks.values():
        print(f"  {c.name}: {'pass' if c.passed else 'FAIL'}: {c.evidence[:500]}")
    pulled = checks["decode_skipped_forward"]
    assert not pulled.passed and "its pull failed (" in pulled.evidence
    assert "D failed the request (kv_load_failure_policy fail)" in pulled.evidence
    assert not checks["kv_send_logged"].passed  # P never logged it sent the blocks
    t0 = time.monotonic()
    restart_instances(f.spec, ["prefill"])
    print(f"P restarted and back in the router in {time.monotonic() - t0:.1f} s")
    doc = run_verify(cluster_info(f.state), [_prompt("after-pkill", 40)],
                     RunOptions(max_tokens=MAX_TOKENS, via_endpoint=True)).report
    assert doc.passed, [c for r in doc.requests for c in r.checks if not c.passed]


def test_d_killed_mid_pull(faults: Faults):
    """D killed as its pull starts: the client gets a 502 naming D, P keeps serving and
    releases the blocks it held for D, the router then reports the missing decode."""
    f = faults
    prompt = _prompt("dkill", 100)
    request_id = "dkill-" + uuid.uuid4().hex[:12]
    p_off, d_off = f.offset("prefill"), f.offset("decode")
    d = f.instance("decode")
    with ThreadPoolExecutor(1) as pool:
        with _held_after_prefill(f, pool, prompt, request_id) as answer:
            pass  # D resumes: its engine schedules the pull
        alloc = _wait("D's allocation for the pull", lambda: _line(f.log_since("decode", d_off),
                                                                   nixl_evidence.ALLOCATED, request_id), every=0.002)
        d.kill()
        killed_at = time.monotonic()
        resp = answer.result(timeout=WAIT_S)
        answered_s = time.monotonic() - killed_at
    d_text = f.log_since("decode", d_off)
    print(f"D killed after `{alloc[:160]}`; D had logged Finished recving: "
          f"{_line(d_text, nixl_evidence.FINISHED_RECVING, request_id) is not None}; client got "
          f"{resp.status_code} {answered_s:.2f} s after the kill: {resp.text[:400]}")
    print("router: " + _routed(f, request_id))
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["instance"] == "decode" and "decode instance decode" in error["message"], error
    # P is unaffected: it answers, and lets go of the blocks it held for D
    assert f.direct("prefill", _prompt("p-alive", 40), max_tokens=2)
    released = _wait("P releasing the request's blocks", lambda: (
        _line(f.log_since("prefill", p_off), nixl_evidence.LEASE_EXPIRED, request_id)
        or _line(f.log_since("prefill", p_off), nixl_evidence.FINISHED_SENDING, request_id)),
        timeout=LEASE_S + 60)
    print(f"P released the blocks {time.monotonic() - killed_at:.1f} s after D's kill: {released}")
    # the router reports the missing decode instance (its /health names the role; P, busy releasing
    # blocks on 2 loaded cores, may miss a health check too: then both roles are named)
    health = _wait("the router marking D down", lambda: (r := httpx.get(f"{f.state.endpoint}/health", timeout=10))
                   .status_code == 503 and "decode" in r.json()["error"]["missing"] and r, timeout=30)
    after = httpx.post(f"{f.state.endpoint}/v1/chat/completions", json=f.chat_body("hello"), timeout=30)
    print(f"router after D's death: /health {health.status_code} {health.json()['error']['message'][:200]}; "
          f"a request: {after.status_code} {after.text[:300]}")
    assert after.status_code == 503 and after.json()["error"]["code"].startswith("no_healthy_"), after.text
