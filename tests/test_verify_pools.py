"""verify through a router in front of pools: evidence follows X-Kvctl-Prefill/-Decode, per-instance counts.

The report rule is a pure function (`pool_verdict`) tested on made-up
requests. The driver runs against the fake instances of test_verify_unit
(which log our connectors' lines and write real store entries) behind a
small fake router that sends P then D and answers with the headers kvctl's
router sets, or lies, or sets none. tests/test_pd_pools_e2e.py proves the
same on real vLLM servers behind the real router.
"""

from __future__ import annotations

import io
import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from rich.console import Console
from test_verify_unit import FS_CONSUMER, FS_PRODUCER, FakeInstance

from kvctl.verify.checks import CHECKS, ERROR_CHECK, CheckResult
from kvctl.verify.cluster_info import ClusterInfo, InstanceInfo
from kvctl.verify.junit import verify_junit
from kvctl.verify.load_mode import run_load
from kvctl.verify.report import FROM_HEADERS, FROM_LOGS, RequestReport, VerifyReport, pool_verdict
from kvctl.verify.verifier import RunOptions, run_verify
from kvctl.views.verify import render_load, render_verify_report

POOLS = {"prefill": ["prefill-0", "prefill-1"], "decode": ["decode-0", "decode-1"]}


def request(p: str | None, d: str | None, passed: bool = True, how: str = FROM_HEADERS) -> RequestReport:
    return RequestReport(prompt="hi", prompt_tokens=3, key="k" * 32, request_id="rid",
                         checks=[CheckResult(n, passed, "e") for n in CHECKS],
                         prefill_instance=p, decode_instance=d, instances_from=how)


# ------------------------------------------------------------------ the rule, on made-up requests


def test_every_instance_served_passes_with_counts():
    reqs = [request("prefill-0", "decode-0"), request("prefill-1", "decode-1"), request("prefill-0", "decode-1")]
    report = VerifyReport("c", reqs, 4, pools=POOLS)
    doc = report.to_json()
    assert doc["passed"] is True and doc["run_failures"] == [] and doc["instance_notes"] == []
    assert doc["instances"] == {"prefill-0": {"role": "prefill", "served": 2},
                                "prefill-1": {"role": "prefill", "served": 1},
                                "decode-0": {"role": "decode", "served": 1},
                                "decode-1": {"role": "decode", "served": 2}}
    assert doc["requests"][0]["request_id"] == "rid"
    assert (doc["requests"][1]["prefill_instance"], doc["requests"][1]["decode_instance"],
            doc["requests"][1]["instances_from"]) == ("prefill-1", "decode-1", "headers")


def test_an_instance_that_never_served_fails_the_run_by_name():
    reqs = [request("prefill-0", "decode-0"), request("prefill-1", "decode-0")]
    report = VerifyReport("c", reqs, 4, pools=POOLS)
    assert all(r.passed for r in report.requests) and not report.passed  # a run-level failure
    (failure,) = report.run_failures()
    assert (failure.check, failure.instance, failure.role) == ("instance_served", "decode-1", "decode")
    assert "decode instance decode-1 served none of the 2 requests" in failure.reason
    assert report.to_json()["run_failures"] == [failure.to_json()]
    assert report.to_json()["instances"]["decode-1"] == {"role": "decode", "served": 0}


def test_fewer_requests_than_instances_is_not_judged_and_says_why():
    failures, notes = pool_verdict(POOLS, [request("prefill-0", "decode-0")])
    assert failures == []
    assert len(notes) == 2 and "the decode pool has 2 instances but the run sent 1 request" in notes[1]
    assert "decode-1" in notes[1] and "not a failure" in notes[1]
    assert VerifyReport("c", [request("prefill-0", "decode-0")], 4, pools=POOLS).passed


def test_unknown_instances_and_errors():
    # a request whose instance is unknown (no headers, no log line): the pool is not judged
    failures, notes = pool_verdict(POOLS, [request("prefill-0", None, how=""), request("prefill-1", "decode-0")])
    assert failures == [] and any("cannot tell which decode instance served 1 of the 2" in n for n in notes)
    assert any("1 of the 2 requests came back without router headers" in n for n in notes)
    # a request that failed: counted, named in the reason
    failed = RequestReport(prompt="x", prompt_tokens=0, key="", checks=[CheckResult(ERROR_CHECK, False, "502")])
    failures, _ = pool_verdict(POOLS, [failed, request("prefill-0", "decode-0"), request("prefill-1", "decode-0")])
    assert [f.instance for f in failures] == ["decode-1"] and "1 request failed before" in failures[0].reason
    # one instance per role (1P1D, or verify --direct): never judged, as requests say it themselves
    assert pool_verdict({"prefill": ["prefill"], "decode": ["decode"]}, [failed]) == ([], [])


def test_junit_and_views_show_each_instance():
    report = VerifyReport("c", [request("prefill-0", "decode-0"), request("prefill-1", "decode-0")], 4,
                          pools=POOLS)
    root = verify_junit(report).getroot()
    cases = {c.get("classname"): c for c in root.iter("testcase") if c.get("name") == "instance_served"}
    assert set(cases) == {f"kvctl.verify.c.{n}" for n in ("prefill-0", "prefill-1", "decode-0", "decode-1")}
    assert cases["kvctl.verify.c.decode-1"].find("failure").get("type") == "NeverServed"
    assert "served 1 of 2 requests" in cases["kvctl.verify.c.prefill-1"].find("system-out").text
    assert root.get("tests") == str(2 * len(CHECKS) + 4) and root.get("failures") == "1"
    out = io.StringIO()
    render_verify_report(report, Console(file=out, width=120))
    text = out.getvalue()
    assert "requests served: prefill-0 1, prefill-1 1, decode-0 2, decode-1 0" in text
    assert "✗ instance_served decode-1: decode instance decode-1 served none" in text
    assert "FAILED (0 failed checks, 1 instance never served)" in text
    unjudged = verify_junit(VerifyReport("c", [request("prefill-0", "decode-0")], 4, pools=POOLS)).getroot()
    assert unjudged.find("testsuite").get("skipped") == "2" and unjudged.get("failures") == "0"


# ------------------------------------------------------------------ the driver behind a fake router


class FakeRouter:
    """P (max_tokens=1), then D, like kvctl's router; answers D's body with its own headers.

    `pick_p`/`pick_d` choose the instance index per request; `named_p` is the
    P the X-Kvctl-Prefill header names (default: the one used; a liar names
    another); `headers=False` sets none (a router kvctl does not control).
    """

    def __init__(self, prefills: list[FakeInstance], decodes: list[FakeInstance], *, headers: bool = True,
                 only_decode: int | None = None, lie_about_p: bool = False):
        rr_p, rr_d = itertools.cycle(range(len(prefills))), itertools.cycle(range(len(decodes)))
        lock = threading.Lock()
        http = httpx.Client(timeout=30)
        router = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                body = json.loads(raw)
                with lock:
                    p = next(rr_p)
                    d = next(rr_d) if only_decode is None else only_decode
                rid = self.headers.get("X-Request-Id", "minted")
                sent = time.perf_counter()
                http.post(f"{prefills[p].url}/v1/chat/completions", json={**body, "max_tokens": 1})
                prefill_ms = (time.perf_counter() - sent) * 1000
                answer = http.post(f"{decodes[d].url}/v1/chat/completions", content=raw,
                                   headers={"Content-Type": "application/json"})
                out = answer.content
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                if headers:
                    named = (p + 1) % len(prefills) if lie_about_p else p
                    self.send_header("X-Request-Id", rid)
                    self.send_header("X-Kvctl-Prefill", f"prefill-{named}")
                    self.send_header("X-Kvctl-Decode", f"decode-{d}")
                    self.send_header("X-Kvctl-Prefill-Ms", f"{prefill_ms:.1f}")
                    router.prefill_ms.append(prefill_ms)
                self.end_headers()
                self.wfile.write(out)
                router.routed.append((rid, p, d))

        self.routed: list[tuple[str, int, int]] = []
        self.prefill_ms: list[float] = []
        self.http = http
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.http.close()


@pytest.fixture
def pools_cluster(tmp_path):
    """make(**router_kwargs) -> (ClusterInfo of a 2P2D cluster behind a fake router, the router)."""
    made: list = []

    def make(**router_kwargs) -> tuple[ClusterInfo, FakeRouter]:
        store = tmp_path / "store"
        store.mkdir(exist_ok=True)
        ps = [FakeInstance("prefill", store, tmp_path / f"p{i}.log", log_delay_s=0.05) for i in range(2)]
        ds = [FakeInstance("decode", store, tmp_path / f"d{i}.log", log_delay_s=0.05) for i in range(2)]
        router = FakeRouter(ps, ds, **router_kwargs)
        made.extend([*ps, *ds, router])
        infos = tuple(InstanceInfo(role, inst.url, inst.log, cfg, name=f"{role}-{i}")
                      for role, group, cfg in (("prefill", ps, FS_PRODUCER), ("decode", ds, FS_CONSUMER))
                      for i, inst in enumerate(group))
        info = ClusterInfo("pools", "tiny", store, infos[0], infos[2], endpoint=router.url, instances=infos)
        return info, router

    yield make
    for thing in made:
        thing.close()


PROMPTS = ["Hello", "Sea and sky", "Grüße", "x" * 40]


def test_evidence_follows_the_router_headers(pools_cluster):
    info, router = pools_cluster()
    run = run_verify(info, PROMPTS, RunOptions(max_tokens=4, via_endpoint=True, log_wait_s=2.0))
    report = run.report
    assert report.passed, report.to_json()
    assert report.to_json()["endpoint"] == router.url
    assert {n: v["served"] for n, v in report.served().items()} == {
        "prefill-0": 2, "prefill-1": 2, "decode-0": 2, "decode-1": 2}
    for r, (rid, p, d) in zip(report.requests, router.routed):
        assert r.request_id == rid and len(rid) == 32  # verify's own X-Request-Id, echoed
        assert (r.prefill_instance, r.decode_instance, r.instances_from) == (f"prefill-{p}", f"decode-{d}", "headers")
        assert r.key in (info.instances[p].log_path.read_text())  # the send line is in THAT P's log
        assert r.key in (info.instances[2 + d].log_path.read_text())
    # P's part is the router's X-Kvctl-Prefill-Ms, D's the rest of the request (not the whole of it)
    for r, ms in zip(report.requests, router.prefill_ms):
        assert r.prefill_latency_s == pytest.approx(round(ms, 1) / 1000)
        assert r.decode_latency_s is not None and r.decode_latency_s >= 0


def test_a_header_naming_the_wrong_prefill_fails_the_send_check(pools_cluster):
    info, _ = pools_cluster(lie_about_p=True)
    report = run_verify(info, PROMPTS[:2], RunOptions(max_tokens=4, via_endpoint=True, log_wait_s=0.5)).report
    assert not report.passed
    for r in report.requests:
        send = r.check("kv_send_logged")
        assert not send.passed and f"looked in {r.prefill_instance}'s log" in send.evidence
        assert r.check("decode_skipped_forward").passed is False  # no key known from that P


def test_without_headers_the_logs_say_which_instance_served(pools_cluster):
    info, router = pools_cluster(headers=False)
    report = run_verify(info, PROMPTS, RunOptions(max_tokens=4, via_endpoint=True, log_wait_s=2.0)).report
    assert report.passed, report.to_json()
    for r, (_, p, d) in zip(report.requests, router.routed):
        assert (r.prefill_instance, r.decode_instance, r.instances_from) == (f"prefill-{p}", f"decode-{d}", FROM_LOGS)
    assert any("came back without router headers" in n for n in report.instance_notes())
    assert all(r.prefill_latency_s is None and r.decode_latency_s > 0 for r in report.requests)  # P's part unknown


def test_a_decode_the_router_never_chooses_fails_the_run(pools_cluster):
    info, _ = pools_cluster(only_decode=0)
    report = run_verify(info, PROMPTS, RunOptions(max_tokens=4, via_endpoint=True, log_wait_s=2.0)).report
    assert all(r.passed for r in report.requests) and not report.passed
    assert [f.instance for f in report.run_failures()] == ["decode-1"]
    one = run_verify(info, PROMPTS[:1], RunOptions(max_tokens=4, via_endpoint=True, log_wait_s=2.0)).report
    assert one.passed and any("not a failure" in n for n in one.instance_notes())


def test_load_mode_through_the_router_counts_each_instance(pools_cluster):
    info, _ = pools_cluster(only_decode=1)
    result = run_load(info, PROMPTS * 2, 4, concurrency=4, via_endpoint=True, log_wait_s=2.0)
    doc = result.to_json()
    assert doc["load"]["num_errors"] == 0 and doc["load"]["num_mismatches"] == 0
    assert doc["instances"]["decode-1"]["served"] == 8 and doc["instances"]["decode-0"]["served"] == 0
    assert doc["passed"] is False and doc["run_failures"][0]["instance"] == "decode-0"
    out = io.StringIO()
    render_load(result, Console(file=out, width=120))
    assert "requests served: prefill-0 4, prefill-1 4, decode-0 0, decode-1 8" in out.getvalue()


def test_an_instance_the_cluster_does_not_list_makes_its_evidence_not_observable(pools_cluster):
    """Attached with only some of the instances behind its endpoint: a request the router sent to an
    unlisted one has its evidence in a log kvctl cannot read -- not observable, never failed."""
    full, router = pools_cluster()
    p0, d0 = full.instances[0], full.instances[2]
    info = ClusterInfo("some", "tiny", full.store, p0, d0, endpoint=router.url, instances=(p0, d0))
    report = run_verify(info, PROMPTS, RunOptions(max_tokens=4, via_endpoint=True, log_wait_s=0.5)).report
    for r, (_, p, d) in zip(report.requests, router.routed):
        send = r.check("kv_send_logged")
        if p == 1:
            assert send.observable is False and not send.passed, send
            assert "prefill-1" in send.evidence and "not listed" in send.evidence
        else:
            assert send.passed, send
        if d == 1:
            assert r.check("decode_skipped_forward").observable is False
        assert r.check("output_matches_baseline").passed
    assert not report.passed  # --require all: what kvctl could not see is no pass
