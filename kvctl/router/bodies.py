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

The handshake (a cluster whose transfer connector answers with `kv_transfer_params`,
NIXL: connectors.config.topology.handshake_connector), as vLLM's own P/D proxy does
it: P gets the prefill body above without `min_tokens` and `min_completion_tokens`
(a remote-decode prefill does not take them) and with

    kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false,
                          "remote_engine_id": null, "remote_block_ids": null,
                          "remote_host": null, "remote_port": null}

and D gets the client's request with `kv_transfer_params` set to the object P
answered with (where D pulls the KV from), every other field as the client sent
it (re-encoded JSON).
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


# What P is asked for (vLLM's toy_proxy_server.py sends exactly this).
PREFILL_KV_TRANSFER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                              "remote_engine_id": None, "remote_block_ids": None,
                              "remote_host": None, "remote_port": None}
KV_TRANSFER_PARAMS = "kv_transfer_params"


def handshake_prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """P's request for `body` when the cluster needs the handshake (module docstring)."""
    out = prefill_request(body)
    out.pop("min_tokens", None)
    out.pop("min_completion_tokens", None)
    out[KV_TRANSFER_PARAMS] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return out


def handshake_decode_request(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """D's request: the client's `body` with P's answered `params` as its kv_transfer_params."""
    return {**body, KV_TRANSFER_PARAMS: params}


def answered_params(raw: bytes) -> dict[str, Any] | None:
    """The non-empty `kv_transfer_params` object of P's JSON answer, else None."""
    try:
        answer = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    params = answer.get(KV_TRANSFER_PARAMS) if isinstance(answer, dict) else None
    return params if isinstance(params, dict) and params else None


def encode(body: dict[str, Any]) -> bytes:
    """JSON bytes; floats keep their shortest repr (0.7 stays 0.7)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def error_body(message: str, *, type: str, code: str, **extra: Any) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code", ...extra}}."""
    return {"error": {"message": message, "type": type, "param": None, "code": code, **extra}}
