"""What verify returns: one RequestReport per prompt inside a VerifyReport.

`VerifyReport.to_json()` is `kvctl verify --json`'s contract (scenario and
load reports embed it): change it only with its consumers.

`require` decides what a check that is not observable (kvctl.verify.checks
`not_observable`) does to the verdict: `all` (the default) fails the request
and the run, since kvctl cannot vouch for what it did not see; `observable`
lets the run pass when every check it could observe passed (and the
not-observable ones are listed, with their reasons).

Each request names the instances that served it (`prefill_instance`,
`decode_instance`, and `instances_from`: how kvctl knows: the router's
`X-Kvctl-*` headers, the instance whose log held the request's lines, or
`direct` when kvctl sent to P and D itself). `VerifyReport.pools` lists, per
role, the instances that should serve; the run fails (`run_failures`) when
one of them served none of the requests, which is only decided when the run
sent at least as many requests as that pool has instances and kvctl knows
which instance served each (`instance_notes` say otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvctl.verify.checks import BASELINE_KIND, ERROR_CHECK, CheckResult
from kvctl.verify.children import ChildEvidence

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
    request_id: str = ""  # the X-Request-Id P and D got (their logs name it)
    prefill_instance: str | None = None  # the instance that served each side; None: unknown
    decode_instance: str | None = None
    instances_from: str = ""  # how those are known: one of INSTANCES_FROM; "" when unknown
    children: list[ChildEvidence] = field(default_factory=list)  # a multi connector's children: what each did

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
            "request_id": self.request_id or None,
            "prefill_instance": self.prefill_instance, "decode_instance": self.decode_instance,
            "instances_from": self.instances_from or None,
            "children": [c.to_json() for c in self.children],
        }

    def instance(self, role: str) -> str | None:
        return self.prefill_instance if role == "prefill" else self.decode_instance


# How a request's instances are known (RequestReport.instances_from):
FROM_HEADERS = "headers"  # the router's answer named them (X-Kvctl-Prefill, X-Kvctl-Decode)
FROM_LOGS = "logs"  # no usable headers: the instance whose log held the request's lines
FROM_DIRECT = "direct"  # kvctl sent to P and D itself
INSTANCES_FROM = (FROM_HEADERS, FROM_LOGS, FROM_DIRECT)
INSTANCE_SERVED = "instance_served"  # the run-level check: every instance that should serve did


@dataclass(frozen=True)
class RunFailure:
    """A failure of the run as a whole (not of one request): `check` failed for `instance`."""

    check: str
    instance: str
    role: str
    reason: str

    def to_json(self) -> dict:
        return {"check": self.check, "instance": self.instance, "role": self.role, "reason": self.reason}


def judged_pools(pools: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """The pools whose members are each checked for having served: those of two or more instances
    (one instance serves every request that completes; a request that fails says so itself)."""
    return {role: list(names) for role, names in pools.items() if len(names) > 1}


def pool_verdict(pools: Mapping[str, Sequence[str]],
                 requests: Sequence[RequestReport]) -> tuple[list[RunFailure], list[str]]:
    """Which instance that should serve served none of `requests`; and why a pool was not judged. Pure.

    `pools`: role -> the instances of that role that should serve. A pool of
    two or more (`judged_pools`) is judged only when the run sent at least as
    many requests as it has instances, and every request that completed says
    which instance of that role served it; otherwise a note says why not.
    """
    failures: list[RunFailure] = []
    notes: list[str] = []
    total = len(requests)
    errors = sum(1 for r in requests if r.check(ERROR_CHECK) is not None)
    unheaded = sum(1 for r in requests if r.instances_from == FROM_LOGS
                   or (not r.instances_from and r.check(ERROR_CHECK) is None))
    if unheaded and pools:
        notes.append(f"{unheaded} of the {total} requests came back without router headers naming instances "
                     f"of this cluster (X-Kvctl-Prefill, X-Kvctl-Decode): their evidence was looked for in every "
                     f"instance's log, and the instance whose log held it is reported")
    for role, names in judged_pools(pools).items():
        unserved = [n for n in names if not any(r.instance(role) == n for r in requests)]
        if not unserved:
            continue
        listed = ", ".join(unserved)
        if total < len(names):
            notes.append(f"the {role} pool has {len(names)} instances but the run sent {total} "
                         f"request{'s' if total != 1 else ''}: {listed} could not all serve (not a failure; "
                         f"send at least {len(names)} requests to check every {role} instance)")
            continue
        unknown = sum(1 for r in requests if r.instance(role) is None and r.check(ERROR_CHECK) is None)
        if unknown:
            notes.append(f"kvctl cannot tell which {role} instance served {unknown} of the {total} requests "
                         f"(no router headers and no matching log line), so {listed} serving none is not "
                         f"judged")
            continue
        why = f"; {errors} request{'s' if errors != 1 else ''} failed before kvctl could tell" if errors else ""
        for name in unserved:
            failures.append(RunFailure(INSTANCE_SERVED, name, role, (
                f"{role} instance {name} served none of the {total} requests{why}: the router never "
                f"chose it (is it unhealthy, or missing from the router's pool?)")))
    return failures, notes


@dataclass
class VerifyReport:
    cluster: str
    requests: list[RequestReport]
    max_tokens: int
    baseline: str = BASELINE_KIND
    require: str = REQUIRE_ALL
    pools: dict[str, list[str]] = field(default_factory=dict)  # role -> the instances that should serve
    endpoint: str | None = None  # the URL every request went through (the router), None: P then D directly

    def __post_init__(self) -> None:
        for r in self.requests:
            r.require = self.require

    @property
    def passed(self) -> bool:
        return bool(self.requests) and all(r.passed for r in self.requests) and not self.run_failures()

    def served(self) -> dict[str, dict]:
        """Instance name -> {"role", "served"}: each instance that should serve, and any other that did."""
        found: dict[str, dict] = {n: {"role": role, "served": 0} for role, names in self.pools.items()
                                  for n in names}
        for r in self.requests:
            for role in ("prefill", "decode"):
                name = r.instance(role)
                if name is not None:
                    found.setdefault(name, {"role": role, "served": 0})["served"] += 1
        return found

    def run_failures(self) -> list[RunFailure]:
        return pool_verdict(self.pools, self.requests)[0]

    def instance_notes(self) -> list[str]:
        return pool_verdict(self.pools, self.requests)[1]

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
                "require": self.require, "endpoint": self.endpoint, "not_observable": self.not_observable(),
                "instances": self.served(), "run_failures": [f.to_json() for f in self.run_failures()],
                "instance_notes": self.instance_notes()}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)
