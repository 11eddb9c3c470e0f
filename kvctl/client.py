"""A small HTTP client for one vLLM OpenAI-compatible server (httpx, no vLLM import).

Requests are the curl equivalents of the seed's hand-run flow:
POST /v1/chat/completions {model, messages, max_tokens, temperature: 0, top_p: 0.95},
plus `logprobs` with `return_tokens_as_token_ids` so outputs compare by token id.
One client may be shared by threads (httpx.Client pools connections).
With `api_key`, every request carries `Authorization: Bearer KEY` (a cluster
launched with an API key requires it on /v1/*; vLLM ignores it without one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvctl.errors import RuntimeFailure

DEFAULT_TIMEOUT_S = 300.0  # a long prompt on 2 CPU cores takes seconds, a cold one more
SEED_TOP_P = 0.95  # the seed's curl sends it; greedy decoding ignores it


@dataclass
class ChatResult:
    """One chat completion: its text, the token ids when the server gave them."""

    text: str
    token_ids: list[int] | None
    token_strs: list[str] | None
    latency_s: float
    request_id: str
    prompt_tokens: int | None
    finish_reason: str | None
    raw: dict[str, Any] = field(repr=False, default_factory=dict)
    headers: dict[str, str] = field(repr=False, default_factory=dict)  # the answer's HTTP headers (lowercase)
    # per generated token, the server's best candidates as (token id, logprob), best first;
    # None unless asked for (chat(top_logprobs=N)) and given
    top_logprobs: list[list[tuple[int, float]]] | None = field(repr=False, default=None)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The `Authorization` header for `api_key` ({} without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def user_messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


class VLLMClient:
    """Talks to one server. Every failure raises RuntimeFailure naming the URL."""

    def __init__(self, base_url: str, model: str, *, role: str = "server",
                 timeout_s: float = DEFAULT_TIMEOUT_S, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.role = role
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=auth_headers(api_key))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "VLLMClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self) -> bool:
        """True when GET /health answers 200; False when it answers otherwise.

        Raises RuntimeFailure when the server cannot be reached at all.
        """
        return self._request("GET", "/health").status_code == 200

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt token ids exactly as a chat completion sees them (template applied).

        vLLM's TokenizeChatRequest defaults add_special_tokens to False, as
        chat completions do; we send both flags so the equality never drifts.
        """
        body = {"model": self.model, "messages": messages, "add_generation_prompt": True,
                "add_special_tokens": False}
        data = self._json("POST", "/tokenize", body)
        tokens = data.get("tokens")
        if not isinstance(tokens, list):
            raise RuntimeFailure(f"{self.role} /tokenize returned no token list",
                                 where=f"{self.base_url}/tokenize", details=str(data)[:500])
        return [int(t) for t in tokens]

    def chat(self, messages: list[dict[str, str]], max_tokens: int, temperature: float = 0.0,
             top_p: float = SEED_TOP_P, headers: dict[str, str] | None = None,
             top_logprobs: int = 0, extra: dict[str, Any] | None = None) -> ChatResult:
        """One non-streaming chat completion; latency is the whole HTTP round trip.

        `headers` go with the request (e.g. X-Request-Id); the answer's come back in `headers`.
        `top_logprobs` > 0 also asks for that many best candidates per token (`top_logprobs`).
        `extra` fields go into the body (e.g. NIXL's kv_transfer_params).
        """
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature, "top_p": top_p,
                # token ids for exact comparison; logprobs do not change greedy picks
                "logprobs": True, "top_logprobs": top_logprobs, "return_tokens_as_token_ids": True,
                **(extra or {})}
        start = time.perf_counter()
        answer: dict[str, str] = {}
        data = self._json("POST", "/v1/chat/completions", body, headers, answer)
        latency = time.perf_counter() - start
        try:
            choice = data["choices"][0]
            text = choice["message"].get("content") or ""
        except (KeyError, IndexError, TypeError, AttributeError):
            raise RuntimeFailure(f"{self.role} returned a chat completion without a message",
                                 where=f"{self.base_url}/v1/chat/completions",
                                 details=str(data)[:500]) from None
        token_ids, token_strs = _tokens_from_logprobs(choice.get("logprobs"))
        return ChatResult(text=text, token_ids=token_ids, token_strs=token_strs, latency_s=latency,
                          request_id=str(data.get("id", "")),
                          prompt_tokens=(data.get("usage") or {}).get("prompt_tokens"),
                          finish_reason=choice.get("finish_reason"), raw=data, headers=answer,
                          top_logprobs=_top_logprobs(choice.get("logprobs")) if top_logprobs else None)

    def complete_tokens(self, prompt: list[int], max_tokens: int) -> ChatResult:
        """One non-streaming greedy /v1/completions on prompt token ids (no chat template,
        no tokenizer pass); latency is the whole HTTP round trip."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        start = time.perf_counter()
        data = self._json("POST", "/v1/completions", body)
        latency = time.perf_counter() - start
        try:
            choice = data["choices"][0]
            text = choice.get("text") or ""
        except (KeyError, IndexError, TypeError, AttributeError):
            raise RuntimeFailure(f"{self.role} returned a completion without a choice",
                                 where=f"{self.base_url}/v1/completions", details=str(data)[:500]) from None
        return ChatResult(text=text, token_ids=None, token_strs=None, latency_s=latency,
                          request_id=str(data.get("id", "")),
                          prompt_tokens=(data.get("usage") or {}).get("prompt_tokens"),
                          finish_reason=choice.get("finish_reason"), raw=data)

    def _json(self, method: str, path: str, body: dict, headers: dict[str, str] | None = None,
              answer: dict[str, str] | None = None) -> dict:
        resp = self._request(method, path, json=body, headers=headers)
        if answer is not None:
            answer.update((k.lower(), v) for k, v in resp.headers.items())
        if resp.status_code == 401:
            raise RuntimeFailure(
                f"{self.role} answered 401 to {method} {path}: it requires an API key"
                + (" and refused the one sent" if "authorization" in self._http.headers else ""),
                where=f"{self.base_url}{path}",
                fix="send the cluster's key: launch it with one (kvctl keeps it), or set "
                    "KVCTL_API_KEY for a cluster kvctl attached", details=resp.text[:1000])
        if resp.status_code != 200:
            raise RuntimeFailure(
                f"{self.role} answered {resp.status_code} to {method} {path}",
                where=f"{self.base_url}{path}",
                fix="check the request fields and the server log (`kvctl logs "
                    f"{self.role}`)" if self.role in ("prefill", "decode") else None,
                details=resp.text[:1000])
        try:
            return resp.json()
        except ValueError:
            raise RuntimeFailure(f"{self.role} answered {method} {path} with non-JSON",
                                 where=f"{self.base_url}{path}", details=resp.text[:500]) from None

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        url = f"{self.base_url}{path}"
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.ConnectError as e:
            raise RuntimeFailure(f"cannot connect to the {self.role} instance at {self.base_url}: {e}",
                                 where=url,
                                 fix="is the cluster up? check `kvctl status`; start it with "
                                     "`kvctl launch 1p1d`") from None
        except httpx.TimeoutException as e:
            raise RuntimeFailure(f"{self.role} instance at {self.base_url} timed out on {method} {path}",
                                 where=url, fix="check `kvctl status` and `kvctl logs "
                                                f"{self.role}`", details=str(e)) from None
        except httpx.HTTPError as e:
            raise RuntimeFailure(f"HTTP error talking to the {self.role} instance: {e}", where=url,
                                 fix="check `kvctl status`") from None


def _tokens_from_logprobs(logprobs: dict | None) -> tuple[list[int] | None, list[str] | None]:
    """Token ids and strings from `return_tokens_as_token_ids` logprobs ("token_id:<n>")."""
    content = (logprobs or {}).get("content")
    if not content:
        return None, None
    ids: list[int] = []
    strs: list[str] = []
    for item in content:
        token = str(item.get("token", ""))
        if not token.startswith("token_id:"):
            return None, None  # server ignored the flag: compare text only
        try:
            ids.append(int(token.split(":", 1)[1]))
        except ValueError:
            return None, None
        raw = item.get("bytes")
        strs.append(bytes(raw).decode("utf-8", errors="replace") if raw is not None else "")
    return ids, strs


def _top_logprobs(logprobs: dict | None) -> list[list[tuple[int, float]]] | None:
    """Per token, its `top_logprobs` candidates as (id, logprob), best first; None if absent."""
    content = (logprobs or {}).get("content")
    if not content:
        return None
    out = []
    for item in content:
        candidates = []
        for cand in item.get("top_logprobs") or []:
            token = str(cand.get("token", ""))
            if not token.startswith("token_id:"):
                return None
            try:
                candidates.append((int(token.split(":", 1)[1]), float(cand["logprob"])))
            except (ValueError, KeyError, TypeError):
                return None
        out.append(sorted(candidates, key=lambda c: -c[1]))
    return out
