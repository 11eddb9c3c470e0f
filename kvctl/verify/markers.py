"""Parse the log lines that prove a KV transfer happened. Pure: text in, records out.

The lines come from our connectors (exact substrings operators grep for; the
upstream V0 connectors print the same prefixes without the key=value tail):

    P  [rank0]: KV send DONE. key=<32 hex> tokens=<int> bytes=<int> ms=<float>
    P  sent to connector <Name> (child <i>, <ms> ms)                (MultiConnectorV0)
    P  child <i> <Name> failed in send_kv_caches_and_hidden_states: <error>
    D  [rank0]: Successfully received all KVs and hidden states, skip model forwarding. keys=<hex>[,<hex>...] tokens=.. bytes=.. ms=..
    D  [rank0]: Failed to receive all KVs and hidden states, redo model forwarding. reason=<text>

and from the V1 FSConnector (connectors.v1.fs_connector) on D, once per request:

    D  [rank0]: KV load DONE. req=<id> key=<hex> prompt_tokens=<T> loaded=<n> computed=<c> prefix_cached=<p> bytes=<n> ms=<f>
    D  [rank0]: KV load NONE. req=<id> key=<hex> prompt_tokens=<T> loaded=0 computed=<c> prefix_cached=<p> reason=<why>
    D  [rank0]: KV load FAILED. req=<id> key=<hex> ... reason=<why>

(V1 never logs the skip/redo lines: D always computes at least the last
prompt token), and vLLM's own `Received request chatcmpl-<id>: prompt: ...`. Lines may carry
any prefix (log level, time, docker timestamps), so patterns search, not match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KV_SEND = "KV send DONE."
SKIP_FORWARD = "Successfully received all KVs and hidden states, skip model forwarding"
REDO_FORWARD = "Failed to receive all KVs and hidden states, redo model forwarding"

_RANK = r"\[rank(?P<rank>\d+)\]: "
_KV_SEND_RE = re.compile(_RANK + re.escape(KV_SEND) + r"(?P<rest>.*)$")
_SKIP_RE = re.compile(_RANK + re.escape(SKIP_FORWARD) + r"\.?(?P<rest>.*)$")
_REDO_RE = re.compile(_RANK + re.escape(REDO_FORWARD) + r"\.?(?P<rest>.*)$")
_FIELD_RE = re.compile(r"(\w+)=(\S+)")
_CHILD_SENT_RE = re.compile(
    r"sent to connector (?P<name>[\w.]+)(?: \(child (?P<child>\d+), (?P<ms>[\d.]+) ms\))?")
_CHILD_FAILED_RE = re.compile(
    r"child (?P<child>\d+) (?P<name>[\w.]+) failed in send_kv_caches_and_hidden_states: (?P<error>.*)$")
_KV_LOAD_RE = re.compile(_RANK + r"KV load (?P<outcome>DONE|NONE|FAILED)\.(?P<rest>.*)$")
_RECEIVED_RE = re.compile(r"Received request (?P<id>[\w-]+): prompt: ")


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
    return dict(_FIELD_RE.findall(rest))


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


def kv_sends(text: str) -> list[KVSendLine]:
    """Every `KV send DONE.` line, in log order."""
    found = []
    for line in text.splitlines():
        m = _KV_SEND_RE.search(line)
        if m:
            f = _fields(m["rest"])
            found.append(KVSendLine(rank=int(m["rank"]), key=f.get("key"), tokens=_int(f.get("tokens")),
                                    bytes=_int(f.get("bytes")), ms=_float(f.get("ms")), line=line.strip()))
    return found


def child_sends(text: str) -> list[ChildSendLine]:
    """Every `sent to connector <Name>` line, in log order."""
    found = []
    for line in text.splitlines():
        m = _CHILD_SENT_RE.search(line)
        if m:
            found.append(ChildSendLine(name=m["name"], child=_int(m["child"]), ms=_float(m["ms"]),
                                       line=line.strip()))
    return found


def child_failures(text: str) -> list[ChildFailureLine]:
    """Every multi-connector child that raised on send, in log order."""
    found = []
    for line in text.splitlines():
        m = _CHILD_FAILED_RE.search(line)
        if m:
            found.append(ChildFailureLine(child=int(m["child"]), name=m["name"], error=m["error"].strip(),
                                          line=line.strip()))
    return found


def skip_forwards(text: str) -> list[SkipForwardLine]:
    """Every consumer `skip model forwarding` line, in log order."""
    found = []
    for line in text.splitlines():
        m = _SKIP_RE.search(line)
        if m:
            f = _fields(m["rest"])
            keys = tuple(k for k in f.get("keys", "").split(",") if k)
            found.append(SkipForwardLine(rank=int(m["rank"]), keys=keys, tokens=_int(f.get("tokens")),
                                         bytes=_int(f.get("bytes")), ms=_float(f.get("ms")),
                                         line=line.strip()))
    return found


def redo_forwards(text: str) -> list[RedoForwardLine]:
    """Every consumer `redo model forwarding` line, in log order."""
    found = []
    for line in text.splitlines():
        m = _REDO_RE.search(line)
        if m:
            rest = m["rest"].strip()
            reason = rest.split("reason=", 1)[1].strip() if "reason=" in rest else rest
            found.append(RedoForwardLine(rank=int(m["rank"]), reason=reason, line=line.strip()))
    return found


def kv_loads(text: str) -> list[KVLoadLine]:
    """Every V1 `KV load DONE|NONE|FAILED.` line, in log order."""
    found = []
    for line in text.splitlines():
        m = _KV_LOAD_RE.search(line)
        if m:
            rest, _, reason = m["rest"].partition(" reason=")
            f = _fields(rest)
            found.append(KVLoadLine(rank=int(m["rank"]), outcome=m["outcome"], request=f.get("req"),
                                    key=f.get("key"), prompt_tokens=_int(f.get("prompt_tokens")),
                                    loaded=_int(f.get("loaded")), computed=_int(f.get("computed")),
                                    prefix_cached=_int(f.get("prefix_cached")), reason=reason.strip(),
                                    line=line.strip()))
    return found


def received_requests(text: str) -> list[str]:
    """Request ids from vLLM's `Received request <id>: prompt: ...` lines."""
    return [m["id"] for line in text.splitlines() if (m := _RECEIVED_RE.search(line))]
