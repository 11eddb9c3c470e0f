"""Each connector's own evidence for one request, beside the checks (RequestReport.children).

On a multi connector cluster (the seed's shape: P = MultiConnector [FSConnector transfer,
LMCacheMPConnector offload], D = FSConnector consumer) the checks judge the request as a whole;
these say what each part did, from its own lines:

    transfer  P's transfer child: its `KV send DONE.` line (tokens and bytes sent); NixlConnector:
              P's `Finished sending` line, with the tokens D was handed for it
    offload   P's offload child: its LMCache server's `Stored`/`Retrieved` lines since the
              request (counted by delta: LMCache's lines name no request)
    load      D: its `KV load DONE|NONE|FAILED.` line for the request's key (V1: tokens loaded,
              computed, from its prefix cache), or its `skip model forwarding` line (V0);
              NixlConnector: D's `Finished recving` line, with the tokens it pulled

Pure: takes lines and configs, returns ChildEvidence; a part without a line has tokens None.
"""

from __future__ import annotations

from collections.abc import Mapping

from connectors.config.topology import HANDSHAKE_CONNECTORS, children, multi_engine, transfer_child
from kvctl.verify import markers
from kvctl.verify import nixl as nixl_lines
from kvctl.verify.checks import offload_tokens
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
                  offload_text: str = "") -> list[ChildEvidence]:
    """`request_children` for a NixlConnector transfer (kvctl.verify.nixl's lines for one request):
    P's `Finished sending` line, D's `Finished recving` line with the tokens it pulled (D's
    scheduler line that decided the pull), and P's offload child as for FS."""
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
