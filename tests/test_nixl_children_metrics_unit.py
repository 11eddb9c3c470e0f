"""What each child of a NIXL MultiConnector did (kvctl.verify.children), and NIXL evidence from
/metrics deltas (kvctl.verify.metrics), on real text: log lines and /metrics pages captured from
real vLLM 0.32 CPU servers (tests/nixl_real/, see its README), and real store entries."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvctl.verify import children, metrics
from kvctl.verify import nixl as nixl_evidence
from kvctl.verify.checks import OFFLOAD_CHECK
from kvctl.verify.report import RequestReport
from test_verify_unit import IDENT, put_entry

REAL = Path(__file__).parent / "nixl_real"


def _text(name: str) -> str:
    return (REAL / name).read_text()


# ---- /metrics deltas (kvctl.verify.metrics) ----

def _reading(**changes) -> metrics.Reading:
    base = metrics.Reading({s: 0.0 for s in metrics.SOURCES}, 0.0, 0.0, 0.0, 0.0, 0.0)
    tokens = {**base.prompt_tokens, **changes.pop("tokens", {})}
    return metrics.Reading(tokens, **{**{k: getattr(base, k) for k in ("xfers", "bytes", "failed", "expired",
                                                                       "after_expiry")}, **changes})


def test_counters_of_a_real_decodes_metrics_page():
    d = metrics.counters(_text("decode-metrics-after-4-requests.txt"))
    assert d.prompt_tokens == {"local_compute": 0.0, "local_cache_hit": 0.0, "external_kv_transfer": 609.0}
    assert (d.xfers, d.bytes, d.failed, d.expired, d.after_expiry) == (4.0, 1048576.0, 0.0, 0.0, 0.0)
    p = metrics.counters(_text("prefill-metrics-after-4-requests.txt"))
    assert p.prompt_tokens["external_kv_transfer"] == 0 and p.prompt_tokens["local_compute"] > 0
    assert p.xfers == 0  # P is read from, it reads nothing
    assert metrics.counters("") == _reading()  # a server without these counters reads 0


def test_a_request_that_d_pulled_passes_from_its_deltas():
    before = metrics.counters(_text("decode-metrics-before-request.txt"))
    after = metrics.counters(_text("decode-metrics-after-request.txt"))
    delta = after.minus(before)
    pulled = metrics.check_pulled(delta, int(delta.prompt_tokens["external_kv_transfer"]), "decode")
    assert pulled.passed and "computed=0 of prompt_tokens=" in pulled.evidence, pulled
    assert "/metrics deltas" in pulled.evidence
    sent = metrics.check_sent(delta, _reading(), "prefill")
    assert sent.passed and "1 NIXL read(s) of prefill's blocks" in sent.evidence, sent
    assert delta.prompt_tokens["external_kv_transfer"] == 15 and delta.xfers == 1 and metrics.settled(delta)


def test_a_read_counted_before_its_prompt_tokens_is_not_settled_yet():
    """vLLM counts D's NIXL read first and the prompt tokens once D schedules the request (seen 26 s apart
    on a loaded host): verify waits for both."""
    before = metrics.counters(_text("decode-metrics-before-request.txt"))
    mid = metrics.counters(_text("decode-metrics-mid-request.txt")).minus(before)
    assert mid.xfers == 1 and sum(mid.prompt_tokens.values()) == 0
    assert not metrics.settled(mid) and not metrics.settled(None)
    assert "did not move" in metrics.check_pulled(mid, 15, "decode").evidence


def test_a_decode_that_recomputed_or_failed_fails_from_its_deltas():
    recomputed = _reading(tokens={"local_compute": 40.0})
    check = metrics.check_pulled(recomputed, 40, "decode")
    assert not check.passed and "pulled 0 prompt tokens over NIXL" in check.evidence
    partly = _reading(tokens={"local_compute": 8.0, "external_kv_transfer": 32.0}, xfers=1.0)
    check = metrics.check_pulled(partly, 40, "decode")
    assert not check.passed and "computed 8 of the 40 prompt tokens itself" in check.evidence
    failed = _reading(tokens={"local_compute": 40.0}, failed=1.0)
    assert "NIXL transfers failed" in metrics.check_pulled(failed, 40, "decode").evidence
    assert "did not move" in metrics.check_pulled(_reading(), 40, "decode").evidence
    assert "completed no NIXL read" in metrics.check_sent(recomputed, None, "prefill").evidence


def test_a_read_after_ps_lease_expired_fails_the_send_and_an_unread_lease_is_reported():
    pulled = _reading(tokens={"external_kv_transfer": 40.0}, xfers=1.0)
    check = metrics.check_sent(pulled, _reading(after_expiry=1.0), "prefill")
    assert not check.passed and "after their lease expired" in check.evidence
    # a lease that expired unread is another request's (seen for real: an earlier load run's): reported only
    check = metrics.check_sent(pulled, _reading(expired=1.0), "prefill")
    assert check.passed and "released 1 other request(s)' blocks unread" in check.evidence
    assert "P's lease counters not read" in metrics.check_sent(pulled, None, "prefill").evidence


def test_verify_shows_each_childs_work_in_its_table_and_json():
    import io

    from rich.console import Console

    from kvctl.verify.checks import CheckResult
    from kvctl.verify.report import PART_LOAD, PART_OFFLOAD, PART_TRANSFER, ChildEvidence, VerifyReport
    from kvctl.views.verify import render_verify_report

    kids = [ChildEvidence(PART_TRANSFER, "prefill", "NixlConnector", 0, 37, {}, ("P line",)),
            ChildEvidence(PART_OFFLOAD, "prefill", "FSConnector", 1, 37, {"saved": 37}, ("P fs line", "D fs line")),
            ChildEvidence(PART_LOAD, "decode", "NixlConnector", 0, 37, {"prefix_cached": 0}, ("D line",))]
    checks = [CheckResult(n, True, "ok") for n in ("kv_send_logged", "store_entry_written", "decode_skipped_forward",
                                                  "output_matches_baseline", OFFLOAD_CHECK)]
    report = VerifyReport(cluster="m", requests=[RequestReport(prompt="p", prompt_tokens=37, key="0123456789abcdef",
                                                               checks=checks, children=kids)], max_tokens=8)
    out = io.StringIO()
    render_verify_report(report, Console(file=out, width=200))
    text = out.getvalue()
    assert "P offload: FSConnector (child 1)" in text and "P transfer: NixlConnector (child 0)" in text
    assert "saved 37" in text and "sent 37" in text and "loaded 37" in text
    assert "Stored/Retrieved" not in text  # the LMCache caption only under an LMCache offload child
    doc = report.to_json()["requests"][0]["children"]
    assert doc["offload"] == {"instance": "prefill", "connector": "FSConnector", "child": 1, "tokens": 37,
                              "saved": 37, "lines": ["P fs line", "D fs line"]}
    assert doc["transfer"]["connector"] == "NixlConnector" and doc["load"]["lines"] == ["D line"]


# ---- what each child did (kvctl.verify.children), on a real v1-nixl-multi request ----
# tests/nixl_real/multi-*.log: P's and D's lines of the request sent as X-Request-Id RID (15 prompt tokens)
RID = "9116f8e6d1654d6e9c8a9d572893bb54"
REAL_KEY = "a03e39f4c5e8ce57f2857a4d462b9db3"


def test_the_nixl_child_sent_and_d_pulled_on_real_lines():
    from kvctl.verify.report import PART_LOAD, PART_TRANSFER

    multi = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "NixlConnector"}, {"kv_connector": "FSConnector"}]}}
    ev = nixl_evidence.evidence(RID, _text("multi-prefill.log"), _text("multi-decode.log"))
    kids = {c.part: c for c in children.nixl_children(multi, multi, "prefill", "decode", ev)}
    assert kids[PART_TRANSFER].connector == "NixlConnector" and kids[PART_TRANSFER].child == 0
    assert kids[PART_TRANSFER].tokens == 15 and kids[PART_LOAD].tokens == 15
    assert f"Finished sending KV transfer for request chatcmpl-{RID}" in kids[PART_TRANSFER].lines[0]
    assert f"Finished recving KV transfer for request chatcmpl-{RID}" in kids[PART_LOAD].lines[0]
    other = nixl_evidence.evidence("someone-else", "", _text("multi-decode.log"))
    kids = {c.part: c for c in children.nixl_children(multi, multi, "prefill", "decode", other)}
    assert kids[PART_LOAD].tokens is None and kids[PART_LOAD].lines == ()


def test_the_fs_child_on_real_lines_needs_its_entry(tmp_path):
    """P's FS child logged the save (real line) but its dir holds no entry: the check fails naming the dir;
    D's FS child loaded nothing (NIXL served) and kept its own copy."""
    tokens = list(range(15))
    check, child, match = children.fs_offload(1, tokens, RID, _text("multi-prefill.log"), tmp_path,
                                              _text("multi-decode.log"), None)
    assert match is not None and match.key == REAL_KEY  # the one send line with the prompt's 15 tokens
    assert check.name == OFFLOAD_CHECK and not check.passed
    assert f"FSConnector (child 1, store {tmp_path})" in check.evidence and "no entry at" in check.evidence
    assert child.tokens is None and child.connector == "FSConnector" and child.child == 1
    p_send, entry, d_load, d_save = child.lines  # P's send and its (missing) entry, then D's FS child's lines
    assert REAL_KEY in p_send and "no entry at" in entry
    assert f"KV load NONE. req=chatcmpl-{RID}" in d_load  # D's FS child loaded nothing: NIXL served
    assert REAL_KEY in d_save  # and D kept its own copy
    check, _, _ = children.fs_offload(1, tokens, RID, _text("multi-prefill.log"), None, "", None)
    assert check.status == "not_observable"


def test_the_fs_child_passes_with_a_valid_entry_for_exactly_this_prompt(tmp_path):
    from test_verify_unit import send_line

    tokens = [5, 6, 7, 8, 9, 10, 11]
    key = put_entry(tmp_path, tokens)
    p_text = _text("multi-prefill.log") + "\n" + send_line(key, len(tokens))
    check, child, match = children.fs_offload(1, tokens, RID, p_text, tmp_path, _text("multi-decode.log"), None)
    assert check.passed and match.key == key and match.identity == IDENT, check
    assert child.tokens == 7 and child.detail == {"saved": 7} and key in child.lines[0]
    assert "checksum ok" in child.lines[1]
    (tmp_path / "other").mkdir()
    other = put_entry(tmp_path / "other", [1, 2, 3, 4, 5, 6, 7])  # same length, another prompt
    check, _, _ = children.fs_offload(1, tokens, RID, send_line(other, 7), tmp_path / "other", "", None)
    assert not check.passed  # its entry holds another prompt's tokens
