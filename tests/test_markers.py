"""Log-line parsing on real-looking text: the seed's lines and our connectors' lines."""

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

# Our connectors' lines (the contract in the lead's brief to helpers).
OUR_P_LOG = f"""\
INFO 06-11 10:00:01 [logger.py:43] Received request chatcmpl-aa11: prompt: '<s><|user|>\\nHello<|end|>\\n<|assistant|>\\n', params: SamplingParams(max_tokens=1)
DEBUG 06-11 10:00:01 [fs_connector.py:120] [rank0]: KV send DONE. key={KEY_A} tokens=409 bytes=6701056 ms=3.412
DEBUG 06-11 10:00:01 [fs_connector.py:120] [rank0]: KV send DONE. key={KEY_B} tokens=12 bytes=196608 ms=0.5
INFO 06-11 10:00:01 [multi_connector.py:80] sent to connector FSConnector (child 0, 4.10 ms)
ERROR 06-11 10:00:01 [multi_connector.py:85] child 1 LMCacheConnector failed in send_kv_caches_and_hidden_states: OSError: [Errno 28] No space left on device
INFO 06-11 10:00:01 [multi_connector.py:80] sent to connector FSConnector (child 2, 1.25 ms)
"""

OUR_D_LOG = f"""\
DEBUG 06-11 10:00:02 [fs_connector.py:210] [rank0]: Successfully received all KVs and hidden states, skip model forwarding. keys={KEY_A},{KEY_B} tokens=421 bytes=6897664 ms=2.75
DEBUG 06-11 10:00:03 [fs_connector.py:220] [rank0]: Failed to receive all KVs and hidden states, redo model forwarding. reason=key {KEY_B}: corrupt (checksum mismatch)
"""


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
        (KEY_A, 409, 6701056, 3.412), (KEY_B, 12, 196608, 0.5)]
    assert sends[0].line.startswith("DEBUG 06-11") and sends[0].line.endswith("ms=3.412")


def test_children_sent_and_failed():
    sent = markers.child_sends(OUR_P_LOG)
    assert [(c.name, c.child, c.ms) for c in sent] == [("FSConnector", 0, 4.10), ("FSConnector", 2, 1.25)]
    failed = markers.child_failures(OUR_P_LOG)
    assert len(failed) == 1
    assert (failed[0].child, failed[0].name) == (1, "LMCacheConnector")
    assert "No space left on device" in failed[0].error


def test_our_skip_and_redo():
    skips = markers.skip_forwards(OUR_D_LOG)
    assert skips[0].keys == (KEY_A, KEY_B)
    assert (skips[0].tokens, skips[0].bytes, skips[0].ms) == (421, 6897664, 2.75)
    redos = markers.redo_forwards(OUR_D_LOG)
    assert len(redos) == 1
    assert redos[0].reason == f"key {KEY_B}: corrupt (checksum mismatch)"
    assert redos[0].mentions(KEY_B) and not redos[0].mentions(KEY_A)


def test_docker_prefixes_and_partial_last_line():
    text = (f"2025-06-11T10:00:01.123456789Z DEBUG [fs_connector.py:120] [rank1]: KV send DONE. "
            f"key={KEY_A} tokens=7 bytes=10 ms=0.1\n"
            "DEBUG [fs_connector.py:120] [rank0]: KV send DO")  # still being written
    sends = markers.kv_sends(text)
    assert len(sends) == 1 and sends[0].rank == 1 and sends[0].key == KEY_A


def test_unrelated_lines_do_not_match():
    text = ("INFO the prompt said: KV send DONE. key=abc\n"  # no [rankN]: prefix, e.g. echoed prompt text
            "INFO redo model forwarding later\n")
    assert markers.kv_sends(text) == []
    assert markers.redo_forwards(text) == []
    assert markers.skip_forwards("") == [] and markers.child_sends("") == []
