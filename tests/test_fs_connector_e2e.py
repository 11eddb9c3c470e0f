"""FSConnector end to end: real vLLM V0 CPU servers, P (kv_producer) -> store -> D (kv_consumer).

For each prompt: P gets max_tokens=1 and must publish a valid entry for
exactly the prompt's tokens; D gets max_tokens=12 and must skip its prefill
forward pass and produce the same token ids as a full greedy generation on P
(whose forward pass the producer hooks only read).
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from e2e_helpers import cluster_for_module, redo_lines_for, skip_line_for

from connectors.store import format as fmt
from kvctl.verify import markers
from kvctl.client import user_messages

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shared_dir, rig_python, tiny_model):
    with cluster_for_module(tmp_path_factory, shared_dir, rig_python, tiny_model, "fs-e2e") as c:
        yield c


def block_multiple_prompt(cluster, block: int = 16) -> str:
    """A prompt whose chat-templated length is an exact multiple of the block size."""
    words = "the sea was calm and a ship sailed past the old lighthouse at dawn".split()
    for n in range(1, 400):
        prompt = " ".join(words[i % len(words)] for i in range(n))
        count = len(cluster.p.tokenize_chat(user_messages(prompt)))
        if count % block == 0 and count >= 2 * block:
            return prompt
    raise AssertionError("no prompt length hit a block multiple")


PROMPTS = {
    "short": "Hello, how are you?",
    "long": "Hello, how are you?" * 67 + " Tell me about the lighthouse keeper's logbook. " * 20,
    "non_ascii": "Grüße aus Köln! 你好，世界。Как дела? ¿Qué tal? 🌊 déjà vu",
}


@pytest.mark.parametrize("kind", ["short", "block_multiple", "long", "non_ascii"])
def test_decode_skips_prefill_and_matches_baseline(cluster, kind):
    prompt = block_multiple_prompt(cluster) if kind == "block_multiple" else PROMPTS[kind]
    ex = cluster.exchange(prompt, max_tokens=12)
    if kind == "long":
        assert len(ex.tokens) > 1000
    if kind == "block_multiple":
        assert len(ex.tokens) % 16 == 0

    # P published an entry for exactly these tokens (key recomputed from the entry).
    assert ex.key, f"no valid entry holding the prompt's {len(ex.tokens)} tokens"
    header, data = fmt.read_entry(fmt.entry_path(cluster.store, ex.key))
    assert fmt.token_ids_of(header, data) == ex.tokens
    assert fmt.compute_key(header.identity, ex.tokens) == ex.key
    assert header.tensors["kv"]["shape"][2] == len(ex.tokens)

    # D skipped its forward for this key and never redid it.
    skip = cluster.wait_for("decode", lambda t: skip_line_for(t, ex.key))
    assert skip, f"decode did not log skip model forwarding for {ex.key}"
    assert not redo_lines_for(cluster.log("decode"), ex.key)

    # Same tokens as a full greedy generation.
    assert ex.decode_ids is not None and len(ex.decode_ids) == 12
    assert ex.decode_ids == ex.baseline_ids, (ex.decode_text, ex.baseline_text)


def test_concurrent_prompts_batch_in_one_step(cluster):
    """Several different prompts at once: P and D batch their prefills; every one transfers."""
    prompts = [f"Batch prompt number {i}: tell me about ship {i * 7}." for i in range(4)]
    msgs = [user_messages(p) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda m: cluster.p.chat(m, max_tokens=1), msgs))
        decoded = list(pool.map(lambda m: cluster.d.chat(m, max_tokens=10), msgs))
    baselines = [cluster.p.chat(m, max_tokens=10) for m in msgs]
    keys = [cluster._key_for(cluster.p.tokenize_chat(m)) for m in msgs]
    assert all(keys), keys
    text = cluster.wait_for("decode", lambda t: all(skip_line_for(t, k) for k in keys) and t)
    assert text, "decode did not skip the forward for every batched prompt"
    for k in keys:
        assert not redo_lines_for(text, k)
    # At least one decode step served several prefills at once (batch-aware recv).
    assert max(len(s.keys) for s in markers.skip_forwards(text)) >= 2
    assert [d.token_ids for d in decoded] == [b.token_ids for b in baselines]


def test_corrupted_entry_is_recomputed_not_served(cluster):
    prompt = "A prompt whose stored KV gets corrupted before decode reads it."
    msgs = user_messages(prompt)
    tokens = cluster.p.tokenize_chat(msgs)
    cluster.p.chat(msgs, max_tokens=1)
    key = cluster._key_for(tokens)
    path = fmt.entry_path(cluster.store, key)
    raw = bytearray(path.read_bytes())
    raw[-64] ^= 0x5A  # one byte inside the KV data
    path.write_bytes(bytes(raw))

    dec = cluster.d.chat(msgs, max_tokens=12)
    redo = cluster.wait_for("decode", lambda t: redo_lines_for(t, key))
    assert redo and "corrupt" in redo[-1].reason and "checksum" in redo[-1].reason
    assert not skip_line_for(cluster.log("decode"), key)
    assert dec.token_ids == cluster.p.chat(msgs, max_tokens=12).token_ids


def test_miss_is_recomputed(cluster):
    """A prompt P never saw: D logs the miss and still answers correctly."""
    msgs = user_messages("Only the decode instance ever sees this prompt.")
    dec = cluster.d.chat(msgs, max_tokens=8)
    redo = cluster.wait_for("decode", lambda t: [r for r in markers.redo_forwards(t)
                                                 if r.reason.startswith("miss")])
    assert redo
    assert dec.token_ids == cluster.p.chat(msgs, max_tokens=8).token_ids
