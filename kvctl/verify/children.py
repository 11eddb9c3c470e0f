"""Each connector's own evidence for one request, beside the checks (RequestReport.children).

On a multi connector cluster (the seed's shape: P = MultiConnector [FSConnector transfer,
LMCacheMPConnector offload], D = FSConnector consumer) the checks judge the request as a whole;
these say what each part did, from its own lines:

    transfer  P's transfer child: its `KV send DONE.` line (tokens and bytes sent); NixlConnector:
              P's `Finished sending` line, with the tokens D was handed for it
    offload   P's offload child: its LMCache server's `Stored`/`Retrieved` lines since the
              request (counted by delta: LMCache's lines name no request); an FSConnector
              offload child beside a NIXL transfer child (v1-nixl-multi): its `KV send DONE.`
              line for the prompt's key and its entry in P's own dir (`fs_offload`)
    load      D: its `KV load DONE|NONE|FAILED.` line for the request's key (V1: tokens loaded,
              computed, from its prefix cache), or its `skip model forwarding` line (V0);
              NixlConnector: D's `Finished recving` line, with the tokens it pulled

Pure: takes lines and configs, returns ChildEvidence; a part without a line has tokens None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from connectors.config.topology import HANDSHAKE_CONNECTORS, children, multi_engine, transfer_child
from kvctl.verify import markers
from kvctl.verify import nixl as nixl_lines
from connectors.store.format import KVIdentity
from kvctl.verify.checks import (OFFLOAD_CHECK, CheckResult, KeyMatch, check_store_entry_written, match_request_key,
                                 not_observable, offload_tokens)
from kvctl.verify.cluster_info import OffloadInfo
from kvctl.verify.report import PART_LOAD, PART_OFFLOAD, PART_TRANSFER, ChildEvidence


def _connector(cfg: object, direction: str) -> tuple[str, int | None]:
    """(kv_connector, child index) of the connector carrying KV on this side of `cfg`."""
    child = transfer_child(cfg, direction)  # type: ignore[arg-type]
    if child is not None and multi_engine(cfg) is not None:
        return child.connector or "", child.index
    return str(cfg.get("kv_connector") or "") if isinstance(cfg, Mapping) else "", None


def request_children(prefill_config: object, decode_config: object, prefill: str, decode: str,
                     send: markers.KVSendLine | None, key: str, d_text: str,
                     offload: OffloadInfo | None = None, offload_text: str = "") -> list[ChildEvidence]:
    """Each part's evidence for one request ([] unless P or D runs a multi connector).

    `send`: P's send line for the request (None: none found); `key`: its store key; `d_text`:
    what D logged since it was asked; `offload`/`offload_text`: P's LMCache child and what its
    server logged since the request.
    """
    if multi_engine(prefill_config) is None and multi_engine(decode_config) is None:
        return []
    connector, index = _connector(prefill_config, "send")
    found = [ChildEvidence(PART_TRANSFER, prefill, connector, index, send.tokens if send else None,
                           {"bytes": send.bytes if send else None}, (send.line,) if send else ())]
    found += _offload_part(prefill, offload, offload_text)
    connector, index = _connector(decode_config, "recv")
    load = next((ld for ld in markers.kv_loads(d_text) if key and ld.key == key), None)
    if load is not None:
        found.append(ChildEvidence(PART_LOAD, decode, connector, index, load.loaded,
                                   {"computed": load.computed, "prefix_cached": load.prefix_cached}, (load.line,)))
    else:
        skip = next((s for s in markers.skip_forwards(d_text) if key and key in s.keys), None)
        found.append(ChildEvidence(PART_LOAD, decode, connector, index, skip.tokens if skip else None,
                                   {}, (skip.line,) if skip else ()))
    return found


def nixl_children(prefill_config: object, decode_config: object, prefill: str, decode: str,
                  ev: nixl_lines.RequestEvidence | None, offload: OffloadInfo | None = None,
                  offload_text: str = "", fs_offload_part: ChildEvidence | None = None) -> list[ChildEvidence]:
    """`request_children` for a NixlConnector transfer (kvctl.verify.nixl's lines for one request):
    P's `Finished sending` line, D's `Finished recving` line with the tokens it pulled (D's
    scheduler line that decided the pull), and P's offload child as for FS (`fs_offload_part`: an
    FSConnector offload child's, from `fs_offload`)."""
    if multi_engine(prefill_config) is None and multi_engine(decode_config) is None:
        return []
    pulled = ev.allocated.tokens if ev is not None and ev.allocated is not None else None
    local = ev.matched.tokens if ev is not None and ev.matched is not None else None
    sent, received = (ev.sent, ev.received) if ev is not None else (None, None)
    p_connector, p_index = _nixl_child(prefill_config)
    d_connector, d_index = _nixl_child(decode_config)
    return [ChildEvidence(PART_TRANSFER, prefill, p_connector, p_index, pulled if sent else None, {},
                          (sent.line,) if sent else ()),
            *_offload_part(prefill, offload, offload_text),
            *([fs_offload_part] if fs_offload_part is not None else []),
            ChildEvidence(PART_LOAD, decode, d_connector, d_index, pulled if received else None,
                          {"prefix_cached": local}, (received.line,) if received else ())]


def _nixl_child(cfg: object) -> tuple[str, int | None]:
    """(connector, child index) of the config's handshake (NIXL) connector: itself, or a child."""
    if multi_engine(cfg) is not None:
        found = next((c for c in children(cfg) if c.connector in HANDSHAKE_CONNECTORS), None)
        if found is not None:
            return found.connector or "", found.index
    return str(cfg.get("kv_connector") or "") if isinstance(cfg, Mapping) else "", None


def _offload_part(instance: str, offload: OffloadInfo | None, text: str) -> list[ChildEvidence]:
    if offload is None:
        return []
    stored, retrieved = offload_tokens(text)
    lines = tuple(x.line for x in markers.lmcache_lines(text))
    return [ChildEvidence(PART_OFFLOAD, instance, offload.connector, offload.child,
                          stored + retrieved if lines else None, {"stored": stored, "retrieved": retrieved}, lines)]


def fs_offload(index: int, tokens: Sequence[int], request_id: str, p_text: str, p_store: Path | None,
               d_text: str, d_store: Path | None, known: KVIdentity | None = None, instance: str = "prefill",
               ) -> tuple[CheckResult, ChildEvidence, KeyMatch | None]:
    """The offload check, the offload part and P's matched send line of an FSConnector offload child
    (P's child `index`, beside a NIXL transfer child) for one request.

    `p_text`/`d_text`: what P and D logged since the request; `p_store`/`d_store`: each side's
    FS child's own directory (None: not visible from here); `known`: an identity learned from an
    earlier entry. The check passes when P's child logged `KV send DONE` for this prompt's key and
    its entry in `p_store` holds exactly `tokens`. D's FS child's lines (it loads nothing when NIXL
    served the request: the first child with tokens wins) are kept in the part's lines.
    """
    who = f"P's offload child FSConnector (child {index}, store {p_store if p_store is not None else '?'})"
    match = match_request_key(markers.kv_sends(p_text), tokens, p_store, known)
    d_lines = _fs_decode_lines(tokens, request_id, d_text, d_store, match.identity if match else known)
    if match is None or match.send is None:
        seen = "; ".join(s.line for s in markers.kv_sends(p_text)[-2:]) or "none"
        check = CheckResult(OFFLOAD_CHECK, False, f"{who} logged no `{markers.KV_SEND}` line for this prompt "
                                                  f"({len(tokens)} tokens) since the request; its send lines: {seen}")
        return check, ChildEvidence(PART_OFFLOAD, instance, "FSConnector", index, None, {}, d_lines), match
    if p_store is None:
        check = not_observable(OFFLOAD_CHECK, f"{who} logged {match.send.line}, and its dir is not known here")
        saved, lines = len(tokens), (match.send.line,)
    else:
        entry = check_store_entry_written(p_store, match.key, tokens)
        check = CheckResult(OFFLOAD_CHECK, entry.passed, f"{who} saved this prompt: {match.send.line}; "
                                                         f"entry: {entry.evidence}")
        saved, lines = (len(tokens) if entry.passed else None), (match.send.line, entry.evidence)
    return check, ChildEvidence(PART_OFFLOAD, instance, "FSConnector", index, saved, {"saved": saved},
                                lines + d_lines), match


def _fs_decode_lines(tokens: Sequence[int], request_id: str, d_text: str, d_store: Path | None,
                     known: KVIdentity | None) -> tuple[str, ...]:
    """D's FS child's lines for the request: its `KV load` line, and its own save of the prompt."""
    lines = [ld.line for ld in markers.kv_loads(d_text) if ld.request and nixl_lines.names(ld.request, request_id)][:1]
    saved = match_request_key(markers.kv_sends(d_text), tokens, d_store, known)
    if saved is not None and saved.send is not None:
        lines.append(saved.send.line)
    return tuple(lines)
