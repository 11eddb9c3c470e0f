"""The router's pure parts: config, the prefill rule, the pool's choice, the log line, metrics text."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvctl.errors import BadInput
from kvctl.router.bodies import BadRequestBody, encode, parse_request, prefill_request
from kvctl.router.config import build_config, parse_instance
from kvctl.router.metrics import Metrics
from kvctl.router.pool import Pool, mark_down, record_check
from kvctl.router.route_log import ROUTED, RouteRecord, parse_route_line

P1, P2, D1 = "http://127.0.0.1:8100", "http://127.0.0.1:8101", "http://127.0.0.1:8200"


# --- config ---

def test_instances_are_named_in_order_or_by_name():
    c = build_config([P1, f"p-fast={P2}/"], [D1])
    assert [(i.name, i.url) for i in c.prefill] == [("prefill-0", P1), ("p-fast", P2)]
    assert [(i.name, i.role) for i in c.decode] == [("decode-0", "decode")]
    assert set(c.instances) == {"prefill-0", "p-fast", "decode-0"}
    assert c.host == "127.0.0.1" and c.policy == "round_robin"


def test_a_url_with_equals_in_its_path_is_not_a_name():
    assert parse_instance("http://h:1/x=y", "decode", 3).name == "decode-3"


@pytest.mark.parametrize("prefill, decode, kw, field", [
    ([], [D1], {}, "prefill"),
    ([P1], [], {}, "decode"),
    (["ftp://h:1"], [D1], {}, "prefill"),
    (["127.0.0.1:8100"], [D1], {}, "prefill"),
    ([P1], ["http://h:99999"], {}, "decode"),
    (["bad name=" + P1], [D1], {}, "prefill"),
    ([P1], [P1], {}, "decode"),  # one server in both roles
    ([f"x={P1}"], [f"x={D1}"], {}, "decode"),  # one name twice
    ([P1], [D1], {"policy": "random"}, "policy"),
    ([P1], [D1], {"port": 70000}, "port"),
    ([P1], [D1], {"api_key": " "}, "api_key"),
    ([P1], [D1], {"health_interval_s": 0}, "health_interval"),
    ([P1], [D1], {"health_grace_s": -1}, "health_grace"),
    ([P1], [D1], {"prefill_timeout_s": -1}, "prefill_timeout"),
])
def test_config_errors_name_the_field(prefill, decode, kw, field):
    with pytest.raises(BadInput) as e:
        build_config(prefill, decode, **kw)
    assert e.value.fields == (field,)
    assert "--" not in e.value.message  # library errors name fields, never flags


# --- the prefill rule ---

def test_prefill_request_rule():
    body = {"model": "m", "max_tokens": 30, "max_completion_tokens": 30, "min_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.7, "n": 1}
    out = prefill_request(body)
    assert out == {"model": "m", "max_tokens": 1, "max_completion_tokens": 1, "min_tokens": 1,
                   "stream": False, "temperature": 0.7, "n": 1}
    assert body["max_tokens"] == 30 and "stream_options" in body  # the client's body is untouched
    assert prefill_request({"min_tokens": True})["min_tokens"] is True  # not an int count: left to P
    assert encode({"t": 0.7, "s": "é"}) == '{"t":0.7,"s":"é"}'.encode()


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b'"x"', b"\xff\xfe"])
def test_parse_request_wants_a_json_object(raw):
    with pytest.raises(BadRequestBody):
        parse_request(raw)


# --- the pool ---

def _pool(policy: str, n: int = 3) -> Pool:
    c = build_config([f"http://127.0.0.1:{8100 + k}" for k in range(n)], [D1], policy=policy)
    pool = Pool("prefill", c.prefill, policy)
    for inst in pool:
        record_check(inst, True, "", started_at=0.0)
    return pool


def test_round_robin_skips_unhealthy_and_tried():
    pool = _pool("round_robin")
    assert [pool.pick().name for _ in range(4)] == ["prefill-0", "prefill-1", "prefill-2", "prefill-0"]
    mark_down(pool.instances[2], "cannot connect: connection refused")
    assert [pool.pick().name for _ in range(3)] == ["prefill-1", "prefill-0", "prefill-1"]
    assert pool.pick(exclude=pool.instances[:2]) is None
    assert pool.unhealthy_summary() == "prefill-2 (http://127.0.0.1:8102): cannot connect: connection refused"


def test_least_outstanding_and_its_ties_rotate():
    pool = _pool("least_outstanding")
    pool.instances[0].outstanding = 2
    pool.instances[1].outstanding = 1
    assert pool.pick().name == "prefill-2"
    pool.instances[2].outstanding = 1
    assert [pool.pick().name for _ in range(2)] == ["prefill-1", "prefill-2"]  # ties: round robin


def test_a_stale_health_check_cannot_revive_an_instance():
    pool = _pool("round_robin", 1)
    inst = pool.instances[0]
    mark_down(inst, "cannot connect", now=100.0)
    assert record_check(inst, True, "", started_at=99.0) is False and not inst.healthy
    assert record_check(inst, True, "", started_at=101.0) is True and inst.healthy
    assert inst.reason == ""
    assert record_check(inst, False, "/health answered 503", started_at=102.0) is True
    assert inst.to_json()["reason"] == "/health answered 503"


def test_a_timed_out_check_is_forgiven_until_the_grace_has_passed():
    inst = _pool("round_robin", 1).instances[0]
    assert record_check(inst, True, "", started_at=100.0, now=100.0) is False and inst.healthy
    for now in (103.0, 106.0, 129.0):  # no 200 for up to 29 s: still healthy, the misses counted
        assert record_check(inst, False, "timed out", started_at=now - 2, timed_out=True, grace_s=30.0, now=now) is False
        assert inst.healthy and inst.reason == ""
    assert inst.missed == 3
    assert record_check(inst, False, "timed out", started_at=130.0, timed_out=True, grace_s=30.0, now=132.0) is True
    assert not inst.healthy and inst.reason == "timed out (4 checks in a row; no 200 for 32.0 s)"
    assert record_check(inst, True, "", started_at=133.0, now=133.0) is True and inst.healthy and inst.missed == 0


def test_a_refusal_or_another_status_is_never_forgiven():
    for reason in ("cannot connect: connection refused", "/health answered 503"):
        inst = _pool("round_robin", 1).instances[0]
        record_check(inst, True, "", started_at=100.0, now=100.0)
        assert record_check(inst, False, reason, started_at=101.0, grace_s=30.0, now=101.0) is True
        assert not inst.healthy and inst.reason == reason


def test_the_grace_keeps_only_a_healthy_instance_healthy():
    inst = _pool("round_robin", 1).instances[0]
    record_check(inst, True, "", started_at=100.0, now=100.0)
    assert record_check(inst, False, "timed out", started_at=101.0, timed_out=True, now=101.0) is True  # no grace
    assert record_check(inst, False, "timed out", started_at=102.0, timed_out=True, grace_s=30.0, now=102.0) is False
    assert not inst.healthy  # a timed-out check does not bring it back
    fresh = Pool("decode", build_config([P1], [D1]).decode, "round_robin").instances[0]  # never answered
    assert record_check(fresh, False, "timed out", started_at=0.0, timed_out=True, grace_s=30.0, now=1.0) is False
    assert not fresh.healthy and fresh.reason == "timed out"


# --- the log line ---

def test_route_line_round_trips():
    rec = RouteRecord(id="req 1\"x", path="/v1/completions", stream=True, prefill="prefill-0",
                      decode=None, status=502, prefill_ms=12.345, error="no decode: connection refused")
    line = "2026-01-01 10:00:00 INFO kvctl.router: " + rec.line()
    back = parse_route_line(line)
    assert back == RouteRecord(id='req 1"x', path="/v1/completions", stream=True, prefill="prefill-0",
                               status=502, prefill_ms=12.3, error="no decode: connection refused")
    assert parse_route_line("INFO something else") is None
    assert rec.line().startswith(ROUTED + " id=")


# --- metrics ---

def test_metrics_text():
    m = Metrics()
    m.inc(m.requests, path="/v1/completions", status=200)
    m.inc(m.requests, path="/v1/completions", status=200)
    m.observe(m.prefill, 0.003, instance='p"0')
    text = m.render([("g", "a gauge", {"instance": "d"}, 1.0)])
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("kvctl_router_requests_total", (("path", "/v1/completions"), ("status", "200")))] == 2
    assert samples[("kvctl_router_prefill_seconds_bucket", (("instance", 'p"0'), ("le", "0.0025")))] == 0
    assert samples[("kvctl_router_prefill_seconds_bucket", (("instance", 'p"0'), ("le", "0.005")))] == 1
    assert samples[("kvctl_router_prefill_seconds_bucket", (("instance", 'p"0'), ("le", "+Inf")))] == 1
    assert samples[("kvctl_router_prefill_seconds_count", (("instance", 'p"0'),))] == 1
    assert families["kvctl_router_requests"].type == "counter"
    assert families["kvctl_router_prefill_seconds"].type == "histogram"
    assert families["g"].type == "gauge" and samples[("g", (("instance", "d"),))] == 1
    assert not any(name.endswith("_created") for name, _ in samples)
    assert text.endswith("\n")
