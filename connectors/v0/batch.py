"""Split a V0 model input into the prefill requests of one step.

In a V0 step, ``input_tokens[:num_prefill_tokens]`` holds the prefills one
after another (request i spans ``seq_lens[i]`` tokens) and the decode tokens
follow. A prefill that covers less than its whole prompt (chunked prefill,
or a prefix-cache hit) cannot be keyed by its full prompt: the spans then do
not add up and the step is reported as not transferable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillSpan:
    index: int
    start: int
    end: int

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
    spans, start = [], 0
    for i in range(num_prefills):
        spans.append(PrefillSpan(i, start, start + seq_lens[i]))
        start += seq_lens[i]
    problem = None
    if start != num_prefill_tokens:
        problem = (f"partial prefill: prompts hold {start} tokens but the step computes "
                   f"{num_prefill_tokens} (chunked prefill or prefix caching)")
    elif getattr(meta, "chunked_prefill", False) and num_decode:
        problem = "step mixes prefill and decode tokens (chunked prefill)"
    return StepPrefills(spans, num_decode, problem)


def span_tokens(model_input, span: PrefillSpan) -> torch.Tensor:
    return model_input.input_tokens[span.start:span.end]


def span_slots(model_input, span: PrefillSpan) -> torch.Tensor:
    return model_input.attn_metadata.slot_mapping.flatten()[span.start:span.end]
