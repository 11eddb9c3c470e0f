"""The four checks per request, and what they read: pure over log text, store files and chat results.

    kv_send_logged          P logged `KV send DONE` for this prompt (and `sent to connector` per child)
    store_entry_written     the entry exists, validates, and holds exactly this prompt's token ids
    decode_skipped_forward  D logged `skip model forwarding` with this key, and no `redo`
    output_matches_baseline D's tokens equal the baseline's (P with the same max_tokens)

and, for a prefill with an offload child whose evidence kvctl can read (LMCacheMPConnector,
whose LMCache server kvctl runs: kvctl.cluster.lmcache), one more (OFFLOAD_CHECK):

    offload_logged          P's LMCache server stored or retrieved this prompt's whole chunks

and likewise for P's FSConnector offload child beside a NIXL transfer child (V1's
MultiConnector; kvctl.verify.children): P's FS child saved a valid entry holding exactly
this prompt in its own directory.

Each check returns a CheckResult with its evidence (a log line, a file, a
token diff); none raises for a failed check. Nothing here talks to a server.

A check whose evidence cannot be reached from here (an attached cluster's
instance without a log source, a store not visible on this host) is
`not_observable(name, reason)`: never passed, and reported with the reason;
whether it fails the run is the report's `require` (kvctl.verify.report).

So is the evidence of a third-party transfer connector (`third_party_checks`):
vLLM's ExampleConnector, LMCache, NIXL... log no per-request line kvctl can
match and write no entry of our store, so kv_send_logged, store_entry_written
and decode_skipped_forward are not observable for them (the reason names what
evidence remains: vLLM's server-wide /metrics counters); output_matches_baseline
is always checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from connectors.config.topology import transfer_connector
from connectors.store import auth
from connectors.store.format import (EntryCorrupt, KVIdentity, compute_key, entry_path,
                                     parse_header, read_entry, token_ids_of)
from kvctl.client import ChatResult
from kvctl.verify import markers

CHECKS = ("kv_send_logged", "store_entry_written", "decode_skipped_forward", "output_matches_baseline")
OFFLOAD_CHECK = "offload_logged"  # only on requests whose prefill has an offload child with a readable log
ERROR_CHECK = "request_completed"  # the check a request that raised fails (HTTP error, dead server)
BASELINE_KIND = "prefill instance, full generation"
COMPARE_EXACT = "exact"  # D's tokens equal the baseline's (the CPU default: both are deterministic)
COMPARE_TOLERANT = "tolerant"  # also pass a near-tie divergence (GPU: other batch shapes)
COMPARE_MODES = (COMPARE_EXACT, COMPARE_TOLERANT)
DEFAULT_EPSILON = 0.1  # nats: the baseline's top-2 logprob gap below which a divergence is a near-tie
EVIDENCE_TEXT_CHARS = 200  # outputs quoted in evidence are cut to this


@dataclass
class CheckResult:
    name: str
    passed: bool
    evidence: str
    observable: bool = True  # False: its evidence could not be reached (then never passed)

    @property
    def status(self) -> str:
        """passed | failed | not_observable"""
        return "passed" if self.passed else ("failed" if self.observable else "not_observable")

    def to_json(self) -> dict:
        data = {"name": self.name, "passed": self.passed, "evidence": self.evidence}
        if not self.observable:  # only then: the contract of every observed check is unchanged
            data["observable"] = False
        return data


def not_observable(name: str, reason: str) -> CheckResult:
    """A check kvctl could not see the evidence of: not passed, not failed; `reason` says why."""
    return CheckResult(name, False, f"not observable: {reason}", observable=False)


# What a V1 server still tells about a third-party connector (vLLM 0.32's /metrics): counters
# summed over every request the server ran, so they cannot vouch for one request.
METRICS_EVIDENCE = {
    "send": "vLLM 0.32 exposes no per-request save counter (a connector's own kv_connector stats, "
            "where it has any, are server-wide)",
    "recv": "D's /metrics counter vllm:external_prefix_cache_hits (prompt tokens D took from the "
            "connector) is summed over all requests, not this one",
}


def third_party_checks(prefill_config: dict | None, decode_config: dict | None) -> dict[str, CheckResult]:
    """The checks a third-party transfer connector hides, as not-observable results ({} when FS carries KV).

    P's side (its connector carries KV with no FSConnector: connectors.config.topology's
    `transfer_connector`): kv_send_logged and store_entry_written (the store is not ours);
    D's side: decode_skipped_forward. output_matches_baseline never appears here.
    """
    found: dict[str, CheckResult] = {}
    sender = transfer_connector(prefill_config, "send")
    if sender:
        found["kv_send_logged"] = not_observable(
            "kv_send_logged", f"P's transfer connector is {sender}, which logs no per-request send line kvctl "
                              f"can match (only FSConnector logs `{markers.KV_SEND}`); what remains: "
                              f"{METRICS_EVIDENCE['send']}")
        found["store_entry_written"] = not_observable(
            "store_entry_written", f"{sender} keeps KV in its own storage, not in an FS store kvctl can read")
    receiver = transfer_connector(decode_config, "recv")
    if receiver:
        found["decode_skipped_forward"] = not_observable(
            "decode_skipped_forward", f"D's transfer connector is {receiver}, which logs no per-request load "
                                      f"line kvctl can match; what remains: {METRICS_EVIDENCE['recv']}")
    return found


@dataclass(frozen=True)
class KeyMatch:
    """Which KV send line is this request's, and how we know."""

    key: str
    send: markers.KVSendLine | None
    identity: KVIdentity | None
    how: str


def match_request_key(sends: Sequence[markers.KVSendLine], tokens: Sequence[int], store: Path | None,
                      known: KVIdentity | None = None) -> KeyMatch | None:
    """Find this prompt's send line among P's new KV send lines.

    A line matches when its key equals compute_key(identity, tokens), with the
    identity known from an earlier request or read from the entry's header:
    safe with other requests' lines interleaved. Falls back to the only line
    with this prompt's token count (then `identity` is None); that is all
    there is when the store is not visible (`store` None).
    """
    candidates = [s for s in sends if s.key and (s.tokens is None or s.tokens == len(tokens))]
    if known is not None:
        expected = compute_key(known, tokens)
        for s in candidates:
            if s.key == expected:
                return KeyMatch(expected, s, known, "key = compute_key(identity, /tokenize ids)")
    unreadable = []  # entries we cannot open: maybe ours, maybe not
    for s in candidates:
        if store is None:
            unreadable.append(s)
            continue
        try:
            identity = parse_header(entry_path(store, s.key)).identity
        except (EntryCorrupt, OSError):
            unreadable.append(s)
            continue
        if compute_key(identity, tokens) == s.key:
            return KeyMatch(s.key, s, identity, "key = compute_key(entry identity, /tokenize ids)")
    if len({s.key for s in unreadable}) == 1:
        whose = "(the store is not visible here)" if store is None else "whose entry is unreadable"
        return KeyMatch(unreadable[-1].key, unreadable[-1], None,
                        f"the only KV send line with tokens={len(tokens)} {whose}")
    return None


def check_kv_send_logged(match: KeyMatch | None, p_text: str, num_tokens: int,
                         children: Sequence[tuple[int, str]] = ()) -> CheckResult:
    """P logged `KV send DONE` for this request (and `sent to connector` per child)."""
    name = "kv_send_logged"
    if match is None or match.send is None:
        seen = markers.kv_sends(p_text)
        shown = "; ".join(s.line for s in seen[-3:]) or "none"
        return CheckResult(name, False, f"no `{markers.KV_SEND}` line for this prompt ({num_tokens} tokens) "
                                        f"in P's log since the request; KV send lines seen: {shown}")
    evidence = [match.send.line]
    if match.send.tokens is not None and match.send.tokens != num_tokens:
        return CheckResult(name, False, f"send line has tokens={match.send.tokens}, /tokenize gave "
                                        f"{num_tokens}: {match.send.line}")
    sent = markers.child_sends(p_text)
    failed = markers.child_failures(p_text)
    problems = []
    for index, child_name in children:
        fail = [f for f in failed if f.child == index and f.name == child_name]
        if fail:
            problems.append(fail[0].line)
            continue
        ok = [s for s in sent if s.name == child_name and s.child in (None, index)]
        if ok:
            evidence.append(ok[0].line)
        else:
            problems.append(f"no `sent to connector {child_name}` line for child {index}")
    if problems:
        return CheckResult(name, False, "; ".join(problems + evidence))
    return CheckResult(name, True, " | ".join(evidence))


def check_store_entry_written(store: Path, key: str, tokens: Sequence[int],
                              keys: auth.StoreKeys | None = None) -> CheckResult:
    """The entry for `key` exists, validates, and is for exactly these token ids (and, with the
    cluster's store `keys`, carries a tag that verifies: what its decode instances require)."""
    name = "store_entry_written"
    if not key:
        return CheckResult(name, False, f"no key known for this prompt (P logged no KV send); store {store}")
    path = entry_path(store, key)
    try:
        header, data = read_entry(path, keys=keys)
    except FileNotFoundError:
        return CheckResult(name, False, f"no entry at {path}")
    except auth.EntryUnauthenticated as e:
        return CheckResult(name, False, f"entry {path} is refused by the cluster's store key: {e.reason}")
    except EntryCorrupt as e:
        return CheckResult(name, False, f"corrupt entry {path}: {e.reason}")
    except OSError as e:
        return CheckResult(name, False, f"cannot read {path}: {e}")
    stored = token_ids_of(header, data)
    if stored != list(tokens):
        pos = first_difference(stored, tokens)
        return CheckResult(name, False, f"{path}: stored token ids differ from /tokenize at position {pos} "
                                        f"({len(stored)} vs {len(tokens)} tokens)")
    recomputed = compute_key(header.identity, tokens)
    if recomputed != key:
        return CheckResult(name, False, f"{path}: compute_key(entry identity, /tokenize ids) = {recomputed}, "
                                        f"not the file's key")
    ident = header.identity
    return CheckResult(name, True, f"{path} ({header.file_size} bytes, {len(stored)} tokens, "
                                   f"{ident.num_layers} layers x {ident.kv_heads} kv heads x {ident.head_size}, "
                                   f"{ident.dtype}); checksum ok; key recomputed from identity + tokens"
                                   + (f"; tag verified (key {auth.signature_of(header.metadata)[0]})"
                                      if keys is not None else ""))


def check_decode_skipped_forward(d_text: str, key: str, hint: str = "") -> CheckResult:
    """D logged `skip model forwarding` with this key and no `redo` for it (V0), or
    a V1 `KV load DONE.` line for it whose counts show the prefill was skipped:
    loaded >= 1 and computed = prompt_tokens - prefix_cached - loaded.

    `hint` is appended to a failure's evidence (e.g. D has no kv-transfer-config).
    """
    name = "decode_skipped_forward"
    loads = [ld for ld in markers.kv_loads(d_text) if key and ld.key == key]
    if loads:  # a V1 decode: its last load line for this key decides
        ld = loads[-1]
        if ld.skipped_prefill:
            return CheckResult(name, True, f"loaded={ld.loaded} computed={ld.computed} of "
                                           f"prompt_tokens={ld.prompt_tokens} "
                                           f"(prefix_cached={ld.prefix_cached}): {ld.line}")
        why = (f"D loaded nothing from the store for key {key}" if ld.outcome != "DONE" or not ld.loaded
               else f"D computed {ld.computed} prompt tokens, not prompt_tokens - prefix_cached - loaded "
                    f"= {(ld.prompt_tokens or 0) - (ld.prefix_cached or 0) - (ld.loaded or 0)}")
        return CheckResult(name, False, f"{why}: {ld.line}" + (f"; {hint}" if hint else ""))
    skips = markers.skip_forwards(d_text)
    redos = markers.redo_forwards(d_text)
    if not key:
        return CheckResult(name, False, "no key known for this prompt (P logged no KV send), so no D line "
                                        f"can be matched; D logged {len(skips)} skip and {len(redos)} redo lines")
    mine_redo = [r for r in redos if r.mentions(key)]
    if mine_redo:
        return CheckResult(name, False, f"D redid the forward pass for key {key}: {mine_redo[0].line}")
    mine_skip = [s for s in skips if key in s.keys]
    if mine_skip:
        return CheckResult(name, True, mine_skip[0].line)
    others = f"; other lines: {skips[-1].line if skips else (redos[-1].line if redos else 'none')}"
    return CheckResult(name, False, f"D logged no `{markers.SKIP_FORWARD}` line for key {key} "
                                    f"({len(skips)} skip / {len(redos)} redo lines since the request{others})"
                                    + (f"; {hint}" if hint else ""))


def check_output_matches_baseline(decode: ChatResult, baseline: ChatResult, compare: str = COMPARE_EXACT,
                                  epsilon: float = DEFAULT_EPSILON) -> CheckResult:
    """D's tokens (or text, when ids are unavailable) equal the baseline's.

    `compare` tolerant (GPU, where P/D and the baseline run other batch shapes)
    also passes a divergence that is a near-tie: at the first differing
    position the baseline's own top-2 logprobs differ by less than `epsilon`
    and D's token is the baseline's runner-up. Past that position the two
    continuations are different texts, so nothing after it is compared.
    Anything else still fails: another token, a wide gap, a length change.
    """
    name = "output_matches_baseline"
    if decode.token_ids is not None and baseline.token_ids is not None:
        d_ids, b_ids = decode.token_ids, baseline.token_ids
        if d_ids == b_ids and decode.text == baseline.text:
            return CheckResult(name, True, f"{len(d_ids)} tokens identical ({BASELINE_KIND})")
        pos = first_difference(d_ids, b_ids)
        where = (f"first differing token at position {pos}: decode "
                 f"{_token_at(decode, pos)} vs baseline {_token_at(baseline, pos)}")
        texts = f"decode text {_quote(decode.text)}; baseline text {_quote(baseline.text)}"
        if compare == COMPARE_TOLERANT:
            tie = near_tie(decode, baseline, pos, epsilon)
            if tie.explained:
                return CheckResult(name, True, f"near-tie at position {pos}: {tie.describe()}; "
                                               f"{pos} tokens identical before it; {texts}")
            return CheckResult(name, False, f"{where} (not a near-tie: {tie.describe()}); {texts}")
        return CheckResult(name, False, f"{where}; {texts}")
    if decode.text == baseline.text:
        return CheckResult(name, True, f"texts identical, {len(decode.text)} chars (token ids unavailable)")
    pos = first_difference(decode.text, baseline.text)
    return CheckResult(name, False, f"texts differ from character {pos} (token ids unavailable); "
                                    f"decode {_quote(decode.text)}; baseline {_quote(baseline.text)}")


def offload_tokens(text: str) -> tuple[int, int]:
    """(stored, retrieved) tokens an LMCache server's log text reports."""
    lines = markers.lmcache_lines(text)
    return (sum(x.tokens for x in lines if x.what == markers.LMCACHE_STORED),
            sum(x.tokens for x in lines if x.what == markers.LMCACHE_RETRIEVED))


def check_offload_logged(text: str, prompt_tokens: int, chunk_size: int, child: str, server: str,
                         server_down: str = "") -> CheckResult:
    """P's offload child holds this prompt after the request: its LMCache server logged `Stored` or
    `Retrieved` lines covering the prompt's whole chunks in `text` (its log since the request).

    LMCache's lines name no request: they are counted by delta (so requests must not overlap on
    one server). A prompt shorter than one chunk has nothing to store (passed, said so).
    `server_down`: why the server cannot be reached (then the check fails naming the child).
    """
    name = OFFLOAD_CHECK
    who = f"P's offload child {child} (LMCache server {server})"
    whole = prompt_tokens // chunk_size * chunk_size if chunk_size > 0 else 0
    stored, retrieved = offload_tokens(text)
    shown = " | ".join(x.line for x in markers.lmcache_lines(text)[-3:])
    if server_down:
        return CheckResult(name, False, f"{who} failed: {server_down}; P served the request without it "
                                        f"(stored {stored}, retrieved {retrieved} tokens since the request)")
    if whole == 0:
        return CheckResult(name, True, f"{who}: nothing to store, {prompt_tokens} tokens are less than one "
                                       f"{chunk_size}-token chunk (LMCache keeps whole chunks only)")
    if stored + retrieved >= whole:
        return CheckResult(name, True, f"{who}: stored {stored}, retrieved {retrieved} of {whole} tokens "
                                       f"in whole chunks (counted by delta: its lines name no request): {shown}")
    return CheckResult(name, False, f"{who} stored {stored} and retrieved {retrieved} tokens since the request, "
                                    f"not the prompt's {whole} tokens in whole {chunk_size}-token chunks"
                                    + (f": {shown}" if shown else ": no `Stored`/`Retrieved` line in its log"))
@dataclass(frozen=True)
class NearTie:
    """The baseline's two best candidates at a divergence, and whether they explain it."""

    position: int
    decode_token: str  # "id 'text'"
    baseline_token: str
    runner_up: str | None  # the baseline's second candidate there; None: no logprobs
    gap: float | None  # baseline top-1 minus top-2 logprob (nats); None: unknown
    epsilon: float
    explained: bool

    def describe(self) -> str:
        if self.gap is None:
            return (f"the baseline has no top-2 logprobs at position {self.position} "
                    f"(decode {self.decode_token}, baseline {self.baseline_token})")
        rel = "<" if self.gap < self.epsilon else ">="
        ru = "is" if self.explained or self.runner_up == self.decode_token else "is not"
        return (f"decode {self.decode_token} vs baseline {self.baseline_token}, baseline gap "
                f"{self.gap:.4f} {rel} epsilon {self.epsilon:g}, decode's token {ru} the runner-up "
                f"({self.runner_up})")

    def to_json(self) -> dict:
        return {"position": self.position, "decode_token": self.decode_token,
                "baseline_token": self.baseline_token, "runner_up": self.runner_up,
                "gap": self.gap, "epsilon": self.epsilon, "explained": self.explained}


def near_tie(decode: ChatResult, baseline: ChatResult, pos: int, epsilon: float) -> NearTie:
    """Whether D's token at `pos` is the baseline's runner-up within `epsilon` of its best."""
    d_ids, b_ids = decode.token_ids or [], baseline.token_ids or []
    d_tok, b_tok = _token_at(decode, pos), _token_at(baseline, pos)
    tops = baseline.top_logprobs or []
    if pos >= len(d_ids) or pos >= len(b_ids) or pos >= len(tops) or len(tops[pos]) < 2:
        return NearTie(pos, d_tok, b_tok, None, None, epsilon, False)
    (best, best_lp), (second, second_lp) = tops[pos][0], tops[pos][1]
    gap = best_lp - second_lp
    runner = f"{second}"
    explained = gap < epsilon and d_ids[pos] == second and b_ids[pos] == best
    return NearTie(pos, d_tok, b_tok, d_tok if d_ids[pos] == second else runner, gap, epsilon, explained)


def first_difference(a: Sequence, b: Sequence) -> int:
    """Index of the first differing element; the shorter length if one is a prefix."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _token_at(result: ChatResult, pos: int) -> str:
    ids = result.token_ids or []
    if pos >= len(ids):
        return "<end>"
    text = (result.token_strs or [""] * len(ids))[pos]
    return f"{ids[pos]} {text!r}"


def _quote(text: str) -> str:
    return repr(text if len(text) <= EVIDENCE_TEXT_CHARS else text[:EVIDENCE_TEXT_CHARS] + "...")


def transfer_bytes(skip: markers.SkipForwardLine | None, send: markers.KVSendLine | None, store: Path | None,
                   key: str) -> int | None:
    """Bytes of this prompt's KV that travelled.

    D's skip line sums every prompt of its step (several when requests batch);
    P's send line says bytes=0 when the entry already existed; the entry's own
    data size settles both cases.
    """
    if skip is None:
        return send.bytes if send else None
    if len(skip.keys) == 1:
        return skip.bytes
    if send and send.bytes:
        return send.bytes
    if store is None:
        return None
    try:
        return parse_header(entry_path(store, key)).data_len
    except (EntryCorrupt, OSError):
        return None  # evicted since: unknown, rather than the whole batch's bytes


UNSEEN_ENTRY_FIX = ("mount D's store without a negative lookup cache: NFS `lookupcache=positive` (or "
                    "`actimeo=0`), sshfs/FUSE `negative_timeout=0` (docs/store-format.md, \"Network filesystems\")")


def explain_unseen_entry(store: Path | None, key: str, d_text: str, asked_at: float | None,
                         asked: str = "was asked") -> str:
    """Why D missed an entry the store holds, or "": D's view of the store lags P's side.

    Applies when D logged a miss for `key` (V0 redo `miss`, V1 `KV load NONE` /
    `FAILED` with a miss) and the entry is in `store` (P's side, as kvctl sees it),
    created before D was asked (`asked_at`, Unix time; through the endpoint, when
    D had answered: `asked` says which): a network mount's lookup cache kept
    showing D the name as absent.
    """
    if store is None or not key or asked_at is None:
        return ""
    missed = (any(r.mentions(key) and r.reason.startswith("miss") for r in markers.redo_forwards(d_text))
              or any(ld.key == key and ld.outcome != "DONE" and ld.reason.startswith("miss")
                     for ld in markers.kv_loads(d_text)))
    if not missed:
        return ""
    path = entry_path(store, key)
    try:
        header = parse_header(path)
    except (OSError, EntryCorrupt):
        return ""
    ahead_ms = (asked_at - header.created) * 1e3
    if ahead_ms <= 0:
        return ""  # published only after D was asked: a race, not a stale view
    return (f"the entry exists on P's side ({path}, published {ahead_ms:.0f} ms before D {asked}), but D did "
            f"not see it within {ahead_ms:.0f} ms: D's view of the store lags P's (a network mount's lookup or "
            f"attribute cache: NFS lookupcache/actimeo, FUSE negative_timeout); fix: {UNSEEN_ENTRY_FIX}")
