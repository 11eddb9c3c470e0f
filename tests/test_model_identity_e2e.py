"""Real vLLM servers on one kept store: new weights at the same path, and LoRA, never reuse KV.

1. A model M (seed 1) serves a prompt through P, filling the store. M is
   regenerated at the same path with seed 2 (same config, other weights) and
   P and D start again on the same store: P must not take the old entry for
   its own, D must not load it, and D's answer must equal a plain run of the
   new weights.
2. On that second cluster both servers have a LoRA adapter that rewrites K
   and V. A LoRA request on P must not publish its KV under the token key,
   so a base-model request for the same prompt on D answers as the base
   model; a LoRA request on D recomputes and says why.

Each check fails on a store keyed by the model path alone and on a connector
that ignores adapters.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from e2e_helpers import Cluster, skip_line_for
from safetensors.numpy import save_file

from connectors.store import format as fmt
from kvctl.client import VLLMClient, user_messages
from kvctl.provision.tiny_model import PRESETS, write_model
from kvctl.verify import markers

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm")]

PROMPT = "Tell me about the lighthouse keeper and the ship that sailed past at dawn."
LORA_PROMPT = "Please explain why the cache of a decode server must match its weights."
LORA_NAME = "kv-rewriter"


def write_lora(out: Path, rank: int = 8, seed: int = 7) -> Path:
    """A PEFT LoRA adapter for the tiny Llama that changes every layer's K and V projections."""
    p = PRESETS["tiny"]
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(p.layers):
        for proj in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, 0.5, (rank, p.hidden)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.5, (p.kv_heads * p.head_dim, rank)).astype(np.float32)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": ["k_proj", "v_proj"], "bias": "none", "lora_dropout": 0.0,
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False}))
    return out


def spec(name: str, model: Path, store: Path, fp_cache: Path, extra: tuple[str, ...] = ()):
    from kvctl.cluster.spec import build_1p1d_spec

    env = {"KVCTL_FINGERPRINT_CACHE": str(fp_cache)}
    return build_1p1d_spec(name=name, model=model, store=store, prefill_args=extra, decode_args=extra,
                           prefill_env=env, decode_env=env)


def entry_for(store: Path, tokens: list[int]) -> list[str]:
    """Keys of the valid entries in `store` holding exactly `tokens`."""
    keys = []
    for path in sorted(store.glob("*.safetensors")):
        header, data = fmt.read_entry(path)
        if fmt.token_ids_of(header, data) == tokens:
            keys.append(path.name.removesuffix(".safetensors"))
    return keys


def test_new_weights_at_the_same_path_and_lora_never_reuse_kv(tmp_path, rig_python, kvctl_home, vllm_slot):
    from kvctl.cluster.lifecycle import running_cluster

    model, store, fp_cache = tmp_path / "M", tmp_path / "store", tmp_path / "fingerprints"
    write_model(model, seed=1)
    msgs = user_messages(PROMPT)

    # -- 1st launch: old weights fill the store.
    with running_cluster(spec("mi-old", model, store, fp_cache)) as state:
        c = Cluster(state)
        try:
            tokens = c.p.tokenize_chat(msgs)
            c.p.chat(msgs, max_tokens=1)
            old_key = c._key_for(tokens)
            old_answer = c.p.chat(msgs, max_tokens=12).token_ids
            ident_line = c.wait_for("prefill", lambda t: [line for line in t.splitlines()
                                                          if "FSConnector model identity:" in line])
        finally:
            c.close()
    assert old_key, "the first P published no entry"
    old_model_id = fmt.parse_header(fmt.entry_path(store, old_key)).identity.model

    # -- Same path, same config, other weights.
    write_model(model, seed=2)
    lora = write_lora(tmp_path / "lora")
    lora_args = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "1",
                 "--lora-modules", f"{LORA_NAME}={lora}")
    with running_cluster(spec("mi-new", model, store, fp_cache, lora_args)) as state:
        c = Cluster(state)
        p_lora = VLLMClient(state.instances["prefill"].url, LORA_NAME, role="prefill")
        d_lora = VLLMClient(state.instances["decode"].url, LORA_NAME, role="decode")
        try:
            ex = c.exchange(PROMPT, max_tokens=12)

            lora_msgs = user_messages(LORA_PROMPT)
            lora_tokens = c.p.tokenize_chat(lora_msgs)
            p_lora.chat(lora_msgs, max_tokens=1)  # P prefills with the adapter
            not_sent = c.wait_for("prefill", lambda t: [line for line in t.splitlines()
                                                        if "KV not sent for request" in line and "LoRA" in line])
            published_for_lora = entry_for(store, lora_tokens)
            d_base = c.d.chat(lora_msgs, max_tokens=12)  # same tokens, base model
            base_answer = c.p.chat(lora_msgs, max_tokens=12).token_ids  # publishes the base entry
            lora_answer = p_lora.chat(lora_msgs, max_tokens=12).token_ids
            d_lora_answer = d_lora.chat(lora_msgs, max_tokens=12).token_ids  # base entry exists now
            d_log = c.wait_for("decode", lambda t: t if [r for r in markers.redo_forwards(t)
                                                         if "LoRA" in r.reason] else "")
            d_log = d_log or c.log("decode")
        finally:
            p_lora.close()
            d_lora.close()
            c.close()

    # 1. The new weights got a new key: P published again, D loaded only that.
    assert ex.key and ex.key != old_key, "P reused the old weights' entry"
    assert fmt.parse_header(fmt.entry_path(store, ex.key)).identity.model != old_model_id
    assert sorted(entry_for(store, ex.tokens)) == sorted([old_key, ex.key])
    assert skip_line_for(d_log, ex.key)
    assert not skip_line_for(d_log, old_key), "D loaded the old weights' KV"
    assert ex.decode_ids == ex.baseline_ids, (ex.decode_text, ex.baseline_text)
    assert ex.baseline_ids != old_answer  # the weights really changed what the model says

    # 2. The adapter matters, its KV was never published, D answered as the base model.
    assert lora_answer != base_answer, "the LoRA adapter does not change the output: no test"
    assert published_for_lora == [], "P published the LoRA request's KV under its token key"
    assert d_base.token_ids == base_answer
    assert not_sent, "P gave no reason for not sending the LoRA request's KV"
    # A LoRA request on D recomputes (with the reason), though the base entry for its tokens
    # exists now, and answers as the adapter does.
    [base_key] = entry_for(store, lora_tokens)
    assert "not served from the store: LoRA adapter request" in d_log
    assert not skip_line_for(d_log, base_key)
    assert d_lora_answer == lora_answer

    # The identity was logged once at start-up: a content fingerprint and the model dtype.
    assert ident_line and "files:xxh3_128:" in ident_line[0] and ";dtype=float32" in ident_line[0]
