"""What verify returns: one RequestReport per prompt inside a VerifyReport.

`VerifyReport.to_json()` is `kvctl verify --json`'s contract (scenario and
load reports embed it): change it only with its consumers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvctl.verify.checks import BASELINE_KIND, CheckResult


@dataclass
class RequestReport:
    prompt: str
    prompt_tokens: int
    key: str
    checks: list[CheckResult] = field(default_factory=list)
    decode_output: str = ""
    baseline_output: str = ""
    prefill_latency_s: float | None = None
    decode_latency_s: float | None = None
    baseline_latency_s: float | None = None
    transfer_bytes: int | None = None
    send_ms: float | None = None
    recv_ms: float | None = None

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def check(self, name: str) -> CheckResult | None:
        return next((c for c in self.checks if c.name == name), None)

    def to_json(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "key": self.key,
            "checks": [c.to_json() for c in self.checks],
            "decode_output": self.decode_output, "baseline_output": self.baseline_output,
            "passed": self.passed, "prompt": self.prompt,
            "prefill_latency_s": _round(self.prefill_latency_s),
            "decode_latency_s": _round(self.decode_latency_s),
            "baseline_latency_s": _round(self.baseline_latency_s),
            "transfer_bytes": self.transfer_bytes, "send_ms": self.send_ms, "recv_ms": self.recv_ms,
        }


@dataclass
class VerifyReport:
    cluster: str
    requests: list[RequestReport]
    max_tokens: int
    baseline: str = BASELINE_KIND

    @property
    def passed(self) -> bool:
        return bool(self.requests) and all(r.passed for r in self.requests)

    def to_json(self) -> dict:
        return {"cluster": self.cluster, "passed": self.passed,
                "requests": [r.to_json() for r in self.requests],
                "baseline": self.baseline, "max_tokens": self.max_tokens}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)
