"""NIXL evidence from vLLM's /metrics, for instances whose logs kvctl cannot read (attached clusters).

vLLM 0.32 counts, per server (Prometheus text at /metrics):

    D  vllm:prompt_tokens_by_source_total{source=local_compute|local_cache_hit|external_kv_transfer}
                                          prompt tokens D computed, found in its prefix cache, pulled
    D  vllm:nixl_xfer_time_seconds_count  NIXL reads D completed (one per transfer)
    D  vllm:nixl_bytes_transferred_sum    bytes those reads moved
    D  vllm:nixl_num_failed_transfers_total  failed reads, handshakes and notifications
    P  vllm:nixl_num_kv_expired_reqs_total  requests whose KV lease expired on P
    P  vllm:nixl_num_notifications_after_expiry_total  reads of blocks P had already released

These are sums over every request the server ran, so a request's share is the change
between a reading just before it and one just after: true only while no other request
runs on the same servers (verify sends one at a time; every check says so). The
counters name no request, so a delta proves what happened on the server meanwhile, not
which request did it.

`counters(text)` reads one /metrics text; `check_pulled` and `check_sent` turn the two
readings around a request into kvctl.verify.checks results (pure).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvctl.verify.checks import CheckResult

PROMPT_TOKENS = "vllm:prompt_tokens_by_source"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
XFERS = "vllm:nixl_xfer_time_seconds_count"
BYTES = "vllm:nixl_bytes_transferred_sum"
FAILED = "vllm:nixl_num_failed_transfers"
EXPIRED = "vllm:nixl_num_kv_expired_reqs"
AFTER_EXPIRY = "vllm:nixl_num_notifications_after_expiry"
_COUNTERS = (FAILED, EXPIRED, AFTER_EXPIRY)
METRICS_NOTE = "from /metrics deltas around the request (its counters name no request: verify sends one at a time)"


@dataclass(frozen=True)
class Reading:
    """The NIXL-relevant counters of one /metrics text (summed over engines)."""

    prompt_tokens: Mapping[str, float]  # source -> tokens
    xfers: float
    bytes: float
    failed: float
    expired: float
    after_expiry: float

    def minus(self, before: "Reading") -> "Reading":
        return Reading({s: self.prompt_tokens.get(s, 0.0) - before.prompt_tokens.get(s, 0.0) for s in SOURCES},
                       self.xfers - before.xfers, self.bytes - before.bytes, self.failed - before.failed,
                       self.expired - before.expired, self.after_expiry - before.after_expiry)


def counters(text: str) -> Reading:
    """The counters of one /metrics text; a counter the server does not expose reads 0."""
    tokens = {s: 0.0 for s in SOURCES}
    found = {XFERS: 0.0, BYTES: 0.0, **{name: 0.0 for name in _COUNTERS}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == f"{PROMPT_TOKENS}_total" and sample.labels.get("source") in tokens:
                tokens[sample.labels["source"]] += sample.value
            elif name in (XFERS, BYTES):
                found[name] += sample.value
            elif name.removesuffix("_total") in _COUNTERS and name.endswith("_total"):
                found[name.removesuffix("_total")] += sample.value
    return Reading(tokens, found[XFERS], found[BYTES], found[FAILED], found[EXPIRED], found[AFTER_EXPIRY])


def total(deltas: "list[Reading]") -> Reading:
    """Several instances' deltas added up (a pool's)."""
    return Reading({s: sum(d.prompt_tokens.get(s, 0.0) for d in deltas) for s in SOURCES},
                   sum(d.xfers for d in deltas), sum(d.bytes for d in deltas), sum(d.failed for d in deltas),
                   sum(d.expired for d in deltas), sum(d.after_expiry for d in deltas))


def settled(delta: Reading | None) -> bool:
    """Whether D's counters show the whole request: its prompt tokens counted, and the NIXL read
    counted too when it pulled any (vLLM counts the read first, the prompt tokens once D schedules
    it), or a failed transfer."""
    if delta is None:
        return False
    pulled = delta.prompt_tokens.get("external_kv_transfer", 0.0)
    return delta.failed > 0 or (sum(delta.prompt_tokens.values()) > 0 and (pulled == 0 or delta.xfers > 0))


def _n(value: float) -> str:
    return f"{value:,.0f}"


def check_pulled(d_delta: Reading, prompt_tokens: int, decode: str) -> CheckResult:
    """decode_skipped_forward from D's /metrics deltas: D pulled N > 0 prompt tokens over NIXL, no
    transfer failed, and it computed none beyond its prefix cache (cached + pulled = the prompt)."""
    name = "decode_skipped_forward"
    t = d_delta.prompt_tokens
    pulled, cached, computed = (t.get("external_kv_transfer", 0.0), t.get("local_cache_hit", 0.0),
                                t.get("local_compute", 0.0))
    seen = (f"{decode}: prompt tokens external_kv_transfer +{_n(pulled)}, local_cache_hit +{_n(cached)}, "
            f"local_compute +{_n(computed)}; nixl transfers +{_n(d_delta.xfers)} ({_n(d_delta.bytes)} bytes), "
            f"failed +{_n(d_delta.failed)} ({METRICS_NOTE})")
    if d_delta.failed > 0:
        return CheckResult(name, False, f"D's NIXL transfers failed during the request: {seen}")
    if pulled + cached + computed == 0:
        return CheckResult(name, False, f"D's prompt token counters did not move: the request never reached "
                                        f"this D, or its counters were not yet updated: {seen}")
    if pulled <= 0:
        return CheckResult(name, False, f"D pulled 0 prompt tokens over NIXL and computed the prompt itself: {seen}")
    if computed > 0:
        return CheckResult(name, False, f"D pulled {_n(pulled)} tokens but computed {_n(computed)} of the "
                                        f"{prompt_tokens} prompt tokens itself: {seen}")
    return CheckResult(name, True, f"pulled={_n(pulled)} prefix_cached={_n(cached)} computed=0 of "
                                   f"prompt_tokens={prompt_tokens}: {seen}")


def check_sent(d_delta: Reading, p_delta: Reading | None, prefill: str) -> CheckResult:
    """kv_send_logged from /metrics deltas: D completed a NIXL read of P's blocks, and P counted no
    read of blocks whose lease had expired (`p_delta`, when P's /metrics are read).

    P's count of expired leases is reported, not failed on: it names no request, and a lease that
    expires unread is another request's (one whose D never pulled; this one's D did); had this
    request's lease expired first, D's read of it would count as a read after expiry."""
    name = "kv_send_logged"
    if p_delta is not None and p_delta.after_expiry > 0:
        return CheckResult(name, False, f"a decode read {prefill}'s blocks after their lease expired "
                                        f"(vllm:nixl_num_notifications_after_expiry +{_n(p_delta.after_expiry)}): "
                                        f"they were freed and may have held another prompt's KV ({METRICS_NOTE})")
    if d_delta.xfers <= 0:
        return CheckResult(name, False, f"D completed no NIXL read during the request "
                                        f"(vllm:nixl_xfer_time_seconds_count +0, failed +{_n(d_delta.failed)}): "
                                        f"P's blocks were never read ({METRICS_NOTE})")
    if p_delta is None:
        lease = "; P's lease counters not read (its /metrics unreachable)"
    elif p_delta.expired > 0:
        lease = (f"; meanwhile {prefill} released {_n(p_delta.expired)} other request(s)' blocks unread "
                 f"(vllm:nixl_num_kv_expired_reqs +{_n(p_delta.expired)}: a D that never pulled them)")
    else:
        lease = ""
    return CheckResult(name, True, f"D completed {_n(d_delta.xfers)} NIXL read(s) of {prefill}'s blocks "
                                   f"({_n(d_delta.bytes)} bytes), none after its lease expired{lease} "
                                   f"({METRICS_NOTE})")
