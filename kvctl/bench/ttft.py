"""TTFT bench: real vLLM V0 CPU servers, decode TTFT with KV loaded vs recomputed.

One cluster launch serves both figures:

    P  MultiConnectorV0 (kv_producer) -> [FSConnector on the shared store (transfer),
                                          FSConnector on a second dir]
    D  FSConnector consumer on the shared store

For each prompt length, each repeat uses two fresh prompts of that length:

    transfer    P answers it with max_tokens=1 (prefill, KV saved by both
                children), then D answers it with max_tokens=1: D loads the
                KV and skips its prefill (checked in D's log).
    recompute   D answers a prompt nobody has stored: a miss, then a full prefill.

    floor       D answers a 1-token prompt (token ids through /v1/completions):
                nothing to load and one token to compute, the least a
                request costs on that server.

D's skip line splits its own part of a transfer: `load_ms` (the store's
load: read, checksum, checks) and `scatter_ms` (into the paged cache),
reported as `d_store_load_ms` and `d_scatter_ms` beside `d_load_ms` (both).

TTFT is the whole max_tokens=1 HTTP round trip on D. Order alternates per
repeat; the best of N counts; one untimed round at the smallest length warms
both servers up. `ttft_transfer_vs_recompute` = transfer TTFT / recompute
TTFT; `ttft_transfer_vs_floor` = transfer TTFT / floor TTFT (both time
ratios: lower is better; the headline is the worst size, the largest).

Multi overhead comes from P's log: per request, MultiConnectorV0 logs each
child's whole send (`sent to connector X (child i, ms)`) and each FSConnector
logs its own store write (`KV send DONE ... ms=`). `multi_overhead` = the sum
of the children's send times as the multi connector measured them / the sum
of the children's own times (a time ratio: 1.0 = nothing added). A child's
own time is its store write (`ms=`) plus its gather from the paged cache
when it logs `gather_ms=`; without that the gap also holds the gather.
`multi_send_vs_gather_once` = the same sum of the children's sends / (one
gather + the children's store writes): the cost of the KV leaving P's paged
cache once and landing in every child's store. One gather is the largest
`gather_ms` a child logged for the request (a child that reused another's
gather logs ~0), so a multi connector that gathers per child pays the
extra gathers in the numerator only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import time
from pathlib import Path

from kvctl.bench.common import Progress, quiet
from kvctl.client import VLLMClient, user_messages
from kvctl.cluster.lifecycle import running_cluster
from kvctl.cluster.spec import DEFAULT_CONFIG, build_1p1d_spec
from kvctl.cluster.state import cluster_api_key, cluster_dir
from kvctl.errors import BadInput, KvctlError, RuntimeFailure
from kvctl.runtime.base import read_log_tail
from kvctl.verify import markers

LOG_WAIT_S = 15.0  # log lines are flushed asynchronously after the HTTP answer
LOG_TAIL_LINES = 40  # of each server's log, carried in an error (the logs go at teardown)
FIT_TRIES = 24  # tokenize rounds to bring a prompt to its target length
_WORDS = (
    "the cache holds keys and values for every layer of the model while a prefill runs "
    "over the prompt and a decode step reads them back one token at a time store disk "
    "file transfer request server memory block page slot head vector weather city river "
    "mountain story about quick brown fox jumps over lazy dog summary explain why because"
).split()


@dataclasses.dataclass
class Prompt:
    text: str
    tokens: int


def prompt_text(words: int, tag: str) -> str:
    """`words` words drawn with `tag` as the seed: another tag, another prompt."""
    rng = random.Random(tag)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def fit_prompt(client: VLLMClient, target: int, tag: str) -> Prompt:
    """A prompt whose chat-templated length is `target` tokens (within 1%)."""
    words, best = target, None
    for _ in range(FIT_TRIES):
        text = prompt_text(words, tag)
        n = len(client.tokenize_chat(user_messages(text)))
        if n <= target and (best is None or n > best.tokens):
            best = Prompt(text, n)
        if abs(n - target) <= max(1, target // 100):
            return Prompt(text, n)
        step = round((target - n) * words / max(n, 1))
        if abs(target - n) <= max(8, target // 20):  # close: step short of the estimate, no overshoot
            step = int((target - n) * words / max(n, 1)) or (1 if target > n else -1)
        words = max(1, words + step)
    if best is None:
        raise RuntimeFailure(f"could not build a prompt of about {target} tokens",
                             fix="use a larger prompt size")
    return _topped_up(client, best, target)


def _topped_up(client: VLLMClient, best: Prompt, target: int) -> Prompt:
    """`best` (<= target tokens) with words appended, each the one of _WORDS that comes closest
    without passing `target`: a word can be several tokens, so changing the word count alone
    may step over the target from both sides."""
    while abs(best.tokens - target) > max(1, target // 100):
        tries = (f"{best.text} {word}" for word in sorted(set(_WORDS)))
        fits = [Prompt(text, n) for text in tries
                if (n := len(client.tokenize_chat(user_messages(text)))) <= target]
        closer = max(fits, key=lambda p: p.tokens, default=None)
        if closer is None or closer.tokens <= best.tokens:
            return best
        best = closer
    return best


# --- P's log: one record per (multi) send step ---

@dataclasses.dataclass
class SendStep:
    tokens: int | None
    child_ms: dict[int, float]  # child index -> whole send, as MultiConnectorV0 timed it
    store_ms: dict[int, float]  # child index -> FSConnector's own `KV send DONE ... ms=`
    gather_ms: dict[int, float] = dataclasses.field(default_factory=dict)  # `gather_ms=`, if logged


_GATHER_MS_RE = re.compile(r"\bgather_ms=([\d.]+)")
_D_SPLIT_RE = re.compile(r"\bload_ms=([\d.]+) scatter_ms=([\d.]+)")  # D's skip line: store load, scatter


def send_steps(log_text: str) -> list[SendStep]:
    """Pair each child's `KV send DONE` with the `sent to connector` line that follows it."""
    steps: list[SendStep] = []
    pending_done: markers.KVSendLine | None = None
    for line in log_text.splitlines():
        done = markers.kv_sends(line)
        if done:
            pending_done = done[0]
            continue
        sent = markers.child_sends(line)
        if not sent or sent[0].child is None or sent[0].ms is None:
            continue
        child = sent[0].child
        if child == 0 or not steps:
            steps.append(SendStep(None, {}, {}))
        step = steps[-1]
        step.child_ms[child] = sent[0].ms
        if pending_done is not None and pending_done.ms is not None:
            step.store_ms[child] = pending_done.ms
            step.tokens = pending_done.tokens
            gather = _GATHER_MS_RE.search(pending_done.line)
            if gather:
                step.gather_ms[child] = float(gather.group(1))
        pending_done = None
    return steps


# --- the bench ---

def multi_config(store_a: Path, store_b: Path) -> dict:
    def child(path: Path, transfer: bool) -> dict:
        extra = {"fs_storage_path": str(path)}
        if transfer:
            extra["transfer"] = True
        return {"kv_connector": "FSConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": extra}

    return {"kv_connector": "MultiConnectorV0", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"connectors": [child(store_a, True), child(store_b, False)]}}


PROMPT_SLACK_TOKENS = 256  # max-model-len headroom over the largest requested prompt


def _max_positions(model: Path) -> int | None:
    try:
        return int(json.loads((model / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class _Run:
    """One launched cluster and what it has logged so far."""

    def __init__(self, state, progress: Progress):
        self.state = state
        self.progress = progress
        name = state.served_model_name
        key = cluster_api_key(state.name)
        self.p = VLLMClient(state.instances["prefill"].url, name, role="prefill", api_key=key)
        self.d = VLLMClient(state.instances["decode"].url, name, role="decode", api_key=key)

    def close(self) -> None:
        self.p.close()
        self.d.close()

    def log(self, role: str) -> str:
        return Path(self.state.instances[role].log_path).read_text(errors="replace")

    def wait_log(self, role: str, count, at_least: int) -> list:
        """Poll a log until `count(text)` has at least `at_least` items; returns them."""
        deadline = time.monotonic() + LOG_WAIT_S
        while True:
            found = count(self.log(role))
            if len(found) >= at_least or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def transfer(self, prompt: Prompt) -> dict:
        sends_before = len(send_steps(self.log("prefill")))
        skips_before = len(markers.skip_forwards(self.log("decode")))
        p = self.p.chat(user_messages(prompt.text), max_tokens=1)
        steps = self.wait_log("prefill", send_steps, sends_before + 1)
        d = self.d.chat(user_messages(prompt.text), max_tokens=1)
        skips = self.wait_log("decode", markers.skip_forwards, skips_before + 1)
        if len(skips) <= skips_before:
            raise RuntimeFailure(f"D recomputed a {prompt.tokens}-token prompt that P had just stored",
                                 where=self.state.instances["decode"].log_path,
                                 fix="read the decode log's `redo model forwarding` reason")
        step = steps[sends_before] if len(steps) > sends_before else None
        split = _D_SPLIT_RE.search(skips[-1].line)
        return {"p_s": p.latency_s, "ttft_s": d.latency_s, "load_ms": skips[-1].ms,
                "store_load_ms": float(split.group(1)) if split else None,
                "scatter_ms": float(split.group(2)) if split else None,
                "first_token_match": (p.token_ids == d.token_ids) if p.token_ids else None,
                "child_ms": sum(step.child_ms.values()) if step else None,
                "store_ms": sum(step.store_ms.values()) if step and step.store_ms else None,
                "gather_ms": sum(step.gather_ms.values()) if step and step.gather_ms else None,
                "gather_once_ms": max(step.gather_ms.values()) if step and step.gather_ms else None,
                "children": len(step.child_ms) if step else 0}

    def recompute(self, prompt: Prompt) -> dict:
        d = self.d.chat(user_messages(prompt.text), max_tokens=1)
        return {"ttft_s": d.latency_s}

    def floor(self, token_id: int) -> dict:
        """D's TTFT for a 1-token prompt: nothing in the store, one token to compute."""
        d = self.d.complete_tokens([token_id], max_tokens=1)
        return {"ttft_s": d.latency_s, "prompt_tokens": d.prompt_tokens}


def _log_tails(state, lines: int = LOG_TAIL_LINES) -> str:
    parts = []
    for role, inst in state.instances.items():
        tail = read_log_tail(Path(inst.log_path), lines)
        parts.append(f"--- last {len(tail)} lines of the {role} log ---\n" + "\n".join(tail))
    return "\n".join(parts)


def _best(values) -> float | None:
    values = [v for v in values if v is not None]
    return min(values) if values else None


FLOOR_TRIES = 3  # 1-token requests per round: cheap, and the floor is the noisiest figure


def bench_size(run: _Run, target: int, repeat: int, nonce: str, floor_token: int) -> dict:
    rounds = []
    for r in range(repeat):
        sent = fit_prompt(run.p, target, f"{nonce} t {target} {r}")
        fresh = fit_prompt(run.p, target, f"{nonce} r {target} {r}")
        if r % 2 == 0:
            t, c = run.transfer(sent), run.recompute(fresh)
            f = [run.floor(floor_token) for _ in range(FLOOR_TRIES)]
        else:
            f = [run.floor(floor_token) for _ in range(FLOOR_TRIES)]
            c, t = run.recompute(fresh), run.transfer(sent)
        floor = min(f, key=lambda x: x["ttft_s"])
        rounds.append({"tokens": sent.tokens, "recompute_tokens": fresh.tokens, "transfer": t,
                       "recompute": c, "floor": floor})
        run.progress(f"ttft {target} tokens, round {r + 1}/{repeat}: transfer "
                     f"{t['ttft_s'] * 1e3:.0f} ms, recompute {c['ttft_s'] * 1e3:.0f} ms, "
                     f"1-token floor {floor['ttft_s'] * 1e3:.0f} ms")
    tt = _best(x["transfer"]["ttft_s"] for x in rounds)
    tr = _best(x["recompute"]["ttft_s"] for x in rounds)
    tf = _best(x["floor"]["ttft_s"] for x in rounds)
    child = _best(x["transfer"]["child_ms"] for x in rounds)
    store = _best(x["transfer"]["store_ms"] for x in rounds)
    own = _best(x["transfer"]["store_ms"] + x["transfer"]["gather_ms"] for x in rounds
                if x["transfer"]["store_ms"] is not None and x["transfer"]["gather_ms"] is not None)
    once = _best(x["transfer"]["store_ms"] + x["transfer"]["gather_once_ms"] for x in rounds
                 if x["transfer"]["store_ms"] is not None and x["transfer"]["gather_once_ms"] is not None)
    ratios = {"ttft_transfer_vs_recompute": tt / tr, "ttft_transfer_vs_floor": tt / tf}
    if child is not None and (own or store):
        ratios["multi_overhead"] = child / (own or store)
    if child is not None and once:
        ratios["multi_send_vs_gather_once"] = child / once
    return {"target_tokens": target, "tokens": rounds[0]["tokens"],
            "ttft_transfer_s": tt, "ttft_recompute_s": tr, "ttft_floor_s": tf,
            "floor_prompt_tokens": rounds[0]["floor"]["prompt_tokens"],
            "p_latency_s": _best(x["transfer"]["p_s"] for x in rounds),
            "d_load_ms": _best(x["transfer"]["load_ms"] for x in rounds),
            "d_store_load_ms": _best(x["transfer"].get("store_load_ms") for x in rounds),
            "d_scatter_ms": _best(x["transfer"].get("scatter_ms") for x in rounds),
            "multi_children_send_ms": child, "children_store_ms": store,
            "children_gather_ms": _best(x["transfer"]["gather_ms"] for x in rounds),
            "gather_once_ms": _best(x["transfer"]["gather_once_ms"] for x in rounds),
            "multi_overhead_basis": "store write + gather" if own else "store write only",
            "first_token_match": all(x["transfer"]["first_token_match"] is not False for x in rounds),
            "ratios": ratios, "rounds": rounds}


def run(model: Path, sizes: list[int], repeat: int, progress: Progress = quiet,
        name: str | None = None, timeout_s: float = 600.0) -> dict:
    """Launch the bench cluster, measure every size, tear it down. Raw figures per size.

    Raises BadInput (model, sizes), RuntimeFailure (launch, requests, a
    transfer that did not happen).
    """
    limit = _max_positions(model)
    need = max(sizes) + 1
    if limit is not None and need > limit:
        raise BadInput(f"a prompt of {max(sizes)} tokens does not fit the model's {limit} positions",
                       field="sizes", fix=f"use prompt lengths below {limit}")
    name = name or f"bench-ttft-{os.getpid()}"
    cdir = cluster_dir(name)
    spec = build_1p1d_spec(name=name, model=model,
                           prefill_config=multi_config(cdir / "store", cdir / "store-b"),
                           decode_config=DEFAULT_CONFIG, timeout_s=timeout_s)
    # Prompts are built to about each size; chat templating can add a few dozen tokens.
    room = need + PROMPT_SLACK_TOKENS
    if room > spec.max_model_len:
        spec = dataclasses.replace(spec, max_model_len=min(limit or room, max(2048, room)))
    last_states: dict[str, str] = {}

    def on_launch(p) -> None:
        for role, rp in p.roles.items():
            if last_states.get(role) != rp.state:
                last_states[role] = rp.state
                progress(f"{role}: {rp.state} ({p.elapsed_s:.0f} s)")

    nonce = f"{os.getpid()}-{time.time_ns()}"
    started = time.monotonic()
    with running_cluster(spec, on_launch) as state:
        launch_s = time.monotonic() - started
        bench = _Run(state, progress)
        try:
            warm = min(sizes)  # first requests pay one-off costs; best-of-N covers the rest
            bench.transfer(fit_prompt(bench.p, warm, f"{nonce} warm t"))
            bench.recompute(fit_prompt(bench.p, warm, f"{nonce} warm r"))
            floor_token = bench.p.tokenize_chat(user_messages("hello"))[-1]
            bench.floor(floor_token)
            progress(f"ttft: warmed up at {warm} tokens")
            results = [bench_size(bench, t, repeat, nonce, floor_token) for t in sizes]
        except KvctlError as e:  # the cluster dir (logs included) goes at teardown: keep the tails
            e.details = "\n".join(filter(None, [e.details, _log_tails(state)]))
            raise
        finally:
            bench.close()
    return {"model": str(model), "served_model_name": spec.served_model_name, "dtype": spec.dtype,
            "launch_s": launch_s, "max_model_len": spec.max_model_len, "sizes": results}
