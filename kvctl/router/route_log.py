"""The one log line per routed request, written and parsed back here. Pure.

    ... ROUTED id=<request id> path=/v1/chat/completions stream=true prefill=prefill-0
        decode=decode-1 status=200 prefill_ms=12.3 decode_first_byte_ms=4.1 decode_ms=80.2
        total_ms=93.0 error=-

(one line; any prefix such as a time or a level). `prefill`/`decode` name the instance
that served the request (`-` when none was reached), `status` is what the client got
(499 when the client went away first), the latencies are the router's view in
milliseconds (`-` when that stage did not run), and `error` says what failed. A
value with spaces or quotes is written as a JSON string. Verify follows a request's
evidence by its id: this line names its P and D; their own logs name the same id.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields

ROUTED = "kvctl-router routed"
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection first"

_FIELD_RE = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
_SAFE_RE = re.compile(r'^[^\s"]+$')


@dataclass
class RouteRecord:
    id: str
    path: str
    stream: bool = False
    prefill: str | None = None
    decode: str | None = None
    status: int | None = None
    prefill_ms: float | None = None
    decode_first_byte_ms: float | None = None
    decode_ms: float | None = None
    total_ms: float | None = None
    error: str | None = None

    def line(self) -> str:
        parts = [ROUTED]
        for f in fields(self):
            parts.append(f"{f.name}={_format(getattr(self, f.name))}")
        return " ".join(parts)


def _format(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.1f}"
    text = str(value)
    return text if _SAFE_RE.match(text) and text != "-" else json.dumps(text)


def parse_route_line(line: str) -> RouteRecord | None:
    """The record of a ROUTED line, or None for any other line."""
    at = line.find(ROUTED + " ")
    if at < 0:
        return None
    raw = {k: (json.loads(v) if v.startswith('"') else v)
           for k, v in _FIELD_RE.findall(line[at + len(ROUTED):])}
    if "id" not in raw or "path" not in raw:
        return None

    def value(name: str, cast):
        v = raw.get(name, "-")
        if v == "-":
            return None
        try:
            return cast(v)
        except ValueError:
            return None

    return RouteRecord(id=raw["id"], path=raw["path"], stream=raw.get("stream") == "true",
                       prefill=value("prefill", str), decode=value("decode", str),
                       status=value("status", int), prefill_ms=value("prefill_ms", float),
                       decode_first_byte_ms=value("decode_first_byte_ms", float),
                       decode_ms=value("decode_ms", float), total_ms=value("total_ms", float),
                       error=value("error", str))
