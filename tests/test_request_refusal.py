"""What changes KV besides token ids: refused per request, or part of the key (runs in the rig).

A LoRA adapter, multimodal inputs, prompt embeddings or a prompt adapter
make a request's KV depend on more than its token ids: FSConnector must
neither publish it under the token key nor serve it from there. The model
dtype (the hidden states' dtype) and the serving overrides are part of the
key. Small V0 model inputs drive the real connector against a real store.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import vllm  # noqa: F401  (runs in the rig; a missing vLLM must fail, not skip)

from connectors.store.deadline import StoreCallPool
from connectors.config.validate import ConfigError
from connectors.logs import SendFailureLog
from connectors.store import format as fmt
from connectors.store.fs_store import FSStore
from connectors.v0.batch import split_prefills
from connectors.v0.fs_connector import FSConnector, _model_identity
from connectors.v0.kv_layout import CacheGeometry, FlashAttentionLayout
from connectors.served_model import unkeyable_input_problems
from vllm.lora.layers import LoRAMapping
from vllm.multimodal.inputs import MultiModalKwargs

G = CacheGeometry(block_size=16, kv_heads=2, head_size=32)
LAYERS, BLOCKS, HIDDEN = 2, 8, 64
IDENT = fmt.KVIdentity(model="m;dtype=float32", num_layers=LAYERS, kv_parts=2, kv_heads=2,
                       head_size=32, dtype="F32")
PROMPT = list(range(100, 120))


def model_input(prompts: list[list[int]], lora_ids: list[int] | None = None, **extra):
    tokens = [t for p in prompts for t in p]
    n = len(tokens)
    meta = SimpleNamespace(seq_lens=[len(p) for p in prompts], num_prefills=len(prompts),
                           num_prefill_tokens=n, num_decode_tokens=0,
                           slot_mapping=torch.arange(n, dtype=torch.long))
    fields = dict(input_tokens=torch.tensor(tokens), attn_metadata=meta,
                  sampling_metadata=SimpleNamespace(seq_groups=[]))
    if lora_ids is not None:
        per_token = [i for p, i in zip(prompts, lora_ids) for _ in p]
        fields.update(lora_mapping=LoRAMapping(index_mapping=per_token, prompt_mapping=lora_ids,
                                               is_prefill=True),
                      lora_requests={f"lora-{i}" for i in lora_ids if i})
    fields.update(extra)
    return SimpleNamespace(**fields)


def connector(tmp_path) -> FSConnector:
    """A bound FSConnector (producer and consumer) on a real store, without a vLLM config."""
    c = FSConnector.__new__(FSConnector)
    c._io = StoreCallPool("fs-store-io", 2, 5.0)  # what __init__ sets up (store_timeout_ms)
    c.rank, c.store, c.num_layers, c.geometry = 0, FSStore(tmp_path / "store"), LAYERS, G
    c.hidden_size, c.hidden_dtype = HIDDEN, torch.float32
    (tmp_path / "store").mkdir()
    c._identity, c._layout = IDENT, FlashAttentionLayout(G)
    c._send_failures = SendFailureLog(logging.getLogger("vllm.kvctl.fs_connector"))
    return c


def caches(fill: float = 0.0):
    return [torch.full(FlashAttentionLayout.cache_shape(BLOCKS, G), fill) for _ in range(LAYERS)]


def hidden_for(mi):
    return torch.arange(mi.input_tokens.numel() * HIDDEN, dtype=torch.float32).view(-1, HIDDEN)


def test_split_marks_only_the_lora_request_of_a_mixed_step():
    step = split_prefills(model_input([PROMPT, PROMPT[:5]], lora_ids=[0, 3]))
    assert step.transferable
    assert step.spans[0].refusal is None
    assert "LoRA adapter request (adapter id 3)" in step.spans[1].refusal


@pytest.mark.parametrize("extra,words", [
    (dict(multi_modal_kwargs=MultiModalKwargs({"pixel_values": torch.zeros(1, 3)})), "multimodal"),
    (dict(inputs_embeds=torch.zeros(25, HIDDEN)), "prompt embeddings"),
    (dict(prompt_adapter_requests={"pa"}), "prompt adapter"),
    (dict(lora_requests={"lora-1"}, lora_mapping=None), "no per-token adapter mapping"),
])
def test_step_wide_inputs_refuse_every_request(extra, words):
    step = split_prefills(model_input([PROMPT, PROMPT[:5]], **extra))
    assert all(words in s.refusal for s in step.spans)


def test_empty_multimodal_kwargs_and_base_model_lora_ids_refuse_nothing():
    # The GPU runner always passes a (possibly empty) MultiModalKwargs; LoRA id 0 is the base model.
    step = split_prefills(model_input([PROMPT], lora_ids=[0], multi_modal_kwargs=MultiModalKwargs({})))
    assert step.spans[0].refusal is None


def test_lora_request_is_not_published_under_the_token_key(tmp_path, caplog):
    c = connector(tmp_path)
    mi = model_input([PROMPT], lora_ids=[1])
    with caplog.at_level(logging.INFO, logger="vllm.kvctl"):
        c.send_kv_caches_and_hidden_states(None, mi, caches(1.0), hidden_for(mi))
    assert not list((tmp_path / "store").iterdir())
    assert "KV not sent for request 0 (20 tokens): LoRA adapter request" in caplog.text
    # The same prompt on the base model is published.
    base = model_input([PROMPT], lora_ids=[0])
    c.send_kv_caches_and_hidden_states(None, base, caches(1.0), hidden_for(base))
    assert c.store.has_entry(fmt.compute_key(IDENT, PROMPT))


def test_lora_request_is_never_served_from_a_base_model_entry(tmp_path, caplog):
    """An entry exists for these exact tokens (base model): a LoRA request must still recompute."""
    c = connector(tmp_path)
    base = model_input([PROMPT])
    c.send_kv_caches_and_hidden_states(None, base, caches(1.0), hidden_for(base))
    target = caches(0.0)
    with caplog.at_level(logging.INFO, logger="vllm.kvctl"):
        hidden, bypass, _ = c.recv_kv_caches_and_hidden_states(
            None, model_input([PROMPT], lora_ids=[2]), target)
    assert (hidden, bypass) == (None, False)
    assert all(float(t.abs().sum()) == 0 for t in target), "KV was scattered for a refused request"
    assert "redo model forwarding. reason=request 0 (20 tokens) not served from the store: LoRA" in caplog.text
    # A batch with one LoRA request recomputes whole (the step is all or nothing).
    hidden, bypass, _ = c.recv_kv_caches_and_hidden_states(
        None, model_input([PROMPT, PROMPT], lora_ids=[0, 2]), caches(0.0))
    assert not bypass
    # Control: the base-model request is served.
    hidden, bypass, _ = c.recv_kv_caches_and_hidden_states(None, model_input([PROMPT], lora_ids=[0]),
                                                            caches(0.0))
    assert bypass and hidden is not None


@pytest.mark.parametrize("extra", [
    dict(multi_modal_kwargs=MultiModalKwargs({"pixel_values": torch.zeros(1, 3)})),
    dict(inputs_embeds=torch.zeros(20, HIDDEN)),
])
def test_multimodal_and_embeds_steps_neither_publish_nor_load(tmp_path, extra):
    c = connector(tmp_path)
    mi = model_input([PROMPT], **extra)
    c.send_kv_caches_and_hidden_states(None, mi, caches(1.0), hidden_for(mi))
    assert not list((tmp_path / "store").iterdir())
    base = model_input([PROMPT])
    c.send_kv_caches_and_hidden_states(None, base, caches(1.0), hidden_for(base))
    _, bypass, _ = c.recv_kv_caches_and_hidden_states(None, mi, caches(0.0))
    assert not bypass


@pytest.mark.parametrize("hidden,words", [
    (lambda h: h.to(torch.bfloat16), "hidden is BF16, this reader needs F32"),
    (lambda h: h[:, :32].contiguous(), "hidden has 32 columns"),
])
def test_hidden_state_of_another_dtype_or_size_is_never_served(tmp_path, caplog, hidden, words):
    """Keys include the model dtype; an entry whose hidden state still differs was crafted: recompute."""
    c = connector(tmp_path)
    mi = model_input([PROMPT])
    c.send_kv_caches_and_hidden_states(None, mi, caches(1.0), hidden(hidden_for(mi)))
    assert c.store.has_entry(fmt.compute_key(IDENT, PROMPT))
    with caplog.at_level(logging.INFO, logger="vllm.kvctl"):
        _, bypass, _ = c.recv_kv_caches_and_hidden_states(None, mi, caches(0.0))
    assert not bypass and words in caplog.text
    assert not c.store.has_entry(fmt.compute_key(IDENT, PROMPT))  # removed: P publishes it again


# -------------------------------------------------------------- start-up


def model_config(path, dtype=torch.bfloat16, **over):
    fields = dict(model=str(path), revision=None, dtype=dtype, quantization=None, rope_scaling={},
                  rope_theta=None, hf_overrides={}, hf_config_path=None, code_revision=None,
                  disable_sliding_window=False, override_attention_dtype=None,
                  enable_prompt_embeds=False)
    fields.update(over)
    return SimpleNamespace(**fields)


def test_prompt_embeds_are_refused_at_start_up_with_the_flag():
    [problem] = unkeyable_input_problems(model_config("/m", enable_prompt_embeds=True))
    assert problem.path == "--enable-prompt-embeds" and "without --enable-prompt-embeds" in problem.fix
    assert unkeyable_input_problems(model_config("/m")) == []


def test_model_dtype_and_overrides_are_part_of_the_model_key(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCTL_FINGERPRINT_CACHE", str(tmp_path / "fp"))
    bf16, described = _model_identity(model_config(tiny_model), None)
    assert bf16.startswith("files:xxh3_128:") and bf16.endswith(";dtype=bfloat16")
    assert "2 files" in described
    fp16, _ = _model_identity(model_config(tiny_model, dtype=torch.float16), None)
    assert fp16 != bf16 and fp16.split(";")[0] == bf16.split(";")[0]
    fp8, _ = _model_identity(model_config(tiny_model, quantization="fp8"), None)
    rope, _ = _model_identity(model_config(tiny_model, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), None)
    assert len({bf16, fp16, fp8, rope}) == 4
    # model_id replaces the weights part only: the serving settings still count.
    named, described = _model_identity(model_config(tiny_model), "llama-prod-v3")
    assert named == "llama-prod-v3;dtype=bfloat16" and "model_id" in described


def test_unidentifiable_model_is_a_start_up_error_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError) as e:
        _model_identity(model_config("org/never-downloaded"), None)
    [problem] = e.value.problems
    assert problem.path == "--model" and "model_id" in problem.fix
    assert _model_identity(model_config("org/never-downloaded"), "org-model")[0].startswith("org-model;")
