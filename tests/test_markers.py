"""Log-line parsing on real-looking text: the seed's lines and our connectors' lines."""

from connectors import log_lines
from kvctl.verify import markers

KEY_A = "3f2a9c1b7e4d5a6b8c9d0e1f2a3b4c5d"
KEY_B = "00112233445566778899aabbccddeeff"

# Lines copied from the seed's P log (upstream format, no key=value tail).
SEED_P_LOG = """\
INFO 05-20 00:52:26 [logger.py:39] Received request chatcmpl-4c385ad864cb426dab9c3e31c82d073c: prompt: '<｜begin▁of▁sentence｜>User: Hello, how are you?\\n\\nAssistant:', params: SamplingParams(n=1, temperature=0.0, max_tokens=1), prompt_token_ids: None, lora_request: None, prompt_adapter_request: None.
INFO 05-20 00:52:26 [engine.py:313] Added request chatcmpl-4c385ad864cb426dab9c3e31c82d073c.
[2025-05-20 00:52:26,864] LMCache DEBUG: Retrieved 0 out of 409 out of total 409 tokens (cache_engine.py:330:lmcache.experimental.cache_engine)
DEBUG 05-20 00:52:27 [fs_connector.py:94] [rank0]: KV send DONE.
INFO 05-20 00:52:27 [multi_connector.py:67] sent to connector FSConnector
[2025-05-20 00:52:27,062] LMCache DEBUG: Stored 409 out of total 409 tokens (cache_engine.py:257:lmcache.experimental.cache_engine)
INFO 05-20 00:52:27 [multi_connector.py:67] sent to connector LMCacheConnector
"""

SEED_D_LOG = """\
INFO 05-20 00:52:46 [engine.py:313] Added request chatcmpl-471ab3691c8741768686f04e4a3123f1.
DEBUG 05-20 00:52:46 [fs_connector.py:170] [rank0]: Successfully received all KVs and hidden states, skip model forwarding.
"""


# Our connectors' lines, built from the templates they log (connectors.log_lines).
def _logged(prefix: str, template: str, *args) -> str:
    return prefix + template % args


_P = "DEBUG 06-11 10:00:01 [fs_connector.py:120] "
_M = "INFO 06-11 10:00:01 [multi_connector.py:80] "
OUR_P_LOG = "\n".join([
    "INFO 06-11 10:00:01 [logger.py:43] Received request chatcmpl-aa11: prompt: '<s><|user|>\\nHello<|end|>"
    "\\n<|assistant|>\\n', params: SamplingParams(max_tokens=1)",
    _logged(_P, log_lines.KV_SEND, 0, KEY_A, 409, 6701056, 3.4, 1.2),
    _logged(_P, log_lines.KV_SEND_STORED, 0, KEY_B, 12),
    _logged(_M, log_lines.CHILD_SENT, "FSConnector", 0, 4.1),
    _logged("ERROR 06-11 10:00:01 [multi_connector.py:85] ", log_lines.CHILD_SEND_FAILED, 0, 1,
            "LMCacheConnector", "OSError: [Errno 28] No space left on device"),
    _logged(_M, log_lines.CHILD_SENT, "FSConnector", 2, 1.3),
]) + "\n"

OUR_D_LOG = "\n".join([
    _logged("DEBUG 06-11 10:00:02 [fs_connector.py:210] ", log_lines.SKIP_FORWARD, 0, f"{KEY_A},{KEY_B}",
            421, 6897664, 2.8, 1.5, 1.0),
    _logged("DEBUG 06-11 10:00:03 [fs_connector.py:220] ", log_lines.REDO_FORWARD, 0,
            f"key {KEY_B}: corrupt (checksum mismatch)"),
]) + "\n"


def test_seed_kv_send_and_children():
    sends = markers.kv_sends(SEED_P_LOG)
    assert len(sends) == 1
    assert sends[0].rank == 0 and sends[0].key is None and sends[0].tokens is None
    children = markers.child_sends(SEED_P_LOG)
    assert [c.name for c in children] == ["FSConnector", "LMCacheConnector"]
    assert children[0].child is None and children[0].ms is None
    assert markers.received_requests(SEED_P_LOG) == ["chatcmpl-4c385ad864cb426dab9c3e31c82d073c"]


def test_seed_skip_line_without_keys():
    skips = markers.skip_forwards(SEED_D_LOG)
    assert len(skips) == 1 and skips[0].keys == ()
    assert markers.redo_forwards(SEED_D_LOG) == []


def test_our_kv_send_fields():
    sends = markers.kv_sends(OUR_P_LOG)
    assert [(s.key, s.tokens, s.bytes, s.ms) for s in sends] == [
        (KEY_A, 409, 6701056, 3.4), (KEY_B, 12, 0, 0.0)]
    assert sends[0].line.startswith("DEBUG 06-11") and sends[0].line.endswith("ms=3.4 gather_ms=1.2")


def test_children_sent_and_failed():
    sent = markers.child_sends(OUR_P_LOG)
    assert [(c.name, c.child, c.ms) for c in sent] == [("FSConnector", 0, 4.1), ("FSConnector", 2, 1.3)]
    failed = markers.child_failures(OUR_P_LOG)
    assert len(failed) == 1
    assert (failed[0].child, failed[0].name) == (1, "LMCacheConnector")
    assert "No space left on device" in failed[0].error


def test_our_skip_and_redo():
    skips = markers.skip_forwards(OUR_D_LOG)
    assert skips[0].keys == (KEY_A, KEY_B)
    assert (skips[0].tokens, skips[0].bytes, skips[0].ms) == (421, 6897664, 2.8)
    redos = markers.redo_forwards(OUR_D_LOG)
    assert len(redos) == 1
    assert redos[0].reason == f"key {KEY_B}: corrupt (checksum mismatch)"
    assert redos[0].mentions(KEY_B) and not redos[0].mentions(KEY_A)


def test_docker_prefixes_and_partial_last_line():
    text = (_logged("2025-06-11T10:00:01.123456789Z DEBUG [fs_connector.py:120] ", log_lines.KV_SEND,
                    1, KEY_A, 7, 10, 0.1, 0.0) + "\n"
            + (log_lines.KV_SEND % (0, KEY_B, 7, 10, 0.1, 0.0))[:19])  # "[rank0]: KV send DO": being written
    sends = markers.kv_sends(text)
    assert len(sends) == 1 and sends[0].rank == 1 and sends[0].key == KEY_A


def test_unrelated_lines_do_not_match():
    text = ("INFO the prompt said: KV send DONE. key=abc\n"  # no [rankN]: prefix, e.g. echoed prompt text
            "INFO redo model forwarding later\n")
    assert markers.kv_sends(text) == []
    assert markers.redo_forwards(text) == []
    assert markers.skip_forwards("") == [] and markers.child_sends("") == []


def test_every_v1_load_line_reads_back():
    log = "\n".join([
        log_lines.KV_LOAD_DONE % (0, "cmpl-1", KEY_A, 40, 32, 1, 7, 100, 1.5),
        "INFO " + log_lines.KV_LOAD_NONE % (0, "cmpl-2", KEY_B, 40, 40, 0, "no entry for key x"),
        "ERROR " + log_lines.KV_LOAD_FAILED % (1, "cmpl-3", KEY_A, 40, 40, 0, "OSError: boom", 3),
    ])
    loads = markers.kv_loads(log)
    assert [(x.outcome, x.rank, x.request, x.key, x.prompt_tokens, x.loaded, x.computed, x.prefix_cached)
            for x in loads] == [("DONE", 0, "cmpl-1", KEY_A, 40, 32, 1, 7), ("NONE", 0, "cmpl-2", KEY_B, 40, 0, 40, 0),
                                ("FAILED", 1, "cmpl-3", KEY_A, 40, 0, 40, 0)]
    assert loads[0].skipped_prefill and not loads[1].skipped_prefill
    assert loads[1].reason == "no entry for key x"
    assert loads[2].reason.startswith("OSError: boom; 3 blocks reported to vLLM as failed")


def test_operators_grep_phrases_are_in_the_templates():
    # The substrings operators and docs grep for: a template that loses one breaks them.
    assert "KV send DONE." in log_lines.KV_SEND and "KV send DONE." in log_lines.KV_SEND_STORED
    assert "skip model forwarding." in log_lines.SKIP_FORWARD
    assert "redo model forwarding. reason=" in log_lines.REDO_FORWARD
    for outcome, template in (("DONE", log_lines.KV_LOAD_DONE), ("NONE", log_lines.KV_LOAD_NONE),
                              ("FAILED", log_lines.KV_LOAD_FAILED)):
        assert template.startswith(f"[rank%d]: KV load {outcome}.")
    assert log_lines.CHILD_SEND_FAILED % (0, 1, "X", "e") == (
        "[rank0]: child 1 X failed in send_kv_caches_and_hidden_states: e")
