"""What each child of a NIXL MultiConnector did for one request: pure, text and store in, evidence out.

vLLM's V1 MultiConnector with NixlConnector as the transfer child and our FSConnector
as an offload child (scenario v1-nixl-multi) logs nothing per child; each child logs its
own lines, and those say what it did:

    NixlConnector  P  Finished sending KV transfer for request <id>      (kvctl.verify.nixl)
                   D  update_state_after_alloc: num_external_tokens=N, Finished recving ...
    FSConnector    P  KV send DONE. key=<key> tokens=N bytes=B ...      P saved the prompt in its dir
                   D  KV load NONE. req=<D's id> key=... reason=...     D took nothing from it (NIXL
                                                                        served: the first child wins)
                      KV send DONE. key=<key> ...                       D saved its own copy (kv_both)

P's FS line carries the key, not the request: it is this request's when the key is
compute_key(the entry's identity, this prompt's token ids), as for every FS check
(kvctl.verify.checks.match_request_key). D's load line names D's request id, which
contains the X-Request-Id the router sent (kvctl.verify.nixl.names).

`fs_offload` returns the offload check (kvctl.verify.checks.OFFLOAD_CHECK: P's FS
child saved a valid entry holding exactly this prompt in its own dir) and the FS
child's `ChildEvidence`; `nixl_child` turns the three NIXL checks into the NIXL
child's. Verify lists both per request (RequestReport.children).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from connectors.store.format import KVIdentity
from kvctl.verify import markers
from kvctl.verify import nixl as nixl_evidence
from kvctl.verify.checks import (OFFLOAD_CHECK, CheckResult, KeyMatch, check_store_entry_written,
                                 match_request_key, not_observable)


@dataclass(frozen=True)
class ChildEvidence:
    """One child connector of P's and D's MultiConnector: what it did for one request, and the lines
    that say so (its own log lines, or the check evidence they gave)."""

    index: int
    connector: str
    prefill: str  # what P's child did, in a few words ("" when P has no such child)
    decode: str  # what D's child did
    prefill_lines: tuple[str, ...] = ()
    decode_lines: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"index": self.index, "connector": self.connector, "prefill": self.prefill, "decode": self.decode,
                "prefill_lines": list(self.prefill_lines), "decode_lines": list(self.decode_lines)}

    def describe(self) -> str:
        return f"child {self.index} {self.connector}: P {self.prefill or '-'}; D {self.decode or '-'}"


def nixl_child(index: int, connector: str, sent: CheckResult, pulled: CheckResult) -> ChildEvidence:
    """The NIXL child's evidence from its checks (kvctl.verify.nixl): P sent, D pulled."""
    p = "sent the KV (D read P's blocks)" if sent.passed else "did not send"
    if pulled.passed:
        d = f"pulled {pulled.evidence.split(' ', 1)[0].removeprefix('pulled=')} tokens from P"
    else:
        d = "did not pull"
    return ChildEvidence(index, connector, p, d, (sent.evidence,), (pulled.evidence,))


def _who(index: int, store: Path | None) -> str:
    return f"P's offload child FSConnector (child {index}, store {store if store is not None else '?'})"


def fs_offload(index: int, tokens: Sequence[int], request_id: str, p_text: str, p_store: Path | None,
               d_text: str, d_store: Path | None, known: KVIdentity | None = None
               ) -> tuple[CheckResult, ChildEvidence, KeyMatch | None]:
    """The offload check, the FS child's evidence and P's matched send line for one request.

    `p_text`/`d_text`: what P and D logged since the request; `p_store`/`d_store`: each side's
    FS child's own directory (None: not visible from here); `known`: an identity learned
    from an earlier entry. The check passes when P's child logged `KV send DONE` for this
    prompt's key and its entry in `p_store` holds exactly `tokens`.
    """
    who = _who(index, p_store)
    match = match_request_key(markers.kv_sends(p_text), tokens, p_store, known)
    if match is None or match.send is None:
        seen = "; ".join(s.line for s in markers.kv_sends(p_text)[-2:]) or "none"
        check = CheckResult(OFFLOAD_CHECK, False, f"{who} logged no `{markers.KV_SEND}` line for this prompt "
                                                  f"({len(tokens)} tokens) since the request; its send lines: "
                                                  f"{seen}")
        p_did, p_lines = "saved nothing for this prompt", ()
    else:
        if p_store is None:
            d_did, d_lines = _decode_side(tokens, request_id, d_text, d_store, match.identity or known)
            return (not_observable(OFFLOAD_CHECK, f"{who} logged {match.send.line}, and its dir is not known here"),
                    ChildEvidence(index, "FSConnector", f"saved key={match.key[:12]} ({len(tokens)} tokens)", d_did,
                                  (match.send.line,), d_lines), match)
        entry = check_store_entry_written(p_store, match.key, tokens)
        check = CheckResult(OFFLOAD_CHECK, entry.passed, f"{who} saved this prompt: {match.send.line}; "
                                                         f"entry: {entry.evidence}")
        p_did = (f"saved key={match.key[:12]} ({len(tokens)} tokens) in its dir" if entry.passed
                 else f"logged a save of key={match.key[:12]} but its entry is not valid")
        p_lines = (match.send.line, entry.evidence)
    d_did, d_lines = _decode_side(tokens, request_id, d_text, d_store, match.identity if match else known)
    return check, ChildEvidence(index, "FSConnector", p_did, d_did, p_lines, d_lines), match


def _decode_side(tokens: Sequence[int], request_id: str, d_text: str, d_store: Path | None,
                 known: KVIdentity | None) -> tuple[str, tuple[str, ...]]:
    """What D's FS child did: its `KV load` line for the request, and its own save of the prompt."""
    loads = [ld for ld in markers.kv_loads(d_text) if ld.request and nixl_evidence.names(ld.request, request_id)]
    did, lines = [], []
    if loads:
        ld = loads[0]
        did.append(f"loaded {ld.loaded} tokens from its dir" if ld.outcome == "DONE" and ld.loaded
                   else "loaded nothing from its dir")
        lines.append(ld.line)
    else:
        did.append("logged no `KV load` line for this request")
    saved = match_request_key(markers.kv_sends(d_text), tokens, d_store, known)
    if saved is not None and saved.send is not None:
        did.append(f"saved its own copy key={saved.key[:12]}")
        lines.append(saved.send.line)
    return ", ".join(did), tuple(lines)
