"""Request and error bodies: the prefill rule and OpenAI-style errors. Pure.

The prefill rule (the one place it is written): P gets the client's request with

    max_tokens            = 1
    max_completion_tokens = 1          only when the client sent it
    min_tokens            = min(min_tokens, 1)   only when the client sent an int above 1
    stream                = false
    stream_options        removed

and every other field as the client sent it, so P tokenizes exactly the prompt D
will, and the store entry P publishes is the one D looks up. D gets the client's
body untouched (the router forwards the bytes it received, never a re-encoding).
"""

from __future__ import annotations

import json
from typing import Any


class BadRequestBody(ValueError):
    """The client's body is not a JSON object (the router answers 400)."""


def parse_request(raw: bytes) -> dict[str, Any]:
    """The client's JSON body as a dict. Raises BadRequestBody when it is not a JSON object."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequestBody(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequestBody(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """P's request for the client's `body` (see the module docstring); `body` is not changed."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    min_tokens = out.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens > 1:
        out["min_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    return out


def encode(body: dict[str, Any]) -> bytes:
    """JSON bytes; floats keep their shortest repr (0.7 stays 0.7)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def error_body(message: str, *, type: str, code: str, **extra: Any) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code", ...extra}}."""
    return {"error": {"message": message, "type": type, "param": None, "code": code, **extra}}
