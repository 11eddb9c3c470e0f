"""Split a V0 model input into the prefill requests of one step.

In a V0 step, ``input_tokens[:num_prefill_tokens]`` holds the prefills one
after another (request i spans ``seq_lens[i]`` tokens) and the decode tokens
follow. A prefill that covers less than its whole prompt (chunked prefill,
or a prefix-cache hit) cannot be keyed by its full prompt: the spans then do
not add up and the step is reported as not transferable.

A request whose KV depends on more than its token ids cannot be keyed by
them, so its span carries a `refusal` (the request recomputes on a consumer
and is not published by a producer, with that reason logged):

- a LoRA adapter (the step's ``lora_mapping`` gives each token's adapter id;
  0 is the base model);
- multimodal inputs (placeholder token ids stand for the image or audio
  features): every request of a step with ``multi_modal_kwargs``;
- prompt embeddings (vLLM passes zeros as their token ids): every request of
  a step with ``inputs_embeds``;
- a prompt adapter (virtual tokens before the prompt): every request of a
  step with ``prompt_adapter_requests``.

Step-wide features refuse the whole step because the V0 input does not say
which request they belong to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillSpan:
    index: int
    start: int
    end: int
    refusal: str | None = None  # why this request's KV can't be keyed by its tokens

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class StepPrefills:
    spans: list[PrefillSpan]
    num_decode_tokens: int
    problem: str | None  # why the step's prefills can't be transferred, if so

    @property
    def transferable(self) -> bool:
        return self.problem is None and bool(self.spans)


def split_prefills(model_input) -> StepPrefills:
    meta = model_input.attn_metadata
    seq_lens = list(meta.seq_lens or [])
    num_prefills = int(meta.num_prefills)
    num_prefill_tokens = int(meta.num_prefill_tokens)
    num_decode = int(meta.num_decode_tokens)
    step_refusal = _step_refusal(model_input)
    lora_ids = _lora_ids(model_input)
    spans, start = [], 0
    for i in range(num_prefills):
        end = start + seq_lens[i]
        spans.append(PrefillSpan(i, start, end, step_refusal or _lora_refusal(lora_ids, start, end)))
        start = end
    problem = None
    if start != num_prefill_tokens:
        problem = (f"partial prefill: prompts hold {start} tokens but the step computes "
                   f"{num_prefill_tokens} (chunked prefill or prefix caching)")
    elif getattr(meta, "chunked_prefill", False) and num_decode:
        problem = "step mixes prefill and decode tokens (chunked prefill)"
    return StepPrefills(spans, num_decode, problem)


def _step_refusal(model_input) -> str | None:
    """Why no request of this step can be keyed by its token ids, or None."""
    if getattr(model_input, "inputs_embeds", None) is not None:
        return "prompt embeddings in the step (their token ids are placeholders)"
    if getattr(model_input, "multi_modal_kwargs", None):
        return "multimodal inputs in the step (their features are not in the token ids)"
    if getattr(model_input, "prompt_adapter_requests", None):
        return "prompt adapter in the step (its virtual tokens are not in the token ids)"
    return None


def _lora_ids(model_input) -> tuple[int, ...] | None:
    """Each input token's LoRA adapter id (0 = base model); None when LoRA is off."""
    mapping = getattr(model_input, "lora_mapping", None)
    if mapping is not None:
        return tuple(mapping.index_mapping)
    if getattr(model_input, "lora_requests", None):
        return ()  # adapters in the step but no per-token mapping: refuse every request
    return None


def _lora_refusal(lora_ids: tuple[int, ...] | None, start: int, end: int) -> str | None:
    if lora_ids is None:
        return None
    if len(lora_ids) < end:
        return "LoRA adapters in the step and no per-token adapter mapping"
    adapters = sorted({i for i in lora_ids[start:end] if i > 0})
    if adapters:
        return (f"LoRA adapter request (adapter id {','.join(map(str, adapters))}): its KV "
                f"depends on the adapter, not only the token ids")
    return None


def span_tokens(model_input, span: PrefillSpan) -> torch.Tensor:
    return model_input.input_tokens[span.start:span.end]


def span_slots(model_input, span: PrefillSpan) -> torch.Tensor:
    return model_input.attn_metadata.slot_mapping.flatten()[span.start:span.end]
