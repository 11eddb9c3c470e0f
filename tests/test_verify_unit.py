"""verify's checks, report shapes and CLI without vLLM.

The checks are pure functions over log text, store files and chat results, so
most tests feed them text and real store entries. The orchestration tests run
verify against two tiny HTTP servers that speak the three endpoints verify
uses and log our connectors' lines; they test verify's own logic (log offsets,
key matching with interleaved requests, exit codes), not the KV transfer,
which tests/test_verify_e2e.py proves on real vLLM servers.
"""

from __future__ import annotations

import json
import threading
import time
import xml.etree.ElementTree as ET
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from connectors.store.format import (
    KVIdentity,
    TensorBlob,
    compute_key,
    entry_path,
    write_entry,
)
from connectors import log_lines
from kvctl.verify import markers
from kvctl.cli import main
from kvctl.client import ChatResult
from kvctl.errors import BadInput, RuntimeFailure
from kvctl.verify.junit import verify_junit, write_verify_junit
from kvctl.verify.checks import (
    CHECKS,
    CheckResult,
    check_decode_skipped_forward,
    check_kv_send_logged,
    check_output_matches_baseline,
    check_store_entry_written,
    match_request_key,
)
from kvctl.verify.cluster_info import ClusterInfo, InstanceInfo, cluster_info
from kvctl.verify.prompts import load_prompts_file
from kvctl.verify.report import RequestReport, VerifyReport
from kvctl.verify.load_mode import ERROR_CHECK, run_load
from kvctl.verify.verifier import ClusterVerifier, RunOptions, expected_send_children, run_verify, verify_cluster

IDENT = KVIdentity(model="tiny", num_layers=2, kv_parts=2, kv_heads=2, head_size=4, dtype="F32")
SEED_P_CONFIG = {"kv_connector": "MultiConnectorV0", "kv_role": "kv_both", "kv_connector_extra_config": {
    "connectors": [{"kv_connector": "FSConnector", "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"fs_storage_path": "fs_local_storage", "transfer": True}},
                   {"kv_connector": "LMCacheConnector", "kv_role": "kv_both"}]}}
FS_PRODUCER = {"kv_connector": "FSConnector", "kv_role": "kv_producer",
               "kv_connector_extra_config": {"fs_storage_path": "store"}}
FS_CONSUMER = {"kv_connector": "FSConnector", "kv_role": "kv_consumer",
               "kv_connector_extra_config": {"fs_storage_path": "store"}}


def put_entry(store: Path, tokens: list[int], identity: KVIdentity = IDENT) -> str:
    """A real store entry for these tokens; returns its key."""
    import array

    n = len(tokens)
    kv_floats = identity.num_layers * identity.kv_parts * n * identity.kv_heads * identity.head_size
    blobs = {
        "token_ids": TensorBlob("I64", (n,), array.array("q", tokens).tobytes()),
        "kv": TensorBlob("F32", (identity.num_layers, identity.kv_parts, n, identity.kv_heads,
                                 identity.head_size), array.array("f", [0.5] * kv_floats).tobytes()),
        "hidden": TensorBlob("F32", (n, 8), array.array("f", [0.25] * n * 8).tobytes()),
    }
    key = compute_key(identity, tokens)
    write_entry(store, key, identity, blobs, fsync=False)
    return key


def send_line(key: str, tokens: int) -> str:
    return "DEBUG 06-11 10:00:01 [fs_connector.py:120] " + log_lines.KV_SEND % (0, key, tokens, 1024, 0.5, 0.1)


def skip_line(*keys: str) -> str:
    return "DEBUG 06-11 10:00:02 [fs_connector.py:210] " + log_lines.SKIP_FORWARD % (
        0, ",".join(keys), 12, 1024, 0.3, 0.2, 0.1)


def redo_line(key: str, why: str = "miss") -> str:
    return "DEBUG 06-11 10:00:02 [fs_connector.py:220] " + log_lines.REDO_FORWARD % (0, f"key {key}: {why}")


def child_sent_line(name: str, child: int, ms: float) -> str:
    return "INFO " + log_lines.CHILD_SENT % (name, child, ms)


def chat(ids: list[int], text: str | None = None) -> ChatResult:
    strs = [chr(97 + i % 26) for i in ids]
    return ChatResult(text="".join(strs) if text is None else text, token_ids=ids, token_strs=strs,
                      latency_s=0.01, request_id="chatcmpl-x", prompt_tokens=5, finish_reason="length")


# ------------------------------------------------------------------ key matching and P checks


def test_match_request_key_among_interleaved_requests(tmp_path):
    mine, other = [1, 5, 9, 12, 7], [1, 5, 9, 12, 8]  # same length: token count alone is ambiguous
    key_mine, key_other = put_entry(tmp_path, mine), put_entry(tmp_path, other)
    text = "\n".join([send_line(key_other, 5), send_line(key_mine, 5), send_line(key_other, 5)])
    match = match_request_key(markers.kv_sends(text), mine, tmp_path)
    assert match is not None and match.key == key_mine and match.identity == IDENT
    # once the identity is known, the key is computed without touching the store
    match2 = match_request_key(markers.kv_sends(text), mine, tmp_path / "nowhere", known=IDENT)
    assert match2.key == key_mine
    # another prompt's line with the same token count is never taken for ours
    assert match_request_key(markers.kv_sends(send_line(key_other, 5)), mine, tmp_path) is None


def test_match_falls_back_to_token_count_when_entry_unreadable(tmp_path):
    key = "ab" * 16
    match = match_request_key(markers.kv_sends(send_line(key, 3)), [1, 2, 3], tmp_path)
    assert match.key == key and match.identity is None
    assert match_request_key(markers.kv_sends(send_line(key, 4)), [1, 2, 3], tmp_path) is None


def test_kv_send_logged_passes_with_line_as_evidence(tmp_path):
    tokens = [3, 4, 5]
    key = put_entry(tmp_path, tokens)
    text = send_line(key, 3)
    check = check_kv_send_logged(match_request_key(markers.kv_sends(text), tokens, tmp_path), text, 3)
    assert check.passed and f"key={key}" in check.evidence


def test_kv_send_logged_fails_without_line():
    check = check_kv_send_logged(None, "INFO nothing here\n", 42)
    assert not check.passed and "42 tokens" in check.evidence and "KV send DONE" in check.evidence


def test_kv_send_logged_requires_each_child_line(tmp_path):
    tokens = [3, 4, 5]
    key = put_entry(tmp_path, tokens)
    children = expected_send_children(SEED_P_CONFIG)
    assert children == [(0, "FSConnector"), (1, "LMCacheConnector")]
    ok = "\n".join([send_line(key, 3), child_sent_line("FSConnector", 0, 1.0),
                    child_sent_line("LMCacheConnector", 1, 2.0)])
    match = match_request_key(markers.kv_sends(ok), tokens, tmp_path)
    check = check_kv_send_logged(match, ok, 3, children)
    assert check.passed and "LMCacheConnector" in check.evidence

    missing = "\n".join([send_line(key, 3), child_sent_line("FSConnector", 0, 1.0)])
    check = check_kv_send_logged(match, missing, 3, children)
    assert not check.passed and "sent to connector LMCacheConnector" in check.evidence

    failed = missing + "\nERROR " + log_lines.CHILD_SEND_FAILED % (0, 1, "LMCacheConnector", "boom")
    check = check_kv_send_logged(match, failed, 3, children)
    assert not check.passed and "boom" in check.evidence


def test_expected_children_only_producers():
    cfg = {"kv_connector": "MultiConnectorV0", "kv_role": "kv_both", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "FSConnector", "kv_role": "kv_consumer"},
                       {"kv_connector": "FSConnector"},  # no role of its own: never runs (nothing is inherited)
                       {"kv_connector": "LMCacheConnector", "kv_role": "kv_producer"},
                       {"kv_connector": "FSConnector", "kv_role": "kv_both"}]}}
    assert expected_send_children(cfg) == [(2, "LMCacheConnector"), (3, "FSConnector")]
    assert expected_send_children({**cfg, "kv_role": "kv_consumer"}) == []  # the parent never sends
    assert expected_send_children(FS_PRODUCER) == [] and expected_send_children({}) == []


# ------------------------------------------------------------------ store


def test_store_entry_written_passes_and_recomputes_key(tmp_path):
    tokens = list(range(40))
    key = put_entry(tmp_path, tokens)
    check = check_store_entry_written(tmp_path, key, tokens)
    assert check.passed, check.evidence
    assert str(entry_path(tmp_path, key)) in check.evidence and "bytes" in check.evidence


def test_store_entry_missing_corrupt_and_wrong_prompt(tmp_path):
    tokens = list(range(40))
    assert "no entry at" in check_store_entry_written(tmp_path, "cd" * 16, tokens).evidence
    assert not check_store_entry_written(tmp_path, "", tokens).passed

    key = put_entry(tmp_path, tokens)
    wrong = check_store_entry_written(tmp_path, key, tokens[:-1] + [999])
    assert not wrong.passed and "position 39" in wrong.evidence

    path = entry_path(tmp_path, key)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # flip a byte in the hidden states
    path.write_bytes(bytes(raw))
    bad = check_store_entry_written(tmp_path, key, tokens)
    assert not bad.passed and "corrupt" in bad.evidence and "checksum" in bad.evidence


# ------------------------------------------------------------------ D and outputs


def test_decode_skipped_forward():
    key, other = "a1" * 16, "b2" * 16
    ok = check_decode_skipped_forward(skip_line(other, key), key)
    assert ok.passed and key in ok.evidence

    missing = check_decode_skipped_forward(skip_line(other), key, hint="D was launched without a kv-transfer-config")
    assert not missing.passed and "skip model forwarding" in missing.evidence
    assert "without a kv-transfer-config" in missing.evidence

    nothing = check_decode_skipped_forward("INFO Added request chatcmpl-1.\n", key)
    assert not nothing.passed and "0 skip / 0 redo" in nothing.evidence

    redo = check_decode_skipped_forward("\n".join([skip_line(key), redo_line(key, "corrupt")]), key)
    assert not redo.passed and "redo model forwarding" in redo.evidence and "corrupt" in redo.evidence

    other_redo = check_decode_skipped_forward("\n".join([redo_line(other), skip_line(key)]), key)
    assert other_redo.passed

    assert not check_decode_skipped_forward(skip_line(key), "").passed


def test_output_matches_baseline_reports_first_difference():
    same = check_output_matches_baseline(chat([1, 2, 3, 4]), chat([1, 2, 3, 4]))
    assert same.passed and "4 tokens identical" in same.evidence

    diff = check_output_matches_baseline(chat([1, 2, 3, 9, 5]), chat([1, 2, 3, 4, 5]))
    assert not diff.passed
    assert "position 3" in diff.evidence and "9 'j'" in diff.evidence and "4 'e'" in diff.evidence
    assert "'bcdjf'" in diff.evidence and "'bcdef'" in diff.evidence

    shorter = check_output_matches_baseline(chat([1, 2]), chat([1, 2, 3]))
    assert not shorter.passed and "position 2" in shorter.evidence and "<end>" in shorter.evidence

    text_only = ChatResult("hello", None, None, 0.1, "x", None, None)
    assert check_output_matches_baseline(text_only, ChatResult("hello", None, None, 0.1, "y", None, None)).passed
    text_diff = check_output_matches_baseline(text_only, ChatResult("help!", None, None, 0.1, "y", None, None))
    assert not text_diff.passed and "character 3" in text_diff.evidence


# ------------------------------------------------------------------ report shapes


def sample_report() -> VerifyReport:
    good = RequestReport(prompt="Hello", prompt_tokens=12, key="a1" * 16,
                         checks=[CheckResult(n, True, f"{n} ok") for n in CHECKS],
                         decode_output="abc", baseline_output="abc", prefill_latency_s=0.1,
                         decode_latency_s=0.2, baseline_latency_s=0.3, transfer_bytes=1024)
    bad = RequestReport(prompt="Bye", prompt_tokens=7, key="b2" * 16,
                        checks=[CheckResult(n, n != "decode_skipped_forward", f"{n} \x01evidence <&>")
                                for n in CHECKS],
                        decode_output="x", baseline_output="x")
    return VerifyReport(cluster="c1", requests=[good, bad], max_tokens=8)


def test_json_contract():
    doc = json.loads(json.dumps(sample_report().to_json()))
    assert doc["cluster"] == "c1" and doc["passed"] is False
    assert doc["baseline"] == "prefill instance, full generation"
    for req in doc["requests"]:
        assert isinstance(req["prompt_tokens"], int) and isinstance(req["key"], str)
        assert isinstance(req["decode_output"], str) and isinstance(req["baseline_output"], str)
        assert [c["name"] for c in req["checks"]] == list(CHECKS)
        for c in req["checks"]:
            assert set(c) == {"name", "passed", "evidence"} and isinstance(c["passed"], bool)
    assert VerifyReport("c", [], 1).to_json()["passed"] is False  # nothing verified is not a pass


def test_junit_one_case_per_check(tmp_path):
    path = write_verify_junit(sample_report(), tmp_path / "verify.xml")
    root = ET.parse(path).getroot()  # parses: valid XML despite the control character
    assert root.tag == "testsuites" and root.get("tests") == "8" and root.get("failures") == "1"
    cases = root.findall("./testsuite/testcase")
    assert len(cases) == 8
    assert {c.get("name") for c in cases} == set(CHECKS)
    failed = [c for c in cases if c.find("failure") is not None]
    assert len(failed) == 1 and failed[0].get("name") == "decode_skipped_forward"
    assert failed[0].get("classname") == "kvctl.verify.c1.request1"
    assert "evidence <&>" in failed[0].find("failure").text
    assert verify_junit(sample_report()).getroot().find("testsuite").get("name") == "kvctl verify c1"
    with pytest.raises(BadInput):
        write_verify_junit(sample_report(), tmp_path / "no" / "such" / "dir" / "x.xml")


# ------------------------------------------------------------------ prompts and cluster state


def test_prompts_file_forms(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(["one\ntwo lines", "Grüße"]))
    assert load_prompts_file(tmp_path / "p.json") == ["one\ntwo lines", "Grüße"]
    (tmp_path / "p.txt").write_text("first\n\nsecond\n")
    assert load_prompts_file(tmp_path / "p.txt") == ["first", "second"]
    for name, text, needle in [("bad.json", "[1, 2", "not valid JSON"), ("ints.json", "[1, 2]", "list of strings"),
                               ("empty.txt", "\n\n", "no prompts"), ("blank.json", '["ok", " "]', "prompt 2 is empty")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(BadInput) as e:
            load_prompts_file(tmp_path / name)
        assert needle in e.value.what
    with pytest.raises(BadInput):
        load_prompts_file(tmp_path / "missing.txt")


def test_cluster_info_from_state_json(tmp_path):
    state = {"name": "c1", "runtime": "local", "model": "/m/tiny", "served_model_name": "tiny",
             "store": str(tmp_path), "instances": {
                 "prefill": {"role": "prefill", "url": "http://127.0.0.1:1", "log_path": "/l/p.log",
                             "kv_transfer_config": FS_PRODUCER, "pid": 1},
                 "decode": {"role": "decode", "url": "http://127.0.0.1:2", "log_path": "/l/d.log",
                            "kv_transfer_config": FS_CONSUMER, "pid": 2}}}
    info = cluster_info(state)
    assert info.model == "tiny" and info.store == tmp_path and info.decode.url.endswith(":2")
    del state["instances"]["decode"]["log_path"]
    with pytest.raises(BadInput) as e:
        cluster_info(state)
    assert "instances.decode.log_path" in e.value.what


@pytest.mark.parametrize("managed, fix", [(True, "launch it again with its router"),
                                           (False, "attach it with its router's URL")])
def test_verify_through_a_missing_endpoint_says_how_to_get_one(managed, fix):
    p = InstanceInfo("prefill", "http://127.0.0.1:1", Path("/l/p.log"), FS_PRODUCER)
    d = InstanceInfo("decode", "http://127.0.0.1:2", Path("/l/d.log"), FS_CONSUMER)
    info = ClusterInfo(name="c", model="m", store=None, prefill=p, decode=d, managed=managed)
    with pytest.raises(BadInput, match="has no endpoint") as e:
        ClusterVerifier(info, via_endpoint=True)
    assert e.value.fix.startswith(fix)


def test_cli_bad_input_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCTL_HOME", str(tmp_path))
    assert main(["verify", "--name", "nope"]) == 2
    assert "no cluster named 'nope'" in capsys.readouterr().err
    assert main(["verify", "--prompt", ""]) == 2
    assert "prompt 1 is empty" in capsys.readouterr().err
    assert main(["verify", "--prompts", str(tmp_path / "missing.txt")]) == 2
    (tmp_path / "p.txt").write_text("x\n")
    assert main(["verify", "--prompt", "a", "--prompts", str(tmp_path / "p.txt")]) == 2
    assert main(["verify", "--max-tokens", "0", "--prompt", "a"]) == 2
    assert main(["verify", "--name", "nope", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 2 and "nope" in doc["error"]


# ------------------------------------------------------------------ orchestration over HTTP


class FakeInstance:
    """Speaks /health, /tokenize, /v1/chat/completions; logs our connectors' lines.

    tokens = [1] + utf-8 bytes + [2]; the output is a fixed function of the
    prompt. A producer writes a real store entry; a consumer with
    `receives=True` logs skip for a valid entry and redo otherwise. Log lines are
    written slightly after the response on a thread, as a real server may.
    """

    def __init__(self, role: str, store: Path, log: Path, *, receives: bool = True, wrong_output: bool = False,
                 log_delay_s: float = 0.2):
        self.role, self.store, self.log = role, store, log
        self.receives, self.wrong_output, self.log_delay_s = receives, wrong_output, log_delay_s
        self._lock = threading.Lock()
        log.write_text("INFO start\n")
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep pytest output clean
                pass

            def do_GET(self):
                self._send(200, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                tokens = [1, *body["messages"][0]["content"].encode(), 2]
                if self.path == "/tokenize":
                    return self._send(200, {"tokens": tokens, "count": len(tokens)})
                self._send(200, fake.complete(tokens, body["max_tokens"]))

            def _send(self, code, doc):
                raw = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _log_later(self, line: str) -> None:
        def write():
            time.sleep(self.log_delay_s)
            with self._lock, open(self.log, "a") as f:
                f.write(line + "\n")
        threading.Thread(target=write).start()

    def complete(self, tokens: list[int], max_tokens: int) -> dict:
        key = compute_key(IDENT, tokens)
        if self.role == "prefill":
            put_entry(self.store, tokens)
            self._log_later(send_line(key, len(tokens)))
        elif self.receives:
            ok = check_store_entry_written(self.store, key, tokens).passed
            self._log_later(skip_line(key) if ok else redo_line(key, "corrupt"))
        out = [(sum(tokens) + 7 * i) % 50 + 3 for i in range(max_tokens)]
        if self.wrong_output and max_tokens > 2:
            out[2] += 1
        content = [{"token": f"token_id:{t}", "logprob": -0.1, "bytes": list(chr(97 + t % 26).encode())}
                   for t in out]
        return {"id": "chatcmpl-fake", "choices": [{"index": 0, "finish_reason": "length", "logprobs": {
            "content": content}, "message": {"role": "assistant", "content": "".join(chr(97 + t % 26) for t in out)}}],
            "usage": {"prompt_tokens": len(tokens)}}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_HOME", str(tmp_path / "home"))
    made = []

    def make(name="c1", **decode_kwargs) -> ClusterInfo:
        store = tmp_path / name / "store"
        store.mkdir(parents=True)
        p = FakeInstance("prefill", store, tmp_path / name / "p.log")
        d = FakeInstance("decode", store, tmp_path / name / "d.log", **decode_kwargs)
        made.extend([p, d])
        # the cluster.json contract of kvctl.cluster.spec
        state = {"name": name, "runtime": "local", "model": "/models/tiny", "served_model_name": "tiny",
                 "store": str(store), "created": "2025-06-11T10:00:00+00:00", "instances": {
                     "prefill": {"role": "prefill", "url": p.url, "log_path": str(p.log), "cwd": str(store),
                                 "kv_transfer_config": FS_PRODUCER, "pid": 1},
                     "decode": {"role": "decode", "url": d.url, "log_path": str(d.log), "cwd": str(store),
                                "kv_transfer_config": FS_CONSUMER if decode_kwargs.get("receives", True) else None,
                                "pid": 2}}}
        home = tmp_path / "home" / "clusters" / name
        home.mkdir(parents=True)
        (home / "cluster.json").write_text(json.dumps(state))
        return cluster_info(state)

    yield make
    for inst in made:
        inst.close()


def test_verify_cluster_all_checks_pass_concurrently(fake_cluster):
    info = fake_cluster()
    stages = []
    prompts = ["Hello", "Hellp", "Grüße 🚀", "x" * 300]  # first two: same token count
    report = verify_cluster(info, prompts, 6, lambda i, n, s: stages.append((i, s)), concurrency=4)
    assert report.passed, [c for r in report.requests for c in r.checks if not c.passed]
    assert [r.prompt_tokens for r in report.requests] == [7, 7, 14, 302]
    assert len({r.key for r in report.requests}) == 4
    assert report.requests[0].transfer_bytes == 1024 and report.requests[0].recv_ms == 0.3
    assert sorted(i for i, s in stages if s == "done") == [0, 1, 2, 3]


def test_cli_verify_json_and_junit(fake_cluster, tmp_path, capsys):
    fake_cluster("c1")
    junit = tmp_path / "v.xml"
    assert main(["verify", "--name", "c1", "--prompt", "Hello", "--prompt", "Bye",
                 "--max-tokens", "5", "--json", "--junit-xml", str(junit)]) == 0
    doc = json.loads(capsys.readouterr().out)  # exactly one JSON object
    assert doc["passed"] is True and doc["cluster"] == "c1" and len(doc["requests"]) == 2
    assert len(ET.parse(junit).getroot().findall("./testsuite/testcase")) == 8


def test_cli_verify_fails_when_decode_does_not_receive(fake_cluster, capsys):
    fake_cluster("plain", receives=False, log_delay_s=0.0)
    assert main(["verify", "--name", "plain", "--prompt", "Hello", "--max-tokens", "4"]) == 1
    out = capsys.readouterr().out
    assert "decode_skipped_forward" in out and "without a kv-transfer-config" in out
    assert "FAILED (1 failed checks)" in out


def test_verify_fails_on_output_difference(fake_cluster):
    info = fake_cluster("wrong", wrong_output=True)
    report = verify_cluster(info, ["Hello"], 5, log_wait_s=2.0)
    r = report.requests[0]
    assert not report.passed
    assert [c.name for c in r.checks if not c.passed] == ["output_matches_baseline"]
    assert "position 2" in r.check("output_matches_baseline").evidence


def test_unreachable_instance_is_runtime_failure(tmp_path):
    dead = InstanceInfo("prefill", "http://127.0.0.1:9", tmp_path / "p.log", {})
    info = ClusterInfo("dead", "tiny", tmp_path, dead, dead)
    with pytest.raises(RuntimeFailure) as e:
        verify_cluster(info, ["hi"], 2)
    assert "127.0.0.1:9" in e.value.what and "kvctl status" in e.value.fix


# ------------------------------------------------------------------ the one driver: its options


def test_driver_checks_the_send_children_it_is_given(fake_cluster):
    info = fake_cluster("kids")  # P logs no `sent to connector` line: a plain FSConnector
    run = run_verify(info, ["Hello"], RunOptions(max_tokens=3, send_children=[(0, "FSConnector")], log_wait_s=0.5))
    send = run.report.requests[0].check("kv_send_logged")
    assert not send.passed and "no `sent to connector FSConnector` line for child 0" in send.evidence
    assert run.wall_s > 0
    assert run_verify(info, ["Hello"], RunOptions(max_tokens=3)).report.passed  # default: P's own config


def test_driver_keeps_going_only_when_asked(fake_cluster, tmp_path):
    live = fake_cluster("half")
    dead = InstanceInfo("decode", "http://127.0.0.1:9", tmp_path / "d.log", {})
    info = ClusterInfo(live.name, live.model, live.store, live.prefill, dead)
    with pytest.raises(RuntimeFailure):
        run_verify(info, ["Hello", "Bye"], RunOptions(max_tokens=3))
    done = []
    load = run_load(info, ["Hello", "Bye"], 3, concurrency=2, progress=lambda i, n, s: done.append((i, s)))
    assert [[c.name for c in r.checks] for r in load.verify.requests] == [[ERROR_CHECK], [ERROR_CHECK]]
    assert load.load.to_json()["num_errors"] == 2 and not load.passed
    assert sorted(i for i, s in done if s == "done") == [0, 1]


def test_driver_errors_name_fields_and_the_cli_spells_them(fake_cluster, capsys):
    info = fake_cluster("fields")
    for options, field in ((RunOptions(max_tokens=0), "max_tokens"), (RunOptions(concurrency=0), "concurrency")):
        with pytest.raises(BadInput) as e:
            run_verify(info, ["Hello"], options)
        assert e.value.fields == (field,) and e.value.where is None and "--" not in (e.value.fix or "")
    with pytest.raises(BadInput) as e:
        run_verify(info, ["ok", " "], RunOptions())
    assert e.value.where == "prompts[1]"
    assert main(["verify", "--name", "fields", "--max-tokens", "0", "--prompt", "a"]) == 2
    assert "where: --max-tokens" in capsys.readouterr().err
