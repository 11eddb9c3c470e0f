"""What verify returns: one RequestReport per prompt inside a VerifyReport.

`VerifyReport.to_json()` is `kvctl verify --json`'s contract (scenario and
load reports embed it): change it only with its consumers.

`require` decides what a check that is not observable (kvctl.verify.checks
`not_observable`) does to the verdict: `all` (the default) fails the request
and the run, since kvctl cannot vouch for what it did not see; `observable`
lets the run pass when every check it could observe passed (and the
not-observable ones are listed, with their reasons).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvctl.verify.checks import BASELINE_KIND, CheckResult

REQUIRE_ALL = "all"  # every check must pass: a check that is not observable fails
REQUIRE_OBSERVABLE = "observable"  # every observable check must pass; the others are reported
REQUIRE_CHOICES = (REQUIRE_ALL, REQUIRE_OBSERVABLE)


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
    require: str = REQUIRE_ALL  # set by the VerifyReport holding it

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(
            c.passed or (not c.observable and self.require == REQUIRE_OBSERVABLE) for c in self.checks)

    @property
    def not_observable(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.observable]

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
            "not_observable": [c.name for c in self.not_observable],
        }


@dataclass
class VerifyReport:
    cluster: str
    requests: list[RequestReport]
    max_tokens: int
    baseline: str = BASELINE_KIND
    require: str = REQUIRE_ALL

    def __post_init__(self) -> None:
        for r in self.requests:
            r.require = self.require

    @property
    def passed(self) -> bool:
        return bool(self.requests) and all(r.passed for r in self.requests)

    def not_observable(self) -> dict[str, str]:
        """Check name -> why it was not observable (the first reason seen), over every request."""
        found: dict[str, str] = {}
        for r in self.requests:
            for c in r.not_observable:
                found.setdefault(c.name, c.evidence.removeprefix("not observable: "))
        return found

    def to_json(self) -> dict:
        return {"cluster": self.cluster, "passed": self.passed,
                "requests": [r.to_json() for r in self.requests],
                "baseline": self.baseline, "max_tokens": self.max_tokens,
                "require": self.require, "not_observable": self.not_observable()}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)
