"""kvctl.verify.nixl on vLLM 0.32's NIXL lines (as its scheduler and NixlConnector print them):
one request's lines found by its id among others', and each check's verdict and reason."""

from __future__ import annotations

from kvctl.verify import nixl

PARAMS = ("{'do_remote_prefill': True, 'do_remote_decode': False, 'remote_block_ids': [[0, 1, 2]], "
          "'remote_engine_id': 'e1', 'remote_request_id': 'chatcmpl-abc-0-12ab', 'remote_host': '127.0.0.1', "
          "'remote_port': 5600, 'tp_size': 1, 'remote_num_tokens': 300, 'transfer_mode': 'pull'}")
P_LOG = "\n".join([
    "(EngineCore pid=1) DEBUG 12-02 00:19:50 [scheduler.py:3233] Finished sending KV transfer for request "
    "chatcmpl-other-0-1",
    "(EngineCore pid=1) DEBUG 12-02 00:19:53 [scheduler.py:3233] Finished sending KV transfer for request "
    "chatcmpl-abc-0-12ab",
    "(Worker pid=3) WARNING 12-02 00:20:53 [base_worker.py:3032] Releasing expired KV blocks for request "
    "chatcmpl-late-0-7 which were retrieved by 0 remote worker(s) before lease expired.",
])
D_LOG = "\n".join([
    "(EngineCore pid=2) DEBUG 12-02 00:19:52 [pull_scheduler.py:52] NIXLConnector get_num_new_matched_tokens: "
    f"num_computed_tokens=128, kv_transfer_params={PARAMS}",
    "(EngineCore pid=2) DEBUG 12-02 00:19:52 [pull_scheduler.py:112] NIXLConnector update_state_after_alloc: "
    f"num_external_tokens=172, kv_transfer_params={PARAMS}",
    "(EngineCore pid=2) DEBUG 12-02 00:19:53 [scheduler.py:3223] Finished recving KV transfer for request "
    "chatcmpl-abc-0-99",
    # once pulled, vLLM logs the request again with the remote prefill cleared
    "(EngineCore pid=2) DEBUG 12-02 00:19:53 [pull_scheduler.py:112] NIXLConnector update_state_after_alloc: "
    "num_external_tokens=0, kv_transfer_params=" + PARAMS.replace("'do_remote_prefill': True", "'do_remote_prefill': False"),
])


def test_a_healthy_request_passes_with_its_own_lines():
    ev = nixl.evidence("abc", P_LOG, D_LOG)
    assert ev.settled
    sent, handed, pulled = nixl.check_sent(ev), nixl.check_handed(ev, 300), nixl.check_pulled(ev, 300)
    assert sent.passed and "chatcmpl-abc-0-12ab" in sent.evidence
    assert handed.passed and "handed 3 block(s) of 300 tokens at 127.0.0.1:5600" in handed.evidence
    assert pulled.passed and pulled.evidence.startswith("pulled=172 prefix_cached=128 computed=0 of prompt_tokens=300")


def test_ids_match_whole_segments_only():
    assert nixl.names("chatcmpl-abc-0-12ab", "abc") and nixl.names("cmpl-abc", "abc")
    assert not nixl.names("chatcmpl-abcd-0-1", "abc") and not nixl.names("chatcmpl-xabc-0", "abc")
    assert nixl.evidence("other", P_LOG, D_LOG).allocated is None  # its D lines are not abc's


def test_a_decode_that_computed_part_of_the_prompt_fails():
    ev = nixl.evidence("abc", P_LOG, D_LOG)
    pulled = nixl.check_pulled(ev, 310)
    assert not pulled.passed and "computed 10 of 310 prompt tokens itself" in pulled.evidence
    assert not nixl.check_handed(ev, 310).passed  # P's blocks hold 300 tokens, the prompt 310


def test_a_decode_that_pulled_nothing_or_failed_its_handshake_fails_naming_it():
    ev = nixl.evidence("zzz", P_LOG, D_LOG)
    assert "pulled nothing and recomputed the prompt" in nixl.check_pulled(ev, 10).evidence
    assert "no NIXL line whose kv_transfer_params name request zzz" in nixl.check_handed(ev, 10).evidence
    failed = D_LOG.splitlines()[:2] + [
        "(Worker pid=3) ERROR 12-02 00:19:55 [base_worker.py:1260] NIXL transfer failure: handshake_failed | "
        "Context: {'failure_type': 'handshake_failed', 'request_id': 'chatcmpl-abc-0-99', 'engine_id': 'x'}"]
    ev = nixl.evidence("abc", "", "\n".join(failed))
    assert ev.settled
    check = nixl.check_pulled(ev, 300)
    assert not check.passed and "its NIXL handshake with P's side channel failed" in check.evidence


def test_a_pull_from_a_dead_prefill_fails_naming_the_failure_and_the_policy():
    """P killed before D's pull (vLLM 0.32's lines, as D logged them): the check names the
    failed transfer setup and D failing the request under kv_load_failure_policy fail."""
    lines = D_LOG.splitlines()[:2] + [
        "(Worker pid=3) ERROR 12-05 09:41:19 [pull_worker.py:562] NIXL transfer failure: transfer_setup_failed. "
        "Deferring failure reporting until outstanding transfers finish | Context: {'failure_type': "
        "'transfer_setup_failed', 'request_id': 'chatcmpl-abc-0-99', 'engine_id': 'x'}",
        "(EngineCore pid=2) ERROR 12-05 09:41:19 [scheduler.py:3417] Failing 1 request(s) due to KV load failure "
        "(failure_policy=fail, 613 tokens affected). Request IDs: {'chatcmpl-abc-0-99'}",
        "(EngineCore pid=2) DEBUG 12-05 09:41:19 [scheduler.py:3223] Finished recving KV transfer for request "
        "chatcmpl-abc-0-99"]
    ev = nixl.evidence("abc", "", "\n".join(lines))
    assert ev.settled and ev.load_failed is not None
    check = nixl.check_pulled(ev, 300)
    assert not check.passed and "its pull failed (transfer_setup_failed)" in check.evidence
    assert "D failed the request (kv_load_failure_policy fail): " in check.evidence
    assert "Failing 1 request(s) due to KV load failure" in check.evidence
    assert nixl.evidence("other", "", "\n".join(lines)).load_failed is None
    only_policy = nixl.evidence("abc", "", "\n".join(lines[:2] + lines[3:]))
    check = nixl.check_pulled(only_policy, 300)
    assert not check.passed and "its KV load failed; D failed the request" in check.evidence

def test_an_expired_lease_fails_the_send_quoting_ps_line():
    ev = nixl.evidence("late", P_LOG, "")
    check = nixl.check_sent(ev)
    assert not check.passed and "lease on this request's KV blocks expired" in check.evidence
    assert "Releasing expired KV blocks for request chatcmpl-late-0-7" in check.evidence
    after = ("(Worker pid=3) ERROR 12-02 00:21:00 [pull_worker.py:667] Potentially invalid KV blocks for "
             "unrecognized request chatcmpl-gone-0-1 were retrieved by a decode worker. They may have expired.")
    check = nixl.check_sent(nixl.evidence("gone", after, ""))
    assert not check.passed and "after P's lease expired" in check.evidence



def test_a_different_answer_after_an_expired_lease_names_the_lease():
    from kvctl.verify.checks import CheckResult

    expired = nixl.check_sent(nixl.evidence("late", P_LOG, ""))
    differs = CheckResult("output_matches_baseline", False, "token ids differ at position 0")
    named = nixl.lease_named(differs, expired)
    assert not named.passed and named.evidence.startswith("token ids differ at position 0 (P's lease")
    assert "D read freed blocks" in named.evidence
    same = CheckResult("output_matches_baseline", True, "8 tokens identical")
    assert nixl.lease_named(same, expired) is same  # an equal answer stays passed (the send check fails)
    not_sent = nixl.check_sent(nixl.evidence("zzz", P_LOG, ""))  # no lease involved: unchanged
    assert nixl.lease_named(differs, not_sent) is differs

# ---- bench serve: NIXL's served-by-the-transfer fraction, the three-way table ----

def test_bench_counts_the_requests_d_pulled_over_nixl():
    from kvctl.bench import serve

    got = serve.store_fraction(D_LOG + "\n" + D_LOG.replace("chatcmpl-abc-0-99", "chatcmpl-def-0-3"), sent=4)
    assert (got["fraction"], got["served_from_store"], got["decode_requests"]) == (0.5, 2, 4)
    assert "NIXL `Finished recving`" in got["source"]


def test_the_three_way_table_has_fs_nixl_and_plain_side_by_side():
    from rich.console import Console

    from kvctl.bench import serve
    from kvctl.views.bench_serve import serve_table

    raw = {"completed": 8, "num_prompts": 8, "duration": 4.0, "request_throughput": 2.0, "output_throughput": 32.0,
           "p50_ttft_ms": 100.0, "p99_ttft_ms": 200.0, "p50_itl_ms": 10.0, "p99_itl_ms": 20.0}
    plain = serve.target_figures({**raw, "p50_ttft_ms": 50.0}, "http://plain")
    fs, nx = serve.target_figures(raw, "http://fs"), serve.target_figures({**raw, "p50_ttft_ms": 80.0}, "http://nx")
    store = {"fraction": 1.0, "served_from_store": 9, "decode_requests": 9, "source": "x"}
    result = {"cluster": "fs", "transfer": "fs", "pd": fs, "plain": plain, "ratios": serve.ratios_of(fs, plain),
              "store": store, "params": {"requests": 8, "input_len": 128, "output_len": 16, "concurrency": 4},
              "compared": [{"cluster": "nx", "transfer": "nixl", "figures": nx, "ratios": serve.ratios_of(nx, plain),
                            "store": store, "outputs": {"equal": 8, "compared": 8}}]}
    console = Console(record=True, width=200)
    console.print(serve_table(result))
    text = console.export_text()
    assert "FS P/D (fs)" in text and "NIXL P/D (nx)" in text and "plain vLLM" in text
    assert "FS / plain" in text and "NIXL / plain" in text
    ttft = next(line for line in text.splitlines() if line.strip().startswith("TTFT p50"))
    assert ttft.split()[3:] == ["100.00", "80.00", "50.00", "2.00", "1.60"]


def test_each_childs_evidence_with_nixl_as_the_transfer_child():
    """NIXL as the transfer child: P = MultiConnector [NixlConnector, LMCacheMPConnector], D =
    NixlConnector: P's send line, D's pull (tokens it pulled, what its prefix cache held) and the
    offload child's lines come back as separate parts."""
    from kvctl.verify.children import nixl_children
    from kvctl.verify.cluster_info import OffloadInfo
    from pathlib import Path

    nixl_p = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    p_cfg = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "connectors": [nixl_p, {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}]}}
    d_cfg = {**nixl_p, "kv_role": "kv_consumer"}
    off = OffloadInfo("LMCacheMPConnector", 1, "lmcache-prefill", "http://x", Path("/l"), 256)
    text = "LMCache INFO: Stored 256 tokens in 0.010 seconds\n"
    parts = {c.part: c for c in nixl_children(p_cfg, d_cfg, "prefill", "decode", nixl.evidence("abc", P_LOG, D_LOG),
                                              off, text)}
    assert (parts["transfer"].connector, parts["transfer"].child, parts["transfer"].tokens) == ("NixlConnector", 0, 172)
    assert "chatcmpl-abc-0-12ab" in parts["transfer"].lines[0]
    assert (parts["offload"].child, parts["offload"].detail["stored"]) == (1, 256)
    assert (parts["load"].connector, parts["load"].child, parts["load"].tokens) == ("NixlConnector", None, 172)
    assert parts["load"].detail == {"prefix_cached": 128} and "Finished recving" in parts["load"].lines[0]
    unseen = {c.part: c.tokens for c in nixl_children(p_cfg, d_cfg, "prefill", "decode", None, off, "")}
    assert unseen == {"transfer": None, "offload": None, "load": None}
