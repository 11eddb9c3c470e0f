"""Parse the log lines that prove a KV transfer happened. Pure: text in, records out.

The lines, their templates and the patterns that read them are connectors.log_lines
(the connectors log them from there); this module turns matches into records.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, TypeVar

from connectors import log_lines as ll

# The phrases verify's evidence quotes.
LMCACHE_STORED, LMCACHE_RETRIEVED = ll.LMCACHE_STORED, ll.LMCACHE_RETRIEVED
KV_SEND = ll.KV_SEND_PHRASE
SKIP_FORWARD = ll.SKIP_PHRASE
REDO_FORWARD = ll.REDO_PHRASE


@dataclass(frozen=True)
class KVSendLine:
    """Producer: one request's KV was published. Fields are None on upstream lines."""

    rank: int
    key: str | None
    tokens: int | None
    bytes: int | None
    ms: float | None
    line: str


@dataclass(frozen=True)
class ChildSendLine:
    """MultiConnectorV0 handed a step's KV to one child."""

    name: str
    child: int | None
    ms: float | None
    line: str


@dataclass(frozen=True)
class ChildFailureLine:
    child: int
    name: str
    error: str
    line: str


@dataclass(frozen=True)
class SkipForwardLine:
    """Consumer: every prefill in the step was served from received KV."""

    rank: int
    keys: tuple[str, ...]
    tokens: int | None
    bytes: int | None
    ms: float | None
    line: str


@dataclass(frozen=True)
class RedoForwardLine:
    """Consumer: the step ran its forward pass; `reason` names the key and why."""

    rank: int
    reason: str
    line: str

    def mentions(self, key: str) -> bool:
        return key in self.reason


@dataclass(frozen=True)
class KVLoadLine:
    """V1 consumer: what one request's prompt got from the store (loaded) and computed."""

    rank: int
    outcome: str  # DONE | NONE | FAILED
    request: str | None
    key: str | None
    prompt_tokens: int | None
    loaded: int | None
    computed: int | None
    prefix_cached: int | None
    reason: str
    line: str

    @property
    def skipped_prefill(self) -> bool:
        """Loaded from the store and computed only what neither the store nor the prefix cache held."""
        if self.outcome != "DONE" or not self.loaded or None in (self.prompt_tokens, self.computed):
            return False
        return self.computed == self.prompt_tokens - (self.prefix_cached or 0) - self.loaded


def _fields(rest: str) -> dict[str, str]:
    return dict(ll.FIELD_RE.findall(rest))


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


T = TypeVar("T")


def _scan(text: str, pattern: re.Pattern[str], record: Callable[[re.Match[str], str], T]) -> list[T]:
    """`record(match, stripped line)` for every line `pattern` finds, in log order."""
    return [record(m, line.strip()) for line in text.splitlines() if (m := pattern.search(line))]


def _kv_send(m: re.Match[str], line: str) -> KVSendLine:
    f = _fields(m["rest"])
    return KVSendLine(rank=int(m["rank"]), key=f.get("key"), tokens=_int(f.get("tokens")),
                      bytes=_int(f.get("bytes")), ms=_float(f.get("ms")), line=line)


def _child_send(m: re.Match[str], line: str) -> ChildSendLine:
    return ChildSendLine(name=m["name"], child=_int(m["child"]), ms=_float(m["ms"]), line=line)


def _child_failure(m: re.Match[str], line: str) -> ChildFailureLine:
    return ChildFailureLine(child=int(m["child"]), name=m["name"], error=m["error"].strip(), line=line)


def _skip_forward(m: re.Match[str], line: str) -> SkipForwardLine:
    f = _fields(m["rest"])
    keys = tuple(k for k in f.get("keys", "").split(",") if k)
    return SkipForwardLine(rank=int(m["rank"]), keys=keys, tokens=_int(f.get("tokens")),
                           bytes=_int(f.get("bytes")), ms=_float(f.get("ms")), line=line)


def _redo_forward(m: re.Match[str], line: str) -> RedoForwardLine:
    rest = m["rest"].strip()
    reason = rest.split("reason=", 1)[1].strip() if "reason=" in rest else rest
    return RedoForwardLine(rank=int(m["rank"]), reason=reason, line=line)


def _kv_load(m: re.Match[str], line: str) -> KVLoadLine:
    rest, _, reason = m["rest"].partition(" reason=")
    f = _fields(rest)
    return KVLoadLine(rank=int(m["rank"]), outcome=m["outcome"], request=f.get("req"), key=f.get("key"),
                      prompt_tokens=_int(f.get("prompt_tokens")), loaded=_int(f.get("loaded")),
                      computed=_int(f.get("computed")), prefix_cached=_int(f.get("prefix_cached")),
                      reason=reason.strip(), line=line)


def kv_sends(text: str) -> list[KVSendLine]:
    """Every `KV send DONE.` line, in log order."""
    return _scan(text, ll.KV_SEND_RE, _kv_send)


def child_sends(text: str) -> list[ChildSendLine]:
    """Every `sent to connector <Name>` line, in log order."""
    return _scan(text, ll.CHILD_SENT_RE, _child_send)


def child_failures(text: str) -> list[ChildFailureLine]:
    """Every multi-connector child that raised on send, in log order."""
    return _scan(text, ll.CHILD_SEND_FAILED_RE, _child_failure)


def skip_forwards(text: str) -> list[SkipForwardLine]:
    """Every consumer `skip model forwarding` line, in log order."""
    return _scan(text, ll.SKIP_FORWARD_RE, _skip_forward)


def redo_forwards(text: str) -> list[RedoForwardLine]:
    """Every consumer `redo model forwarding` line, in log order."""
    return _scan(text, ll.REDO_FORWARD_RE, _redo_forward)


def kv_loads(text: str) -> list[KVLoadLine]:
    """Every V1 `KV load DONE|NONE|FAILED.` line, in log order."""
    return _scan(text, ll.KV_LOAD_RE, _kv_load)


def received_requests(text: str) -> list[str]:
    """Request ids from vLLM's `Received request <id>: prompt: ...` lines."""
    return _scan(text, ll.RECEIVED_RE, lambda m, _line: m["id"])


@dataclass(frozen=True)
class LMCacheLine:
    """LMCache's server stored or retrieved `tokens` (whole chunks) for some request (unnamed)."""

    what: str  # LMCACHE_STORED | LMCACHE_RETRIEVED
    tokens: int
    seconds: float
    line: str


_SOURCE_TAG = re.compile(r"\s*\([\w.]+\.py:\d+:[\w.]+\)\s*$")  # LMCache's `(file.py:N:module)` suffix
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def lmcache_lines(text: str) -> list[LMCacheLine]:
    """Every `Stored N tokens` / `Retrieved N tokens` line of an LMCache server's log, in log order
    (quoted without colours or LMCache's source tag)."""
    return _scan(text, ll.LMCACHE_RE, lambda m, line: LMCacheLine(
        what=m["what"], tokens=int(m["tokens"]), seconds=float(m["seconds"]),
        line=_SOURCE_TAG.sub("", _ANSI.sub("", line)).strip()))

