"""NIXL evidence per request: vLLM's own lines, read by the request id the router gave P and D.

vLLM 0.32's NixlConnector (pull mode) and scheduler log, per request:

    P  Finished sending KV transfer for request <P's id>                     DEBUG, scheduler
    P  Releasing expired KV blocks for request <P's id> which were retrieved by <n> remote
       worker(s) before lease expired.                                       WARNING, P's worker
    P  Potentially invalid KV blocks for unrecognized request <P's id> were retrieved by a
       decode worker. They may have expired.                                 ERROR, P's worker
    D  NIXLConnector get_num_new_matched_tokens: num_computed_tokens=<c>, kv_transfer_params={...}
    D  NIXLConnector update_state_after_alloc: num_external_tokens=<n>, kv_transfer_params={...}
    D  Finished recving KV transfer for request <D's id>                     DEBUG, scheduler
    D  NIXL transfer failure: <kind, e.g. handshake_failed> | Context: {'request_id': <D's id>, ...}
                                                                             ERROR, D's worker
    D  Failing <n> request(s) due to KV load failure (failure_policy=fail, <t> tokens affected).
       Request IDs: {<D's id>, ...}                                          ERROR, D's scheduler
       (kv_load_failure_policy "fail", vLLM's default; "recompute" logs "Recovered from KV
       load failure" without ids, and D then computes the prompt itself)

(the DEBUG lines come from the two loggers kvctl.cluster.nixl turns on). vLLM names a
request after the X-Request-Id it got (`cmpl-<id>-...`, `chatcmpl-<id>-...`), and D's
kv_transfer_params carry P's id as `remote_request_id`: so every line of one request is
found by the id, with other requests interleaved. Pure: text in, records and
CheckResults out.

The four checks keep their names (kvctl.verify.checks.CHECKS) and mean, for NIXL:

    kv_send_logged          P finished sending this request's KV (D read it), and its lease
                            did not expire first
    store_entry_written     D was handed P's blocks: the kv_transfer_params D logged name P's
                            engine, blocks and side channel, for this request's whole prompt
    decode_skipped_forward  D pulled N > 0 external tokens for it, finished receiving them,
                            and computed no prompt token beyond its own prefix cache
                            (local cached + pulled = the prompt)
    output_matches_baseline as for every connector; a different answer after P's lease
                            expired says so (D read blocks P had freed: `lease_named`)
"""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from kvctl.verify.checks import CheckResult

FINISHED_SENDING = "Finished sending KV transfer for request"
FINISHED_RECVING = "Finished recving KV transfer for request"
LEASE_EXPIRED = "Releasing expired KV blocks for request"
READ_AFTER_EXPIRY = "Potentially invalid KV blocks for unrecognized request"
MATCHED = "NIXLConnector get_num_new_matched_tokens:"
ALLOCATED = "NIXLConnector update_state_after_alloc:"
FAILURE = "NIXL transfer failure:"
LOAD_FAILED = "due to KV load failure (failure_policy=fail"

_ID = r"(?P<id>[\w.:-]+)"
_SENT_RE = re.compile(re.escape(FINISHED_SENDING) + r" " + _ID)
_RECVD_RE = re.compile(re.escape(FINISHED_RECVING) + r" " + _ID)
_EXPIRED_RE = re.compile(re.escape(LEASE_EXPIRED) + r" " + _ID + r" which were retrieved by (?P<n>\d+)")
_AFTER_RE = re.compile(re.escape(READ_AFTER_EXPIRY) + r" " + _ID)
_MATCHED_RE = re.compile(re.escape(MATCHED) + r" num_computed_tokens=(?P<n>\d+), kv_transfer_params=(?P<p>.*)$")
_FAILURE_RE = re.compile(re.escape(FAILURE) + r" (?P<kind>\w+)[^|]*\| Context: (?P<ctx>\{.*\})")
_LOAD_FAILED_RE = re.compile(r"Failing \d+ request\(s\) " + re.escape(LOAD_FAILED) + r".*Request IDs: (?P<ids>\{.*\})")
_ALLOC_RE = re.compile(re.escape(ALLOCATED) + r" num_external_tokens=(?P<n>\d+), kv_transfer_params=(?P<p>.*)$")


@dataclass(frozen=True)
class IdLine:
    """A line naming one request id (P's finished sending, D's finished receiving, ...)."""

    request: str
    line: str
    count: int | None = None  # the lease line's reader count
    kind: str = ""  # a failure line's kind (handshake_failed, transfer_setup_failed, ...)


@dataclass(frozen=True)
class ParamsLine:
    """D's scheduler line with a token count and the request's kv_transfer_params."""

    tokens: int
    params: dict[str, Any]
    line: str

    @property
    def remote_request(self) -> str:
        return str(self.params.get("remote_request_id") or "")


@dataclass
class NixlLog:
    """The NIXL lines of one log text."""

    sent: list[IdLine] = field(default_factory=list)
    received: list[IdLine] = field(default_factory=list)
    expired: list[IdLine] = field(default_factory=list)
    after_expiry: list[IdLine] = field(default_factory=list)
    matched: list[ParamsLine] = field(default_factory=list)
    allocated: list[ParamsLine] = field(default_factory=list)
    failures: list[IdLine] = field(default_factory=list)
    load_failed: list[IdLine] = field(default_factory=list)  # one per request id the line names


def _literal(text: str) -> Any:
    """A Python literal vLLM logged (a dict of params, a set of ids), or None."""
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return None


def _params(text: str) -> dict[str, Any]:
    value = _literal(text)
    return value if isinstance(value, dict) else {}


def parse(text: str) -> NixlLog:
    out = NixlLog()
    for raw in text.splitlines():
        line = raw.strip()
        if (m := _SENT_RE.search(line)):
            out.sent.append(IdLine(m["id"], line))
        elif (m := _RECVD_RE.search(line)):
            out.received.append(IdLine(m["id"], line))
        elif (m := _EXPIRED_RE.search(line)):
            out.expired.append(IdLine(m["id"], line, int(m["n"])))
        elif (m := _AFTER_RE.search(line)):
            out.after_expiry.append(IdLine(m["id"], line))
        elif (m := _MATCHED_RE.search(line)):
            out.matched.append(ParamsLine(int(m["n"]), _params(m["p"]), line))
        elif (m := _ALLOC_RE.search(line)):
            out.allocated.append(ParamsLine(int(m["n"]), _params(m["p"]), line))
        elif (m := _FAILURE_RE.search(line)):
            ctx = _params(m["ctx"])
            out.failures.append(IdLine(str(ctx.get("request_id") or ""), line, kind=m["kind"].strip()))
        elif (m := _LOAD_FAILED_RE.search(line)):
            ids = _literal(m["ids"])
            if isinstance(ids, (set, list, tuple)):
                out.load_failed.extend(IdLine(str(i), line) for i in ids)
    return out


def names(vllm_id: str, request_id: str) -> bool:
    """Whether vLLM's id for a request (`cmpl-<id>-...`) is the one sent as X-Request-Id `request_id`."""
    return bool(request_id) and re.search(rf"(^|-){re.escape(request_id)}(-|$)", vllm_id) is not None


@dataclass
class RequestEvidence:
    """One request's NIXL lines in P's and D's logs."""

    request_id: str
    sent: IdLine | None
    expired: IdLine | None
    after_expiry: IdLine | None
    allocated: ParamsLine | None  # D's, for this request (its params name P's id)
    matched: ParamsLine | None
    received: IdLine | None
    failure: IdLine | None = None  # D's NIXL failure line for it
    load_failed: IdLine | None = None  # D's scheduler failing it (kv_load_failure_policy fail)

    @property
    def settled(self) -> bool:
        """D's part is over (received, failed, or nothing to pull) and P's too (sent or expired)."""
        if self.failure is not None or self.load_failed is not None:
            return True
        d_done = self.received is not None or (self.allocated is not None and self.allocated.tokens == 0)
        return d_done and (self.sent is not None or self.expired is not None)


def evidence(request_id: str, p_text: str, d_text: str) -> RequestEvidence:
    """The lines of the request sent as X-Request-Id `request_id` (P's and D's ids contain it)."""
    p, d = parse(p_text), parse(d_text)

    def first(lines: list[IdLine]) -> IdLine | None:
        return next((x for x in lines if names(x.request, request_id)), None)

    def mine(lines: list[ParamsLine]) -> ParamsLine | None:
        # vLLM logs the request again once the pull is done, with do_remote_prefill cleared and 0
        # tokens: the line that decided the pull is the one still asking for a remote prefill.
        found = [x for x in lines if names(x.remote_request, request_id)]
        asking = [x for x in found if x.params.get("do_remote_prefill")]
        return (asking or found or [None])[-1]

    return RequestEvidence(request_id, first(p.sent), first(p.expired), first(p.after_expiry),
                           mine(d.allocated), mine(d.matched), first(d.received), first(d.failures),
                           first(d.load_failed))


def check_sent(ev: RequestEvidence) -> CheckResult:
    name = "kv_send_logged"
    if ev.expired is not None:
        return CheckResult(name, False, f"P's lease on this request's KV blocks expired before D read them "
                                        f"(its blocks were freed and may hold another prompt's KV): {ev.expired.line}")
    if ev.after_expiry is not None:
        return CheckResult(name, False, f"D read this request's blocks after P's lease expired: "
                                        f"{ev.after_expiry.line}")
    if ev.sent is None:
        return CheckResult(name, False, f"P logged no `{FINISHED_SENDING} ...{ev.request_id}...` line: D never "
                                        "read P's blocks for it (a handshake that failed, a D that pulled "
                                        "nothing, or the request never reached a NIXL P)")
    return CheckResult(name, True, ev.sent.line)


def check_handed(ev: RequestEvidence, prompt_tokens: int) -> CheckResult:
    name = "store_entry_written"
    line = ev.allocated or ev.matched
    if line is None:
        return CheckResult(name, False, f"D logged no NIXL line whose kv_transfer_params name request "
                                        f"{ev.request_id}: D got no remote-prefill params (was the request "
                                        "sent through the router's handshake?)")
    p = line.params
    missing = [k for k in ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")
               if not p.get(k)]
    if not p.get("do_remote_prefill") or missing:
        return CheckResult(name, False, f"D's kv_transfer_params lack {', '.join(missing) or 'do_remote_prefill'}: "
                                        f"{line.line}")
    blocks = sum(len(b) for b in p["remote_block_ids"]) if isinstance(p["remote_block_ids"], list) else 0
    remote = p.get("remote_num_tokens")
    if isinstance(remote, int) and remote != prompt_tokens:
        return CheckResult(name, False, f"P's blocks hold {remote} tokens, the prompt has {prompt_tokens}: "
                                        f"{line.line}")
    return CheckResult(name, True, f"P's engine {p['remote_engine_id']} handed {blocks} block(s) of "
                                   f"{remote if remote is not None else '?'} tokens at "
                                   f"{p['remote_host']}:{p['remote_port']} to D")


def check_pulled(ev: RequestEvidence, prompt_tokens: int) -> CheckResult:
    name = "decode_skipped_forward"
    if ev.allocated is None:
        return CheckResult(name, False, f"D logged no `{ALLOCATED} num_external_tokens=...` line for request "
                                        f"{ev.request_id}: it pulled nothing and recomputed the prompt")
    pulled = ev.allocated.tokens
    cached = ev.matched.tokens if ev.matched is not None else None
    failed = (f"; D failed the request (kv_load_failure_policy fail): {ev.load_failed.line}"
              if ev.load_failed is not None else "")
    if ev.failure is not None:
        what = ("its NIXL handshake with P's side channel failed" if "handshake" in ev.failure.kind
                else f"its pull failed ({ev.failure.kind})")
        return CheckResult(name, False, f"D was to pull {pulled} tokens for request {ev.request_id} but "
                                        f"{what}: {ev.failure.line}{failed}")
    if ev.load_failed is not None:
        return CheckResult(name, False, f"D was to pull {pulled} tokens for request {ev.request_id} but its "
                                        f"KV load failed{failed}")
    if pulled == 0:
        return CheckResult(name, False, f"D pulled 0 external tokens for request {ev.request_id} and computed "
                                        f"the prompt itself: {ev.allocated.line}")
    if ev.received is None:
        return CheckResult(name, False, f"D was to pull {pulled} tokens but logged no `{FINISHED_RECVING}` for "
                                        f"request {ev.request_id} (the pull failed or never finished)")
    if cached is not None and cached + pulled != prompt_tokens:
        return CheckResult(name, False, f"D pulled {pulled} tokens and had {cached} in its prefix cache, so it "
                                        f"computed {prompt_tokens - cached - pulled} of {prompt_tokens} prompt "
                                        f"tokens itself: {ev.allocated.line}")
    return CheckResult(name, True, f"pulled={pulled} prefix_cached={cached if cached is not None else '?'} "
                                   f"computed=0 of prompt_tokens={prompt_tokens}: {ev.received.line}")


def lease_named(output: CheckResult, sent: CheckResult) -> CheckResult:
    """The output check of a request whose answer differs after P's lease expired, with the
    reason: D read blocks P had already freed (and perhaps given to another prompt)."""
    if output.passed or sent.passed or not any(m in sent.evidence for m in (LEASE_EXPIRED, READ_AFTER_EXPIRY)):
        return output
    return dataclasses.replace(output, evidence=f"{output.evidence} (P's lease on this request's KV expired "
                                                "before D read it: D read freed blocks, which may hold another "
                                                "prompt's KV; see kv_send_logged)")
