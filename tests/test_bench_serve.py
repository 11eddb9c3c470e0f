"""`kvctl bench serve` without servers: its input errors name the option, and the pure parts
(the tool's command line, the figures, the ratios, the store fraction from D's log text)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from connectors import log_lines
from kvctl.bench import serve
from kvctl.cluster.state import ClusterState, InstanceRecord, save_cluster
from kvctl.errors import BadInput

_RECEIVED = "INFO 12-01 [logger.py:43] Received request %s: prompt: 'x', params: ..."
V0_DECODE_LOG = "\n".join([
    _RECEIVED % "cmpl-a-0",
    _RECEIVED % "cmpl-b-0",
    "INFO 12-01 [fs_connector.py:231] " + log_lines.SKIP_FORWARD % (0, "aa,bb", 64, 10, 1.0, 0.5, 0.5),
    _RECEIVED % "cmpl-c-0",
    "INFO 12-01 [fs_connector.py:251] " + log_lines.REDO_FORWARD % (0, "no entry cc"),
]) + "\n"
V1_DECODE_LOG = "\n".join("INFO " + line for line in [
    log_lines.KV_LOAD_DONE % (0, "a", "aa", 64, 64, 0, 0, 1, 1.0),
    log_lines.KV_LOAD_NONE % (0, "b", "bb", 64, 64, 0, "no entry"),
    log_lines.KV_LOAD_DONE % (0, "c", "cc", 64, 48, 16, 0, 1, 1.0),
]) + "\n"


def test_store_fraction_v0_counts_keys_over_received_requests():
    got = serve.store_fraction(V0_DECODE_LOG, sent=99)
    assert (got["fraction"], got["served_from_store"], got["decode_requests"]) == (0.6667, 2, 3)


def test_store_fraction_v0_without_request_lines_uses_the_requests_sent():
    log = "\n".join(line for line in V0_DECODE_LOG.splitlines() if "Received request" not in line)
    got = serve.store_fraction(log, sent=4)
    assert (got["fraction"], got["decode_requests"]) == (0.5, 4) and "sent" in got["source"]


def test_store_fraction_v1_counts_load_lines():
    got = serve.store_fraction(V1_DECODE_LOG, sent=99)
    assert (got["fraction"], got["served_from_store"], got["decode_requests"]) == (0.6667, 2, 3)


def test_store_fraction_of_nothing_is_null_with_a_reason():
    got = serve.store_fraction("", sent=0)
    assert got["fraction"] is None and got["reason"]


RAW = {"num_prompts": 4, "completed": 3, "duration": 2.0, "request_throughput": 1.5, "output_throughput": 24.0,
       "total_output_tokens": 48, "p50_ttft_ms": 100.0, "p99_ttft_ms": 200.0, "mean_ttft_ms": 120.0,
       "p50_itl_ms": 10.0, "p99_itl_ms": 30.0, "mean_itl_ms": 12.0, "errors": ["", "", "", "boom"],
       "generated_texts": ["a", "b", "c", ""]}


def test_figures_and_ratios():
    pd = serve.target_figures(RAW, "http://pd")
    assert pd["completed"] == 3 and pd["failed"] == 1 and pd["first_error"] == "boom"
    assert pd["ttft_ms"] == {"p50": 100.0, "p99": 200.0, "mean": 120.0} and pd["tpot_ms"]["p50"] is None
    plain = serve.target_figures({**RAW, "p50_ttft_ms": 50.0, "request_throughput": 3.0}, "http://plain")
    ratios = serve.ratios_of(pd, plain)
    assert list(ratios) == list(serve.RATIO_KEYS)
    assert ratios["ttft_p50"] == 2.0 and ratios["ttft_p99"] == 1.0 and ratios["requests_per_s"] == 0.5
    assert serve.same_outputs(RAW, {**RAW, "generated_texts": ["a", "x", "c", ""]}) == {"compared": 3, "equal": 2}


def test_both_targets_get_the_same_prompts(tmp_path):
    opts = serve.check_options(serve.ServeOptions(requests=5, concurrency=2, input_len=32, output_len=8))
    a = serve.tool_argv(Path("/py"), "http://pd", "m", tmp_path, opts, tmp_path, "pd")
    b = serve.tool_argv(Path("/py"), "http://plain", "m", tmp_path, opts, tmp_path, "plain")
    differ = {x for x, y in zip(a, b) if x != y}
    assert differ == {"http://pd", "pd.json", "pd"}
    flags = dict(zip(a[5::2], a[6::2]))
    assert a[1:5] == ["-m", serve.LOAD_TOOL_MODULE, "bench", "serve"]
    assert {"--num-prompts", "--max-concurrency", "--random-input-len", "--random-output-len", "--seed"} <= set(a)
    assert flags["--dataset-name"] == "random" and "--ignore-eos" in a and "--save-detailed" in a


@pytest.mark.parametrize("options", [
    {"requests": 0}, {"input_len": -1}, {"output_len": 0}, {"concurrency": 0},
    {"request_rate": 0.0}, {"request_rate": float("inf")}, {"plain_url": "localhost:8000"},
    {"concurrency": None, "request_rate": None}, {"timeout_s": 0},
])
def test_check_options_names_the_field(options):
    with pytest.raises(BadInput) as e:
        serve.check_options(serve.ServeOptions(**options))
    expected = {"timeout_s": "timeout"}.get(next(iter(options)), next(iter(options)))
    assert expected in e.value.fields


@pytest.mark.parametrize("args, flag", [
    (["--requests", "0"], "--requests"),
    (["--concurrency", "-1"], "--concurrency"),
    (["--request-rate", "-2"], "--request-rate"),
    (["--input-len", "0"], "--input-len"),
    (["--output-len", "0"], "--output-len"),
    (["--plain-url", "not-a-url"], "--plain-url"),
    (["--tokenizer", "/nonexistent/model"], "--tokenizer"),
    (["--concurrency", "0"], "--concurrency"),
    (["--requests", "many"], "--requests"),
])
def test_bad_input_names_the_option_without_a_traceback(kvctl, args, flag):
    r = kvctl("bench", "serve", "nosuch", *args)
    assert r.rc == 2, r
    assert flag in r.stderr and "Traceback" not in r.stderr


def test_unknown_cluster_and_a_cluster_without_an_endpoint(kvctl, kvctl_home, tmp_path):
    r = kvctl("bench", "serve", "nosuch", "--json")
    assert r.rc == 2 and "no cluster named 'nosuch'" in r.stderr and "Traceback" not in r.stderr
    assert json.loads(r.stdout)["exit_code"] == 2
    state = ClusterState(name="bare", runtime="attached", model=str(tmp_path), served_model_name="m",
                         store=None, created="now", managed=False,
                         instances={"prefill": InstanceRecord("prefill", "http://127.0.0.1:9", "", None, "", {}, ""),
                                    "decode": InstanceRecord("decode", "http://127.0.0.1:9", "", None, "", {}, "")})
    save_cluster(state)
    r = kvctl("bench", "serve", "bare")
    assert r.rc == 2 and "has no endpoint" in r.stderr, r
    r = kvctl("bench", "serve", "bare", "--name", "other")
    assert r.rc == 2 and "two cluster names" in r.stderr, r


def test_help_says_why_this_load_tool(kvctl):
    r = kvctl("bench", "serve", "--help")
    assert r.rc == 0
    text = " ".join(r.stdout.split())
    assert "vllm bench serve" in text and "guidellm" in text and "--plain-url" in text
    assert "vllm bench serve" in serve.__doc__ and "guidellm" in serve.__doc__


def test_a_pd_run_waits_for_its_endpoint_to_be_healthy_again():
    """A router that holds no healthy instance for a moment (a starved host) answers /health 503:
    the load run waits for its 200 instead of meeting only 503s."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers = iter([503, 503, 200])

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(next(answers, 200))
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        state = ClusterState(name="nx", runtime="local", model="m", served_model_name="m", store="", created="",
                             endpoint=url, instances={})
        lines: list[str] = []
        serve._wait_endpoint("pd-nx", state, lines.append)
        assert lines == [f"pd-nx: waiting for {url} to answer /health (its router holds no healthy P or D)"]
        assert next(answers, "done") == "done"  # it asked until the 200
    finally:
        server.shutdown()
