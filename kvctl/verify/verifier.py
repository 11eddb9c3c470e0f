"""Prove, request by request, that a 1P1D cluster's KV really travelled.

The hand-run flow of the seed, automated. Per prompt:

1. tokenize through P's /tokenize (chat template applied): the exact prompt ids;
2. P /v1/chat/completions, max_tokens=1, temperature=0 -> P prefills and sends;
3. find P's `KV send DONE. key=...` line for this prompt and the store entry;
   the key is recomputed from the entry's own identity and the /tokenize ids,
   which proves the entry is for exactly this prompt;
4. D /v1/chat/completions, max_tokens=K -> D must skip its prefill forward;
5. baseline: P again with max_tokens=K (prefill instance, full generation).

Checks: kv_send_logged, store_entry_written, decode_skipped_forward,
output_matches_baseline, each with evidence (a log line, a file, a token diff).

Log lines are matched by key, never by position, and each request only looks
at what its instances logged after it started: requests may run concurrently
(`concurrency`), as issue 7's load mode needs. Library code: nothing here
prints; it returns a VerifyReport or raises KvctlError.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from connectors.store.format import (EntryCorrupt, KVIdentity, compute_key, entry_path,
                                     parse_header, read_entry, token_ids_of)
from kvctl.verify import markers
from kvctl.client import ChatResult, VLLMClient, user_messages
from kvctl.errors import BadInput
from kvctl.paths import kvctl_home

CHECKS = ("kv_send_logged", "store_entry_written", "decode_skipped_forward", "output_matches_baseline")
BASELINE_KIND = "prefill instance, full generation"
DEFAULT_MAX_TOKENS = 16
LOG_WAIT_S = 5.0  # how long a log line may lag behind the HTTP response
LOG_POLL_S = 0.1
EVIDENCE_TEXT_CHARS = 200  # outputs quoted in evidence are cut to this

_LONG_SENTENCES = (
    "The prefill server reads the whole prompt once and writes its key value cache to the store.",
    "Then the decode server loads that cache from disk and starts to generate the answer at once.",
    "Please tell me a long story about a quick brown fox who jumps over the lazy dog every day.",
    "Each layer has a key and a value for every token, so the file grows with the prompt length.",
    "If the cache is missing or corrupt, the decode server must compute the prefill by itself.",
)
# Short, the seed's repeated prompt, long (~1000+ tokens on the tiny model), non-ASCII.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "Hello, how are you?",
    "Hello, how are you?" * 67,
    " ".join(f"({i}) {_LONG_SENTENCES[i % len(_LONG_SENTENCES)]}" for i in range(36)),
    "Grüße aus Zürich! Привет, мир. 你好世界，今天天气很好。東京でこんにちは 🚀 — café, naïve, señor.",
)


# ------------------------------------------------------------------ cluster


@dataclass(frozen=True)
class InstanceInfo:
    role: str
    url: str
    log_path: Path
    kv_transfer_config: dict


@dataclass(frozen=True)
class ClusterInfo:
    """What verify needs from a cluster's state, whatever runtime launched it."""

    name: str
    model: str  # the name requests use (served model name)
    store: Path
    prefill: InstanceInfo
    decode: InstanceInfo


def _as_dict(state: Any) -> dict:
    if isinstance(state, dict):
        return state
    for method in ("to_json", "to_dict", "model_dump"):
        if callable(getattr(state, method, None)):
            return getattr(state, method)()
    if dataclasses.is_dataclass(state):
        return dataclasses.asdict(state)
    raise TypeError(f"cannot read cluster state of type {type(state).__name__}")


def cluster_info(state: Any) -> ClusterInfo:
    """ClusterInfo from kvctl.cluster.spec's ClusterState (or its cluster.json dict).

    Raises BadInput naming the missing field.
    """
    d = _as_dict(state)
    name = str(d.get("name", "?"))

    def need(obj: dict, key: str, where: str) -> Any:
        if obj.get(key) in (None, ""):
            raise BadInput(f"cluster state of {name!r} lacks {where}{key}",
                           where=str(kvctl_home() / "clusters" / name / "cluster.json"),
                           fix=f"relaunch it: `kvctl down --name {name}` then `kvctl launch 1p1d --name {name}`")
        return obj[key]

    instances = need(d, "instances", "")

    def instance(role: str) -> InstanceInfo:
        inst = _as_dict(need(instances, role, "instances."))
        return InstanceInfo(role=role, url=str(need(inst, "url", f"instances.{role}.")),
                            log_path=Path(need(inst, "log_path", f"instances.{role}.")),
                            kv_transfer_config=dict(inst.get("kv_transfer_config") or {}))

    model = d.get("served_model_name") or need(d, "model", "")
    return ClusterInfo(name=name, model=str(model), store=Path(need(d, "store", "")),
                       prefill=instance("prefill"), decode=instance("decode"))


def load_cluster_info(name: str) -> ClusterInfo:
    """The named cluster's ClusterInfo. Raises BadInput for an unknown cluster."""
    try:
        from kvctl.cluster.spec import load_cluster
    except ModuleNotFoundError as e:
        if e.name != "kvctl.cluster.spec":
            raise
        return cluster_info(_read_cluster_json(name))
    return cluster_info(load_cluster(name))


def _read_cluster_json(name: str) -> dict:
    # Stand-in for kvctl.cluster.spec.load_cluster until that module exists.
    path = kvctl_home() / "clusters" / name / "cluster.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"no cluster named {name!r}", where=str(path),
                       fix="start one with `kvctl launch 1p1d` (or pass --name of a running one; "
                           "see `kvctl status`)") from None
    except ValueError as e:
        raise BadInput(f"cluster state of {name!r} is not valid JSON: {e}", where=str(path),
                       fix=f"tear it down with `kvctl down --name {name}` and launch again") from None


def expected_send_children(kv_transfer_config: dict) -> list[tuple[int, str]]:
    """(index, name) of each MultiConnectorV0 child that P sends to; [] if not multi."""
    cfg = kv_transfer_config or {}
    if cfg.get("kv_connector") != "MultiConnectorV0":
        return []
    children = (cfg.get("kv_connector_extra_config") or {}).get("connectors") or []
    parent_role = cfg.get("kv_role")
    out = []
    for i, child in enumerate(children):
        if not isinstance(child, dict):
            continue
        role = child.get("kv_role") or parent_role  # a child without a role acts as its parent
        if role in ("kv_producer", "kv_both"):
            out.append((i, str(child.get("kv_connector"))))
    return out


# ------------------------------------------------------------------ logs


class LogFile:
    """An instance's log file, read from a remembered byte offset onwards."""

    def __init__(self, path: Path | str):
        self.path = Path(path)

    def offset(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def read_from(self, offset: int) -> str:
        """Text logged since `offset` (from the start if the file was truncated)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(0, 2)
                if f.tell() < offset:
                    offset = 0
                f.seek(offset)
                return f.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""


def poll(read: Callable[[], Any], done: Callable[[Any], bool], timeout_s: float) -> Any:
    """Call read() until done(value) or timeout; returns the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(LOG_POLL_S)


# ------------------------------------------------------------------ checks (pure)


@dataclass
class CheckResult:
    name: str
    passed: bool
    evidence: str

    def to_json(self) -> dict:
        return {"name": self.name, "passed": self.passed, "evidence": self.evidence}


@dataclass(frozen=True)
class KeyMatch:
    """Which KV send line is this request's, and how we know."""

    key: str
    send: markers.KVSendLine | None
    identity: KVIdentity | None
    how: str


def match_request_key(sends: Sequence[markers.KVSendLine], tokens: Sequence[int], store: Path,
                      known: KVIdentity | None = None) -> KeyMatch | None:
    """Find this prompt's send line among P's new KV send lines.

    A line matches when its key equals compute_key(identity, tokens), with the
    identity known from an earlier request or read from the entry's header:
    safe with other requests' lines interleaved. Falls back to the only line
    with this prompt's token count (then `identity` is None).
    """
    candidates = [s for s in sends if s.key and (s.tokens is None or s.tokens == len(tokens))]
    if known is not None:
        expected = compute_key(known, tokens)
        for s in candidates:
            if s.key == expected:
                return KeyMatch(expected, s, known, "key = compute_key(identity, /tokenize ids)")
    unreadable = []  # entries we cannot open: maybe ours, maybe not
    for s in candidates:
        try:
            identity = parse_header(entry_path(store, s.key)).identity
        except (EntryCorrupt, OSError):
            unreadable.append(s)
            continue
        if compute_key(identity, tokens) == s.key:
            return KeyMatch(s.key, s, identity, "key = compute_key(entry identity, /tokenize ids)")
    if len({s.key for s in unreadable}) == 1:
        return KeyMatch(unreadable[-1].key, unreadable[-1], None,
                        f"the only KV send line with tokens={len(tokens)} whose entry is unreadable")
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


def check_store_entry_written(store: Path, key: str, tokens: Sequence[int]) -> CheckResult:
    """The entry for `key` exists, validates, and is for exactly these token ids."""
    name = "store_entry_written"
    if not key:
        return CheckResult(name, False, f"no key known for this prompt (P logged no KV send); store {store}")
    path = entry_path(store, key)
    try:
        header, data = read_entry(path)
    except FileNotFoundError:
        return CheckResult(name, False, f"no entry at {path}")
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
                                   f"{ident.dtype}); checksum ok; key recomputed from identity + tokens")


def check_decode_skipped_forward(d_text: str, key: str, hint: str = "") -> CheckResult:
    """D logged `skip model forwarding` with this key and no `redo` for it.

    `hint` is appended to a failure's evidence (e.g. D has no kv-transfer-config).
    """
    name = "decode_skipped_forward"
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


def check_output_matches_baseline(decode: ChatResult, baseline: ChatResult) -> CheckResult:
    """D's tokens (or text, when ids are unavailable) equal the baseline's."""
    name = "output_matches_baseline"
    if decode.token_ids is not None and baseline.token_ids is not None:
        d_ids, b_ids = decode.token_ids, baseline.token_ids
        if d_ids == b_ids and decode.text == baseline.text:
            return CheckResult(name, True, f"{len(d_ids)} tokens identical ({BASELINE_KIND})")
        pos = first_difference(d_ids, b_ids)
        return CheckResult(name, False, f"first differing token at position {pos}: decode "
                                        f"{_token_at(decode, pos)} vs baseline {_token_at(baseline, pos)}; "
                                        f"decode text {_quote(decode.text)}; baseline text {_quote(baseline.text)}")
    if decode.text == baseline.text:
        return CheckResult(name, True, f"texts identical, {len(decode.text)} chars (token ids unavailable)")
    pos = first_difference(decode.text, baseline.text)
    return CheckResult(name, False, f"texts differ from character {pos} (token ids unavailable); "
                                    f"decode {_quote(decode.text)}; baseline {_quote(baseline.text)}")


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


# ------------------------------------------------------------------ report


@dataclass
class RequestReport:
    prompt: str
    prompt_tokens: int
    key: str
    checks: list[CheckResult] = field(default_factory=list)
    decode_output: str = ""
    baseline_output: str = ""
    prefill_latency_s: float | None = None
    decode_latency_s: float | None = None
    baseline_latency_s: float | None = None
    transfer_bytes: int | None = None
    send_ms: float | None = None
    recv_ms: float | None = None

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def check(self, name: str) -> CheckResult | None:
        return next((c for c in self.checks if c.name == name), None)

    def to_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "key": self.key,
            "checks": [c.to_json() for c in self.checks],
            "decode_output": self.decode_output, "baseline_output": self.baseline_output,
            "passed": self.passed, "prompt": self.prompt,
            "prefill_latency_s": _round(self.prefill_latency_s),
            "decode_latency_s": _round(self.decode_latency_s),
            "baseline_latency_s": _round(self.baseline_latency_s),
            "transfer_bytes": self.transfer_bytes, "send_ms": self.send_ms, "recv_ms": self.recv_ms,
        }


@dataclass
class VerifyReport:
    cluster: str
    requests: list[RequestReport]
    max_tokens: int
    baseline: str = BASELINE_KIND

    @property
    def passed(self) -> bool:
        return bool(self.requests) and all(r.passed for r in self.requests)

    def to_json(self) -> dict:
        return {"cluster": self.cluster, "passed": self.passed,
                "requests": [r.to_json() for r in self.requests],
                "baseline": self.baseline, "max_tokens": self.max_tokens}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


# ------------------------------------------------------------------ driving a cluster


@dataclass
class PrefillOutcome:
    """What P's max_tokens=1 request produced, and the two checks it settles."""

    tokens: list[int]
    result: ChatResult
    match: KeyMatch | None
    kv_send: CheckResult
    store_entry: CheckResult

    @property
    def key(self) -> str:
        return self.match.key if self.match else ""


Progress = Callable[[int, int, str], None]  # (request index, total, stage)


class ClusterVerifier:
    """Runs the per-request steps against one cluster; safe to call from threads."""

    def __init__(self, info: ClusterInfo, *, log_wait_s: float = LOG_WAIT_S):
        self.info = info
        self.log_wait_s = log_wait_s
        self.prefill = VLLMClient(info.prefill.url, info.model, role="prefill")
        self.decode = VLLMClient(info.decode.url, info.model, role="decode")
        self.p_log = LogFile(info.prefill.log_path)
        self.d_log = LogFile(info.decode.log_path)
        self.children = expected_send_children(info.prefill.kv_transfer_config)
        self._identity: KVIdentity | None = None  # learned from the first matched entry
        self._lock = threading.Lock()

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()

    def __enter__(self) -> "ClusterVerifier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_prefill(self, prompt: str) -> PrefillOutcome:
        """Tokenize on P, send P max_tokens=1, find its send line and check the entry."""
        messages = user_messages(prompt)
        tokens = self.prefill.tokenize_chat(messages)
        start = self.p_log.offset()
        result = self.prefill.chat(messages, max_tokens=1)
        with self._lock:
            known = self._identity

        def read() -> tuple[str, KeyMatch | None]:
            text = self.p_log.read_from(start)
            return text, match_request_key(markers.kv_sends(text), tokens, self.info.store, known)

        def complete(value: tuple[str, KeyMatch | None]) -> bool:
            text, match = value
            if match is None:
                return False
            names = {s.name for s in markers.child_sends(text)} | {f.name for f in markers.child_failures(text)}
            return all(n in names for _, n in self.children)

        text, match = poll(read, complete, self.log_wait_s)
        if match is not None and match.identity is not None:
            with self._lock:
                self._identity = match.identity
        kv_send = check_kv_send_logged(match, text, len(tokens), self.children)
        store_entry = check_store_entry_written(self.info.store, match.key if match else "", tokens)
        return PrefillOutcome(tokens, result, match, kv_send, store_entry)

    def run_decode(self, prompt: str, key: str, max_tokens: int) -> tuple[ChatResult, CheckResult, str]:
        """D with max_tokens; returns its result, the skip check and D's new log text."""
        start = self.d_log.offset()
        result = self.decode.chat(user_messages(prompt), max_tokens=max_tokens)

        def settled(text: str) -> bool:
            return bool(key) and (any(key in s.keys for s in markers.skip_forwards(text))
                                  or any(r.mentions(key) for r in markers.redo_forwards(text)))

        text = poll(lambda: self.d_log.read_from(start), settled, self.log_wait_s if key else 0)
        cfg = self.info.decode.kv_transfer_config
        hint = ("D was launched without a kv-transfer-config" if not cfg
                else f"D's kv-transfer-config: {json.dumps(cfg, separators=(',', ':'))}")
        return result, check_decode_skipped_forward(text, key, hint), text

    def run_baseline(self, prompt: str, max_tokens: int) -> ChatResult:
        return self.prefill.chat(user_messages(prompt), max_tokens=max_tokens)

    def verify_prompt(self, prompt: str, max_tokens: int,
                      stage: Callable[[str], None] = lambda s: None) -> RequestReport:
        stage("prefill")
        pre = self.run_prefill(prompt)
        stage("decode")
        dec, skip_check, d_text = self.run_decode(prompt, pre.key, max_tokens)
        stage("baseline")
        base = self.run_baseline(prompt, max_tokens)
        skip = next((s for s in markers.skip_forwards(d_text) if pre.key and pre.key in s.keys), None)
        send = pre.match.send if pre.match else None
        return RequestReport(
            prompt=prompt, prompt_tokens=len(pre.tokens), key=pre.key,
            checks=[pre.kv_send, pre.store_entry, skip_check, check_output_matches_baseline(dec, base)],
            decode_output=dec.text, baseline_output=base.text,
            prefill_latency_s=pre.result.latency_s, decode_latency_s=dec.latency_s,
            baseline_latency_s=base.latency_s,
            transfer_bytes=transfer_bytes(skip, send, self.info.store, pre.key),
            send_ms=send.ms if send else None,
            recv_ms=skip.ms if skip else None)


def transfer_bytes(skip: markers.SkipForwardLine | None, send: markers.KVSendLine | None, store: Path,
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
    try:
        return parse_header(entry_path(store, key)).data_len
    except (EntryCorrupt, OSError):
        return None  # evicted since: unknown, rather than the whole batch's bytes


def check_prompts(prompts: Iterable[str]) -> list[str]:
    """The prompts, or BadInput naming the empty one."""
    out = list(prompts)
    if not out:
        raise BadInput("no prompts to verify", fix="pass --prompt TEXT or --prompts FILE with at least one prompt")
    for i, p in enumerate(out):
        if not isinstance(p, str) or not p.strip():
            raise BadInput(f"prompt {i + 1} is empty", where=f"prompts[{i}]",
                           fix="give every prompt some text")
    return out


def load_prompts_file(path: Path | str) -> list[str]:
    """Prompts from a file: a JSON list of strings, or one prompt per non-blank line.

    Raises BadInput for an unreadable file, bad JSON or an empty prompt list.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read prompts file: {e}", where=str(path),
                       fix="pass a readable UTF-8 file: a JSON list of strings or one prompt per line") from None
    if path.suffix == ".json" or text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise BadInput(f"prompts file is not valid JSON: {e}", where=str(path),
                           fix='write a JSON list of strings, e.g. ["Hello", "Tell me a story"]') from None
        if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            raise BadInput("prompts file must hold a JSON list of strings", where=str(path),
                           fix='write e.g. ["Hello", "Tell me a story"]')
        prompts = data
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    try:
        return check_prompts(prompts)
    except BadInput as e:
        raise BadInput(e.what, where=f"{path}: {e.where}" if e.where else str(path), fix=e.fix) from None


def prepare_run(state: Any, prompts: Sequence[str], max_tokens: int,
                concurrency: int) -> tuple[ClusterInfo, list[str]]:
    """The cluster's info and the checked prompts. Raises BadInput for a bad prompt, K or C."""
    info = state if isinstance(state, ClusterInfo) else cluster_info(state)
    prompts = check_prompts(prompts)
    if max_tokens < 1:
        raise BadInput(f"max tokens must be at least 1, got {max_tokens}", where="--max-tokens",
                       fix="pass --max-tokens 16 (or any K >= 1)")
    if concurrency < 1:
        raise BadInput(f"concurrency must be at least 1, got {concurrency}", where="--concurrency",
                       fix="pass --concurrency 8")
    return info, prompts


def verify_cluster(state: Any, prompts: Sequence[str] = DEFAULT_PROMPTS,
                   max_tokens: int = DEFAULT_MAX_TOKENS, progress: Progress | None = None, *,
                   concurrency: int = 1, log_wait_s: float = LOG_WAIT_S) -> VerifyReport:
    """Verify every prompt against the cluster (ClusterState, its dict, or ClusterInfo).

    Raises BadInput for empty prompts or max_tokens < 1, RuntimeFailure when an
    instance cannot be reached or answers with an error.
    """
    info, prompts = prepare_run(state, prompts, max_tokens, concurrency)
    total = len(prompts)
    report = progress or (lambda i, n, s: None)

    with ClusterVerifier(info, log_wait_s=log_wait_s) as verifier:
        def one(i: int) -> RequestReport:
            result = verifier.verify_prompt(prompts[i], max_tokens, lambda s: report(i, total, s))
            report(i, total, "done")
            return result

        if concurrency == 1:
            requests = [one(i) for i in range(total)]
        else:
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                requests = list(pool.map(one, range(total)))
    return VerifyReport(cluster=info.name, requests=requests, max_tokens=max_tokens)
