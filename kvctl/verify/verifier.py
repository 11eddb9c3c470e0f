"""The verify driver: prove, request by request, that a 1P1D cluster's KV really travelled.

The hand-run flow of the seed, automated. Per prompt (`ClusterVerifier`):

1. tokenize through P's /tokenize (chat template applied): the exact prompt ids;
2. P /v1/chat/completions, max_tokens=1, temperature=0 -> P prefills and sends;
3. find P's `KV send DONE. key=...` line for this prompt and the store entry;
   the key is recomputed from the entry's own identity and the /tokenize ids,
   which proves the entry is for exactly this prompt;
4. D /v1/chat/completions, max_tokens=K -> D must skip its prefill forward;
5. baseline: P again with max_tokens=K (prefill instance, full generation).

The checks themselves are kvctl.verify.checks. `run_verify` is the one loop
over prompts, for every front end: `kvctl verify` (`verify_cluster`), its load
mode (kvctl.verify.load_mode) and scenarios, which differ only in `RunOptions`
(concurrency, keep going on a failed request, the send children P must log).

Log lines are matched by key, never by position, and each request only looks
at what its instances logged after it started, so requests may run
concurrently. Library code: nothing here prints; it returns reports or raises
KvctlError.

Through the endpoint (the router), the answer's `X-Kvctl-Prefill` and
`X-Kvctl-Decode` headers name the instances that served the request, and
its evidence is looked for in those two logs only; each request carries its
own `X-Request-Id`. Without those headers (a router kvctl does not control),
the evidence is looked for in every instance of each role, and the instance
whose log held it is reported (`instances_from: logs`). The run reports how
many requests each instance served and fails when an instance that should
serve never did (kvctl.verify.report `pool_verdict`).

An attached cluster may hide evidence: an instance without a log source, a
store not visible here. The checks that need it are `not_observable` (with
the reason), never passed; `RunOptions.require` decides the verdict
(kvctl.verify.report). A log that is a command's output (`cmd:...`) is
captured for as long as `run_verify` runs (kvctl.verify.log_files).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import httpx

from connectors.config.topology import (FS_CONNECTOR, fs_storage_paths, handshake_connector, logged_send_children,
                                       named_connectors)
from connectors.store.format import KVIdentity
from kvctl.client import ChatResult, VLLMClient, user_messages
from kvctl.cluster.lmcache import HEALTH_PATH as LMCACHE_HEALTH_PATH
from kvctl.cluster.state import ClusterState
from kvctl.errors import BadInput, KvctlError
from kvctl.router.headers import DECODE_HEADER, PREFILL_HEADER, PREFILL_MS_HEADER
from kvctl.router.headers import REQUEST_ID as REQUEST_ID_HEADER
from kvctl.router.bodies import KV_TRANSFER_PARAMS, PREFILL_KV_TRANSFER_PARAMS
from kvctl.verify import markers
from kvctl.verify import children as child_evidence
from kvctl.verify import metrics as metrics_evidence
from kvctl.verify import nixl as nixl_evidence
from kvctl.verify.checks import (
    COMPARE_EXACT,
    COMPARE_MODES,
    COMPARE_TOLERANT,
    DEFAULT_EPSILON,
    ERROR_CHECK,
    check_offload_logged,
    offload_tokens,
    CheckResult,
    KeyMatch,
    check_decode_skipped_forward,
    check_kv_send_logged,
    check_output_matches_baseline,
    check_store_entry_written,
    explain_unseen_entry,
    match_request_key,
    not_observable,
    third_party_checks,
    transfer_bytes,
)
from kvctl.verify.children import nixl_children, request_children
from kvctl.verify.cluster_info import ClusterInfo, InstanceInfo, OffloadInfo, cluster_info
from kvctl.verify.log_files import LOG_WAIT_S, LogFile, LogPool, capturing_logs, poll
from kvctl.verify.prompts import DEFAULT_PROMPTS, check_prompts
from kvctl.verify.report import (
    ChildEvidence,
    FROM_DIRECT,
    FROM_HEADERS,
    FROM_LOGS,
    REQUIRE_ALL,
    REQUIRE_CHOICES,
    RequestReport,
    VerifyReport,
)

DEFAULT_MAX_TOKENS = 16
METRICS_TIMEOUT_S = 5.0  # one /metrics read
NIXL_SEND_WAIT_S = 30.0  # how long P's `Finished sending` may lag D's `Finished recving`
MetricsStart = dict  # instance label -> its /metrics reading (kvctl.verify.metrics.Reading) or None

Progress = Callable[[int, int, str], None]  # (request index, total, stage: prefill|decode|endpoint|baseline|done)
SendChildren = Sequence[tuple[int, str]]  # (child index, connector name) of P's children that must log a send


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


def expected_send_children(prefill_config: dict | None) -> list[tuple[int, str]]:
    """(index, name) of each child P logs `sent to connector` for (connectors.config.topology's rule)."""
    return [(c.index, c.connector or "") for c in logged_send_children(prefill_config)]


class ClusterVerifier:
    """Runs the per-request steps against one cluster; safe to call from threads.

    `send_children`: the children whose `sent to connector` line P must log
    per request; default: every sending child of P's config.

    `via_endpoint`: each request goes once through the cluster's endpoint (the
    router: P with max_tokens=1, then D), instead of to P and then D directly;
    the evidence is looked for in the logs of the instances the router's
    answer names (X-Kvctl-Prefill/-Decode), or of every instance of each role
    when it names none; the baseline still comes from P directly.

    `compare`: how D's output is held against the baseline's (checks.COMPARE_MODES):
    exact, or tolerant of near-ties closer than `epsilon` (then the baseline is
    asked for its top-2 logprobs).
    """

    def __init__(self, info: ClusterInfo, *, log_wait_s: float = LOG_WAIT_S,
                 send_children: SendChildren | None = None, via_endpoint: bool = False,
                 compare: str = COMPARE_EXACT, epsilon: float = DEFAULT_EPSILON):
        self.info = info
        self.log_wait_s = log_wait_s
        self.compare, self.epsilon = compare, epsilon
        self.prefill = VLLMClient(info.prefill.url, info.model, role="prefill", api_key=info.api_key)
        self.decode = VLLMClient(info.decode.url, info.model, role="decode", api_key=info.api_key)
        self.endpoint: VLLMClient | None = None
        if via_endpoint:
            if not info.endpoint:
                raise BadInput(f"cluster {info.name!r} has no endpoint to send requests through", field="via_endpoint",
                               fix=("launch it again with its router (the default), or verify P and D directly"
                                    if info.managed else
                                    "attach it with its router's URL as the endpoint, or verify P and D directly"))
            self.endpoint = VLLMClient(info.endpoint, info.model, role="endpoint", api_key=info.api_key)
            pool = info.all_instances()
            self.p_log = LogPool([i for i in pool if i.role == "prefill"])
            self.d_log = LogPool([i for i in pool if i.role == "decode"])
        else:
            self.p_log = LogPool([info.prefill])
            self.d_log = LogPool([info.decode])
        self.children = (list(send_children) if send_children is not None
                         else expected_send_children(info.prefill.kv_transfer_config))
        # P answers with kv_transfer_params D must be given (NIXL): its evidence is vLLM's own lines.
        self.handshake = handshake_connector(info.prefill.kv_transfer_config) is not None
        self._identity: KVIdentity | None = None  # learned from the first matched entry
        self._lock = threading.Lock()

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        if self.endpoint is not None:
            self.endpoint.close()

    def __enter__(self) -> "ClusterVerifier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pools(self) -> dict[str, list[str]]:
        """Role -> the instances that should serve: every one behind the endpoint, else the chosen P and D."""
        return {"prefill": [i.label for i in self.p_log.instances], "decode": [i.label for i in self.d_log.instances]}

    def _p_unseen(self, log: LogPool | None = None) -> str:
        return f"P's log ({(log or self.p_log).unobservable})"

    def run_prefill(self, prompt: str, request_id: str = "") -> PrefillOutcome:
        """Tokenize on P, send P max_tokens=1, find its send line and check the entry."""
        messages = user_messages(prompt)
        tokens = self.prefill.tokenize_chat(messages)
        start = self.p_log.offset()
        result = self.prefill.chat(messages, max_tokens=1, headers=_id_header(request_id))
        return self.prefill_evidence(tokens, result, start)

    def prefill_evidence(self, tokens: list[int], result: ChatResult, start: tuple[int, ...],
                         log: LogPool | None = None) -> PrefillOutcome:
        """P's send line for `tokens` in what P logged since `start`, and the entry it names.

        `log`: the P logs to look in (`start` holds their offsets); default: every P of the verifier.
        """
        log = log or self.p_log
        hidden = third_party_checks(self.info.prefill.kv_transfer_config, self.info.decode.kv_transfer_config)
        if "kv_send_logged" in hidden:  # a third-party connector carries KV: its evidence is not ours to read
            return PrefillOutcome(tokens, result, None, hidden["kv_send_logged"], hidden["store_entry_written"])
        if not log.observable:  # the key comes from P's log: without it, nothing can be matched
            why = self._p_unseen(log)
            store = (not_observable("store_entry_written", self.info.store_unobservable) if self.info.store is None
                     else not_observable("store_entry_written", f"the entry is found by the key in {why}"))
            return PrefillOutcome(tokens, result, None, not_observable("kv_send_logged", why), store)
        with self._lock:
            known = self._identity

        def read() -> tuple[str, KeyMatch | None]:
            text = log.read_from(start)
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
        if match is None and not log.complete:  # it may have gone to a P whose log is out of reach
            why = f"no send line in the P logs kvctl can read, and the request may have gone to {self._p_unseen(log)}"
            return PrefillOutcome(tokens, result, None, not_observable("kv_send_logged", why),
                                  not_observable("store_entry_written", f"the entry is found by the key: {why}"))
        kv_send = check_kv_send_logged(match, text, len(tokens), self.children)
        store_entry = (not_observable("store_entry_written", self.info.store_unobservable) if self.info.store is None
                       else check_store_entry_written(self.info.store, match.key if match else "", tokens,
                                                      self.info.store_keys))
        return PrefillOutcome(tokens, result, match, kv_send, store_entry)

    def offload_offsets(self) -> dict[str, int]:
        """Where each prefill's offload log (its LMCache server's) ends now, by instance."""
        return {i.label: LogFile(i.offload.log_path).offset() for i in self.p_log.instances if i.offload}

    def offload_evidence(self, prompt_tokens: int, starts: dict[str, int], instance: str | None = None
                         ) -> tuple[CheckResult, OffloadInfo, str] | None:
        """The offload child's check for one request, the child, and what its server logged since
        `starts` (None when P has no offload child kvctl reads), for `instance` (None: the first P
        with one)."""
        infos = [i for i in self.p_log.instances if i.offload and (instance is None or i.label == instance)]
        if not infos:
            return None
        inst = infos[0]
        off = inst.offload
        assert off is not None
        whole = prompt_tokens // off.chunk_size * off.chunk_size if off.chunk_size else 0

        def enough(text: str) -> bool:
            return sum(offload_tokens(text)) >= whole

        text = poll(lambda: LogFile(off.log_path).read_from(starts.get(inst.label, 0)), enough,
                    self.log_wait_s if whole else 0)
        down = "" if enough(text) else _server_down(off.url)
        return check_offload_logged(text, prompt_tokens, off.chunk_size, off.label, off.server, down), off, text

    def run_decode(self, prompt: str, key: str, max_tokens: int,
                   key_unknown: str = "", request_id: str = "") -> tuple[ChatResult, CheckResult, str]:
        """D with max_tokens; returns its result, the skip check and D's new log text.

        `key_unknown`: why this request's key cannot be known (P's log is not
        observable); the skip check is then not observable either.
        """
        start = self.d_log.offset()
        asked_at = time.time()
        result = self.decode.chat(user_messages(prompt), max_tokens=max_tokens, headers=_id_header(request_id))
        check, text = self.decode_evidence(key, start, key_unknown, asked_at=asked_at)
        return result, check, text

    def decode_evidence(self, key: str, start: tuple[int, ...], key_unknown: str = "",
                        log: LogPool | None = None, asked_at: float | None = None,
                        asked: str = "was asked") -> tuple[CheckResult, str]:
        """D's skip (or redo) line for `key` in what D logged since `start` (in `log`: default every D).

        A miss for an entry the store holds, published before D was asked
        (`asked_at`, Unix time), is explained (checks.explain_unseen_entry)."""
        log = log or self.d_log
        if not log.observable:
            return not_observable("decode_skipped_forward", f"D's log ({log.unobservable})"), ""
        hidden = third_party_checks(self.info.prefill.kv_transfer_config, self.info.decode.kv_transfer_config)
        if "decode_skipped_forward" in hidden:
            return hidden["decode_skipped_forward"], ""
        if key_unknown:
            return not_observable("decode_skipped_forward", f"D's line is matched by the request's key, "
                                                            f"which comes from {key_unknown}"), ""

        def settled(text: str) -> bool:
            return bool(key) and (any(key in s.keys for s in markers.skip_forwards(text))
                                  or any(r.mentions(key) for r in markers.redo_forwards(text))
                                  or any(ld.key == key for ld in markers.kv_loads(text)))

        text = poll(lambda: log.read_from(start), settled, self.log_wait_s if key else 0)
        if key and not settled(text) and not log.complete:
            return not_observable("decode_skipped_forward", f"no line for key {key} in the D logs kvctl can read, "
                                                            f"and the request may have gone to D's log "
                                                            f"({log.unobservable})"), text
        cfg = self.info.decode.kv_transfer_config
        hint = ("D was launched without a kv-transfer-config" if not cfg
                else f"D's kv-transfer-config: {json.dumps(cfg, separators=(',', ':'))}")
        check = check_decode_skipped_forward(text, key, hint)
        unseen = "" if check.passed else explain_unseen_entry(self.info.store, key, text, asked_at, asked)
        if unseen:
            check = dataclasses.replace(check, evidence=f"{check.evidence}; {unseen}")
        return check, text

    def run_baseline(self, prompt: str, max_tokens: int) -> ChatResult:
        return self.prefill.chat(user_messages(prompt), max_tokens=max_tokens,
                                 top_logprobs=2 if self.compare == COMPARE_TOLERANT else 0)

    def nixl_checks(self, request_id: str, tokens: list[int], p_log: LogPool, p_start: tuple[int, ...],
                    d_log: LogPool, d_start: tuple[int, ...], m_start: MetricsStart | None = None,
                    ) -> tuple[CheckResult, CheckResult, CheckResult]:
        """kv_send_logged, store_entry_written and decode_skipped_forward of a NIXL request
        (kvctl.verify.nixl), from what P and D logged since `p_start` / `d_start`.

        A side whose log kvctl cannot read (an attached instance without a log source) is
        judged from its /metrics deltas since `m_start` (`metrics_start`, taken before the
        request; kvctl.verify.metrics) where it has one, else not observable."""
        return self._nixl_evidence(request_id, tokens, p_log, p_start, d_log, d_start, m_start)[:3]  # type: ignore[return-value]

    def _nixl_evidence(self, request_id: str, tokens: list[int], p_log: LogPool, p_start: tuple[int, ...],
                       d_log: LogPool, d_start: tuple[int, ...], m_start: MetricsStart | None = None,
                       ) -> tuple[CheckResult, CheckResult, CheckResult, nixl_evidence.RequestEvidence | None]:
        """`nixl_checks`, and the lines they read (None unless both logs are readable)."""
        if p_log.observable and d_log.observable:
            def read() -> nixl_evidence.RequestEvidence:
                return nixl_evidence.evidence(request_id, p_log.read_from(p_start), d_log.read_from(d_start))

            ev = poll(read, lambda e: e.settled, self.log_wait_s)
            if ev.received is not None and ev.sent is None and ev.expired is None:
                # D has the KV: P's `Finished sending` (or its lease expiry) must follow, only later
                # on a loaded host (P reads D's notification at a later step): wait for it
                ev = poll(read, lambda e: e.settled, NIXL_SEND_WAIT_S)
            return (nixl_evidence.check_sent(ev), nixl_evidence.check_handed(ev, len(tokens)),
                    nixl_evidence.check_pulled(ev, len(tokens)), ev)
        d_why, p_why = f"D's log ({d_log.unobservable})", f"P's log ({p_log.unobservable})"
        d_delta = p_delta = None
        if m_start is not None:
            d_delta = poll(lambda: self._metrics_delta(d_log, m_start), metrics_evidence.settled, self.log_wait_s)
            p_delta = self._metrics_delta(p_log, m_start)
        d_name = ", ".join(i.label for i in d_log.instances)
        p_name = ", ".join(i.label for i in p_log.instances)
        if d_log.observable:
            ev = poll(lambda: nixl_evidence.evidence(request_id, "", d_log.read_from(d_start)),
                      lambda e: e.received is not None or e.failure is not None, self.log_wait_s)
            handed, pulled = nixl_evidence.check_handed(ev, len(tokens)), nixl_evidence.check_pulled(ev, len(tokens))
        else:
            handed = not_observable("store_entry_written", f"the kv_transfer_params D was handed are in {d_why} "
                                                           "only; /metrics do not carry them")
            pulled = (metrics_evidence.check_pulled(d_delta, len(tokens), d_name) if d_delta is not None
                      else not_observable("decode_skipped_forward", f"{d_why}, and D's /metrics could not be read"))
        if p_log.observable:
            ev = poll(lambda: nixl_evidence.evidence(request_id, p_log.read_from(p_start), ""),
                      lambda e: e.sent is not None or e.expired is not None, self.log_wait_s)
            sent = nixl_evidence.check_sent(ev)
        elif d_delta is not None:
            sent = metrics_evidence.check_sent(d_delta, p_delta, p_name)
        else:
            sent = not_observable("kv_send_logged", f"{p_why}, and D's /metrics could not be read")
        return sent, handed, pulled, None

    def metrics_start(self, *pools: LogPool) -> MetricsStart | None:
        """/metrics readings of every instance of `pools` (label -> counters) when one of the pools
        has a log kvctl cannot read (then its NIXL evidence comes from deltas); else None."""
        if all(pool.complete for pool in pools):
            return None
        return {i.label: self._read_metrics(i) for pool in pools for i in pool.instances}

    def _read_metrics(self, inst: InstanceInfo) -> metrics_evidence.Reading | None:
        if not inst.url:
            return None
        headers = {"Authorization": f"Bearer {self.info.api_key}"} if self.info.api_key else None
        try:
            resp = httpx.get(f"{inst.url}/metrics", headers=headers, timeout=METRICS_TIMEOUT_S)
            return metrics_evidence.counters(resp.text) if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def _metrics_delta(self, pool: LogPool, start: MetricsStart) -> metrics_evidence.Reading | None:
        """The counters' change since `start`, summed over the pool's instances (None: none readable)."""
        deltas = []
        for inst in pool.instances:
            before = start.get(inst.label)
            after = self._read_metrics(inst) if before is not None else None
            if before is not None and after is not None:
                deltas.append(after.minus(before))
        return metrics_evidence.total(deltas) if deltas else None

    def fs_offload_child(self, request_id: str, tokens: list[int], p_log: LogPool, p_start: tuple[int, ...],
                         d_log: LogPool, d_start: tuple[int, ...], instance: str | None,
                         ) -> tuple[ChildEvidence | None, CheckResult | None, str]:
        """P's FSConnector offload child beside a NIXL transfer child (v1-nixl-multi): its part of the
        request's children, its offload check and the key it saved the prompt under; (None, None, "")
        when P has no such child or its log is out of reach."""
        p_cfg, d_cfg = _served_config(p_log, self.info.prefill), _served_config(d_log, self.info.decode)
        nixl_name = handshake_connector(p_cfg) or ""
        if not any(i is not None for i, _ in named_connectors(p_cfg, nixl_name)):
            return None, None, ""
        p_fs = [(i, c) for i, c in named_connectors(p_cfg, FS_CONNECTOR) if i is not None]
        if not p_fs or not p_log.observable:
            return None, None, ""
        index, cfg = p_fs[0]
        p_store = _one_store(cfg)
        d_store = next((_one_store(c) for i, c in named_connectors(d_cfg, FS_CONNECTOR) if i == index), None)
        with self._lock:
            known = self._identity

        def read() -> tuple:
            return child_evidence.fs_offload(index, tokens, request_id, p_log.read_from(p_start), p_store,
                                             d_log.read_from(d_start) if d_log.observable else "", d_store,
                                             known, instance or self.info.prefill.label)

        offload, child, match = poll(read, lambda r: r[0].passed, self.log_wait_s)
        if match is not None and match.identity is not None:
            with self._lock:
                self._identity = match.identity
        return child, offload, match.key if match is not None else ""

    def verify_prompt_nixl(self, prompt: str, max_tokens: int,
                           stage: Callable[[str], None] = lambda s: None) -> RequestReport:
        """One request straight to P and D with the handshake the router does (bodies.py): P asked
        for kv_transfer_params, D given the ones P answered; then the NIXL checks."""
        messages = user_messages(prompt)
        request_id = new_request_id()
        stage("prefill")
        tokens = self.prefill.tokenize_chat(messages)
        p_start, d_start = self.p_log.offset(), self.d_log.offset()
        o_start = self.offload_offsets()
        m_start = self.metrics_start(self.p_log, self.d_log)
        pre = self.prefill.chat(messages, max_tokens=1, headers=_id_header(request_id),
                                extra={KV_TRANSFER_PARAMS: dict(PREFILL_KV_TRANSFER_PARAMS)})
        params = pre.raw.get(KV_TRANSFER_PARAMS)
        stage("decode")
        dec = self.decode.chat(messages, max_tokens=max_tokens, headers=_id_header(request_id),
                               extra={KV_TRANSFER_PARAMS: params} if isinstance(params, dict) else None)
        stage("baseline")  # before the evidence: P logs its send once it steps again after D's read
        base = self.run_baseline(prompt, max_tokens)
        sent, handed, pulled, ev = self._nixl_evidence(request_id, tokens, self.p_log, p_start, self.d_log, d_start,
                                                       m_start)
        if not isinstance(params, dict) or not params:
            handed = CheckResult("store_entry_written", False, "P answered without kv_transfer_params, so D had "
                                                               f"nothing to pull from: {str(pre.raw)[:300]}")
        offload = self.offload_evidence(len(tokens), o_start, self.info.prefill.label)
        fs = self.fs_offload_child(request_id, tokens, self.p_log, p_start, self.d_log, d_start, None)
        report = self._nixl_report(prompt, tokens, pre, dec, base, sent, handed, pulled, ev, offload, fs=fs)
        report.request_id, report.instances_from = request_id, FROM_DIRECT
        report.prefill_instance, report.decode_instance = self.info.prefill.label, self.info.decode.label
        return report

    def _nixl_report(self, prompt: str, tokens: list[int], pre: ChatResult, dec: ChatResult, base: ChatResult,
                     sent: CheckResult, handed: CheckResult, pulled: CheckResult,
                     ev: nixl_evidence.RequestEvidence | None = None,
                     offload_found: tuple[CheckResult, OffloadInfo, str] | None = None,
                     prefill: str | None = None, decode: str | None = None,
                     fs: tuple[ChildEvidence | None, CheckResult | None, str] = (None, None, "")) -> RequestReport:
        """`offload_found`: P's LMCache child (offload_evidence); `fs`: P's FSConnector offload
        child (fs_offload_child): its part, its check and the key it saved the prompt under."""
        offload, off_info, off_text = offload_found if offload_found is not None else (None, None, "")
        fs_part, fs_check, key = fs
        children = nixl_children(self.info.prefill.kv_transfer_config, self.info.decode.kv_transfer_config,
                                 prefill or self.info.prefill.label, decode or self.info.decode.label, ev,
                                 off_info, off_text, fs_part)
        offload = offload if offload is not None else fs_check
        return RequestReport(
            prompt=prompt, prompt_tokens=len(tokens), key=key,
            checks=[sent, handed, pulled,
                    nixl_evidence.lease_named(check_output_matches_baseline(dec, base), sent),
                    *([offload] if offload is not None else [])],
            decode_output=dec.text, baseline_output=base.text,
            prefill_latency_s=pre.latency_s, decode_latency_s=dec.latency_s, baseline_latency_s=base.latency_s,
            children=children)

    def verify_prompt(self, prompt: str, max_tokens: int,
                      stage: Callable[[str], None] = lambda s: None) -> RequestReport:
        if self.endpoint is not None:
            return self.verify_prompt_via_endpoint(prompt, max_tokens, stage)
        if self.handshake:
            return self.verify_prompt_nixl(prompt, max_tokens, stage)
        request_id = new_request_id()
        stage("prefill")
        o_start = self.offload_offsets()
        pre = self.run_prefill(prompt, request_id)
        offload = self.offload_evidence(len(pre.tokens), o_start, self.info.prefill.label)
        stage("decode")
        key_unknown = "" if pre.match is not None or self.p_log.complete else self._p_unseen()
        dec, skip_check, d_text = self.run_decode(prompt, pre.key, max_tokens, key_unknown, request_id)
        stage("baseline")
        base = self.run_baseline(prompt, max_tokens)
        report = self._report(prompt, pre, dec, skip_check, d_text, base, offload)
        report.request_id, report.instances_from = request_id, FROM_DIRECT
        report.prefill_instance, report.decode_instance = self.info.prefill.label, self.info.decode.label
        return report

    def verify_prompt_via_endpoint(self, prompt: str, max_tokens: int,
                                   stage: Callable[[str], None] = lambda s: None) -> RequestReport:
        """One request through the endpoint (the router runs P, then D), checked like a direct one.

        The evidence follows the answer's X-Kvctl-Prefill/-Decode headers: P's
        send line in that prefill instance's log, D's line in that decode
        instance's. Without them (or naming an instance this cluster does not
        have), every instance of each role is searched, and the one whose log
        held the line is reported.
        """
        assert self.endpoint is not None
        messages = user_messages(prompt)
        stage("endpoint")
        tokens = self.prefill.tokenize_chat(messages)
        p_start, d_start = self.p_log.offset(), self.d_log.offset()
        o_start = self.offload_offsets()
        m_start = self.metrics_start(self.p_log, self.d_log) if self.handshake else None
        sent_id = new_request_id()
        dec = self.endpoint.chat(messages, max_tokens=max_tokens, headers=_id_header(sent_id))
        answered_at = time.time()  # the router asked P, then D: D looked the entry up before this
        p_log, p_off, p_name, p_note = _follow(self.p_log, p_start, dec.headers.get(PREFILL_HEADER.lower()),
                                               PREFILL_HEADER)
        d_log, d_off, d_name, d_note = _follow(self.d_log, d_start, dec.headers.get(DECODE_HEADER.lower()),
                                               DECODE_HEADER)
        if self.handshake:
            rid = dec.headers.get(REQUEST_ID_HEADER.lower()) or sent_id
            stage("baseline")  # before the evidence: P logs its send once it steps again after D's read
            base = self.run_baseline(prompt, max_tokens)
            sent, handed, pulled, ev = self._nixl_evidence(rid, tokens, p_log, p_off, d_log, d_off, m_start)
            offload = self.offload_evidence(len(tokens), o_start, p_name)
            fs = self.fs_offload_child(rid, tokens, p_log, p_off, d_log, d_off, p_name)
            report = self._nixl_report(prompt, tokens, dec, dec, base, sent, handed, pulled, ev, offload,
                                       p_name, d_name, fs)
            report.request_id = rid
            report.prefill_latency_s, report.decode_latency_s = _split_latency(dec)
            report.prefill_instance, report.decode_instance = p_name, d_name
            report.instances_from = FROM_HEADERS if not (p_note or d_note) else ""
            return report
        pre = self.prefill_evidence(tokens, dec, p_off, p_log)
        offload = self.offload_evidence(len(tokens), o_start, p_name)
        key_unknown = "" if pre.match is not None or p_log.complete else self._p_unseen(p_log)
        skip_check, d_text = self.decode_evidence(pre.key, d_off, key_unknown, d_log, asked_at=answered_at,
                                                  asked="answered")
        stage("baseline")
        base = self.run_baseline(prompt, max_tokens)
        if p_name is None and pre.match is not None and pre.match.send is not None:
            p_name = p_log.holder(p_off, pre.match.send.line)
        if d_name is None and pre.key:
            line = next((s.line for s in markers.skip_forwards(d_text) if pre.key in s.keys),
                        next((ld.line for ld in markers.kv_loads(d_text) if ld.key == pre.key), ""))
            d_name = d_log.holder(d_off, line)
        report = self._report(prompt, pre, dec, skip_check, d_text, base, offload, p_name, d_name)
        report.request_id = dec.headers.get(REQUEST_ID_HEADER.lower()) or sent_id
        report.prefill_latency_s, report.decode_latency_s = _split_latency(dec)
        report.prefill_instance, report.decode_instance = p_name, d_name
        report.instances_from = FROM_HEADERS if not (p_note or d_note) else (FROM_LOGS if p_name or d_name else "")
        for check, note in ((pre.kv_send, p_note), (pre.store_entry, ""), (skip_check, d_note)):
            if not check.passed and check.observable and note:
                check.evidence += f" ({note})"
        _name_where_looked(pre.kv_send, p_name if not p_note else None, PREFILL_HEADER)
        _name_where_looked(skip_check, d_name if not d_note else None, DECODE_HEADER)
        return report

    def _report(self, prompt: str, pre: PrefillOutcome, dec: ChatResult, skip_check: CheckResult, d_text: str,
                base: ChatResult, offload_found: tuple[CheckResult, OffloadInfo, str] | None = None,
                prefill: str | None = None, decode: str | None = None) -> RequestReport:
        skip = next((s for s in markers.skip_forwards(d_text) if pre.key and pre.key in s.keys), None)
        send = pre.match.send if pre.match else None
        offload, off_info, off_text = offload_found if offload_found is not None else (None, None, "")
        children = request_children(self.info.prefill.kv_transfer_config, self.info.decode.kv_transfer_config,
                                    prefill or self.info.prefill.label, decode or self.info.decode.label,
                                    send, pre.key, d_text, off_info, off_text)
        return RequestReport(
            prompt=prompt, prompt_tokens=len(pre.tokens), key=pre.key,
            checks=[pre.kv_send, pre.store_entry, skip_check,
                    check_output_matches_baseline(dec, base, self.compare, self.epsilon),
                    *([offload] if offload is not None else [])],
            decode_output=dec.text, baseline_output=base.text,
            prefill_latency_s=pre.result.latency_s, decode_latency_s=dec.latency_s,
            baseline_latency_s=base.latency_s,
            transfer_bytes=transfer_bytes(skip, send, self.info.store, pre.key),
            send_ms=send.ms if send else None,
            recv_ms=skip.ms if skip else None, children=children)


def _served_config(log: LogPool, fallback: InstanceInfo) -> dict:
    """The kv-transfer config of the one instance `log` reads (the instance that served a request),
    else `fallback`'s (the role's first)."""
    only = log.instances[0] if len(log.instances) == 1 else fallback
    return only.kv_transfer_config or fallback.kv_transfer_config or {}


def _one_store(cfg: object) -> Path | None:
    """The FS directory a connector config names (the first), or None."""
    paths = fs_storage_paths(cfg)
    return Path(paths[0]) if paths else None


def _server_down(url: str) -> str:
    """Why the LMCache server at `url` does not serve ("" when its /healthcheck answers 200)."""
    try:
        code = httpx.get(f"{url}{LMCACHE_HEALTH_PATH}", timeout=2.0).status_code
    except httpx.HTTPError as e:
        return f"its server at {url} does not answer ({type(e).__name__})"
    return "" if code == 200 else f"its server at {url} answers {LMCACHE_HEALTH_PATH} with {code}"


def _split_latency(answer: ChatResult) -> tuple[float | None, float]:
    """(P's part, the rest) of a request through the endpoint, from the router's
    X-Kvctl-Prefill-Ms; without it P's part is unknown and the rest is the whole."""
    try:
        prefill_s = float(answer.headers[PREFILL_MS_HEADER.lower()]) / 1000
    except (KeyError, ValueError):
        return None, answer.latency_s
    return prefill_s, max(0.0, answer.latency_s - prefill_s)


def new_request_id() -> str:
    """A fresh request id (sent as X-Request-Id: vLLM names the request after it in its log)."""
    return uuid.uuid4().hex


def _id_header(request_id: str) -> dict[str, str] | None:
    return {REQUEST_ID_HEADER: request_id} if request_id else None


def _follow(pool: LogPool, start: tuple[int, ...], named: str | None,
            header: str) -> tuple[LogPool, tuple[int, ...], str | None, str]:
    """The logs a request's evidence is looked for in: the instance `named` by the router's
    `header`, when the pool has it; else the whole pool, with a note saying why.

    An instance the router named that the cluster does not list joins the pool
    as a log out of reach: evidence missing from the logs kvctl can read is
    then not observable (it may be in that instance's log), never failed."""
    if named:
        narrowed = pool.only(named, start)
        if narrowed is not None:
            return narrowed[0], narrowed[1], named, ""
        known = ", ".join(i.label for i in pool.instances)
        role = pool.instances[0].role if pool.instances else ""
        unlisted = InstanceInfo(role=role, url="", log_path=None, kv_transfer_config={}, name=named,
                                unobservable="named by the router, not listed in this cluster (attach it "
                                             "with its log source)")
        return (LogPool([*pool.instances, unlisted]), (*start, 0), None,
                f"the router's {header} named {named!r}, not an instance of this cluster ({known}): every "
                f"instance's log was searched")
    return pool, start, None, f"the answer had no {header} header: every instance's log was searched"


def _name_where_looked(check: CheckResult, name: str | None, header: str) -> None:
    """A failed check through the router says whose log it read (the instance the header named)."""
    if name and not check.passed and check.observable:
        check.evidence += f" (looked in {name}'s log: the instance named by {header})"


# ------------------------------------------------------------------ the one loop


@dataclass(frozen=True)
class RunOptions:
    """How `run_verify` goes through the prompts."""

    max_tokens: int = DEFAULT_MAX_TOKENS  # tokens D and the baseline generate
    concurrency: int = 1  # requests in flight at once (1: one after another, in this thread)
    keep_going: bool = False  # a request that raises becomes a failed ERROR_CHECK instead of stopping the run
    send_children: SendChildren | None = None  # see ClusterVerifier; None: every sending child of P
    log_wait_s: float = LOG_WAIT_S
    require: str = REQUIRE_ALL  # all | observable: what a check that is not observable does to the verdict
    via_endpoint: bool = False  # each request through the cluster's endpoint (see ClusterVerifier)
    compare: str = COMPARE_EXACT  # exact | tolerant (near-ties pass; see checks.check_output_matches_baseline)
    epsilon: float = DEFAULT_EPSILON  # tolerant: the top-2 logprob gap (nats) below which a divergence passes


@dataclass
class VerifyRun:
    """A finished run: the report, and how long the requests took."""

    report: VerifyReport
    wall_s: float


def run_verify(state: ClusterInfo | ClusterState | dict, prompts: Sequence[str],
               options: RunOptions = RunOptions(), progress: Progress | None = None) -> VerifyRun:
    """Verify every prompt against the cluster; the one driver of verify, load mode and scenarios.

    `progress(i, total, stage)` is called as request i reaches each stage and
    with "done" when it is finished. Log commands (`cmd:` sources) run while
    the requests do, and are stopped however the run ends. Raises BadInput for
    empty prompts, max_tokens < 1, concurrency < 1 or an unknown require
    (fields `prompts`, `max_tokens`, `concurrency`, `require`); without
    `keep_going`, RuntimeFailure when an instance cannot be reached or answers
    with an error.
    """
    info = state if isinstance(state, ClusterInfo) else cluster_info(state)
    prompts = check_prompts(prompts)
    if options.max_tokens < 1:
        raise BadInput(f"max tokens must be at least 1, got {options.max_tokens}", field="max_tokens",
                       fix="use 16 (or any K >= 1)")
    if options.concurrency < 1:
        raise BadInput(f"concurrency must be at least 1, got {options.concurrency}", field="concurrency",
                       fix="use 8 (or any C >= 1)")
    if options.require not in REQUIRE_CHOICES:
        raise BadInput(f"unknown require {options.require!r}", field="require",
                       fix=f"use one of: {', '.join(REQUIRE_CHOICES)}")
    if options.compare not in COMPARE_MODES:
        raise BadInput(f"unknown compare mode {options.compare!r}", field="compare",
                       fix=f"use one of: {', '.join(COMPARE_MODES)}")
    if not options.epsilon > 0:
        raise BadInput(f"epsilon must be > 0, got {options.epsilon}", field="epsilon",
                       fix=f"use {DEFAULT_EPSILON} (nats)")
    total = len(prompts)
    report = progress or (lambda i, n, s: None)

    with capturing_logs(info, every=options.via_endpoint) as info, \
            ClusterVerifier(info, log_wait_s=options.log_wait_s, send_children=options.send_children,
                            via_endpoint=options.via_endpoint, compare=options.compare,
                            epsilon=options.epsilon) as verifier:
        def one(i: int) -> RequestReport:
            try:
                result = verifier.verify_prompt(prompts[i], options.max_tokens, lambda s: report(i, total, s))
            except KvctlError as e:
                if not options.keep_going:
                    raise
                # HTTP error or unreachable server: count it and go on
                result = RequestReport(prompt=prompts[i], prompt_tokens=0, key="",
                                       checks=[CheckResult(ERROR_CHECK, False, e.message.replace("\n", "; "))])
            report(i, total, "done")
            return result

        start = time.perf_counter()
        if options.concurrency == 1:
            requests = [one(i) for i in range(total)]
        else:
            with ThreadPoolExecutor(max_workers=options.concurrency) as pool:
                requests = list(pool.map(one, range(total)))
        wall = time.perf_counter() - start
        pools = verifier.pools
    return VerifyRun(VerifyReport(cluster=info.name, requests=requests, max_tokens=options.max_tokens,
                                  require=options.require, pools=pools,
                                  endpoint=info.endpoint if options.via_endpoint else None), wall)


def verify_cluster(state: ClusterInfo | ClusterState | dict, prompts: Sequence[str] = DEFAULT_PROMPTS,
                   max_tokens: int = DEFAULT_MAX_TOKENS, progress: Progress | None = None, *,
                   concurrency: int = 1, log_wait_s: float = LOG_WAIT_S, require: str = REQUIRE_ALL,
                   via_endpoint: bool = False, compare: str = COMPARE_EXACT,
                   epsilon: float = DEFAULT_EPSILON) -> VerifyReport:
    """`kvctl verify`: every prompt against the cluster (ClusterState, its dict, or ClusterInfo).

    Stops at the first request that raises. Raises as `run_verify`.
    """
    options = RunOptions(max_tokens=max_tokens, concurrency=concurrency, log_wait_s=log_wait_s, require=require,
                         via_endpoint=via_endpoint, compare=compare, epsilon=epsilon)
    return run_verify(state, prompts, options, progress).report
