"""Load mode of `kvctl verify`: many distinct prompts through P then D, concurrently.

Every request goes through kvctl.verify.verifier's driver (P max_tokens=1,
entry check, D, baseline; through the cluster's endpoint, the router, when
`via_endpoint`, with each request's evidence read from the P and D the
router named and the requests counted per instance in the report's
"instances") and is checked against its own baseline; this
module only generates the prompts, asks the driver for C clients at once and
to keep going when one request fails, and summarises: throughput, p50/p99
latency of P and D, bytes transferred, and every mismatch and error. Library
code: nothing here prints; it returns a LoadReport or raises KvctlError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvctl.cluster.state import ClusterState
from kvctl.errors import BadInput
from kvctl.verify.checks import ERROR_CHECK
from kvctl.verify.cluster_info import ClusterInfo
from kvctl.verify.log_files import LOG_WAIT_S
from kvctl.verify.report import REQUIRE_ALL, VerifyReport
from kvctl.verify.verifier import DEFAULT_MAX_TOKENS, Progress, RunOptions, run_verify

_SUBJECTS = ("the lighthouse keeper", "a river barge", "the night train", "an old orchard",
             "the harbour crane", "a mountain hut", "the tram depot", "a glass workshop")
_ASKS = ("Describe its morning in two sentences.", "What does it sound like at noon?",
         "List three things that could go wrong there.", "Tell a short story set there.",
         "Explain how it changed over a hundred years.")
_FILLER = ("The weather was mild and the air smelled of salt and rain.",
           "Nobody remembered who had painted the door that shade of green.",
           "Every evening the same bell rang twice, then fell silent.")


def generate_prompts(n: int) -> list[str]:
    """`n` distinct prompts of varied length (about 20 to 90 tokens), the same on every run."""
    if n < 1:
        raise BadInput(f"requests must be at least 1, got {n}", field="requests", fix="use 100 (or any N >= 1)")
    prompts = []
    for i in range(n):
        filler = " ".join(_FILLER[(i + k) % len(_FILLER)] for k in range(i % 4))
        prompts.append(f"Request {i + 1}: about {_SUBJECTS[i % len(_SUBJECTS)]}. {filler} "
                       f"{_ASKS[(i // len(_SUBJECTS)) % len(_ASKS)]}".replace("  ", " "))
    return prompts


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


@dataclass
class LoadStats:
    requests: int
    concurrency: int
    wall_s: float
    errors: list[dict] = field(default_factory=list)  # requests that raised
    mismatches: list[dict] = field(default_factory=list)  # D's output differs from the baseline
    failed_checks: dict[str, int] = field(default_factory=dict)  # check name -> failures
    not_observable: dict[str, int] = field(default_factory=dict)  # check name -> requests it was not observable in
    prefill_latency_s: list[float] = field(default_factory=list)
    decode_latency_s: list[float] = field(default_factory=list)
    transfer_bytes: int = 0
    prompt_tokens: int = 0

    @property
    def completed(self) -> int:
        return self.requests - len(self.errors)

    def to_json(self) -> dict[str, Any]:
        def r(v: float | None, nd: int = 4) -> float | None:
            return None if v is None else round(v, nd)

        p, d = self.prefill_latency_s, self.decode_latency_s
        wall = self.wall_s or float("inf")
        return {
            "requests": self.requests, "concurrency": self.concurrency, "completed": self.completed,
            "wall_s": r(self.wall_s, 3),
            "throughput_rps": r(self.completed / wall, 3),
            "prompt_tokens_per_s": r(self.prompt_tokens / wall, 1),
            "prefill_latency_s": {"p50": r(percentile(p, 50)), "p99": r(percentile(p, 99)),
                                  "max": r(max(p, default=None))},
            "decode_latency_s": {"p50": r(percentile(d, 50)), "p99": r(percentile(d, 99)),
                                 "max": r(max(d, default=None))},
            "transfer_bytes": self.transfer_bytes,
            "num_mismatches": len(self.mismatches), "mismatches": self.mismatches,
            "num_errors": len(self.errors), "errors": self.errors,
            "failed_checks": self.failed_checks, "not_observable": self.not_observable,
        }


@dataclass
class LoadReport:
    verify: VerifyReport
    load: LoadStats

    @property
    def passed(self) -> bool:
        return self.verify.passed and not self.load.errors

    def to_json(self) -> dict[str, Any]:
        """The verify report's JSON (same contract) plus a "load" object."""
        return {**self.verify.to_json(), "passed": self.passed, "load": self.load.to_json()}


def summarise(report: VerifyReport, concurrency: int, wall_s: float) -> LoadStats:
    """The load figures of a finished run. Pure."""
    stats = LoadStats(requests=len(report.requests), concurrency=concurrency, wall_s=wall_s)
    for i, req in enumerate(report.requests):
        for check in req.checks:
            if check.passed:
                continue
            if not check.observable:
                stats.not_observable[check.name] = stats.not_observable.get(check.name, 0) + 1
                continue
            stats.failed_checks[check.name] = stats.failed_checks.get(check.name, 0) + 1
            item = {"request": i, "key": req.key or None, "prompt": req.prompt, "evidence": check.evidence}
            if check.name == ERROR_CHECK:
                stats.errors.append(item)
            elif check.name == "output_matches_baseline":
                stats.mismatches.append(item)
        if req.check(ERROR_CHECK):
            continue  # no latencies: the request did not finish
        stats.prompt_tokens += req.prompt_tokens
        stats.transfer_bytes += req.transfer_bytes or 0
        if req.prefill_latency_s is not None:
            stats.prefill_latency_s.append(req.prefill_latency_s)
        if req.decode_latency_s is not None:
            stats.decode_latency_s.append(req.decode_latency_s)
    return stats


def run_load(state: ClusterInfo | ClusterState | dict, prompts: Sequence[str],
             max_tokens: int = DEFAULT_MAX_TOKENS, concurrency: int = 8, progress: Progress | None = None, *,
             log_wait_s: float = LOG_WAIT_S, require: str = REQUIRE_ALL, via_endpoint: bool = False,
             compare: str = "exact", epsilon: float = 0.1) -> LoadReport:
    """Verify every prompt with `concurrency` clients at once; a request that fails is recorded, not fatal.

    Raises BadInput for empty prompts, max_tokens < 1, concurrency < 1 or an unknown require.
    """
    options = RunOptions(max_tokens=max_tokens, concurrency=concurrency, keep_going=True, log_wait_s=log_wait_s,
                         require=require, via_endpoint=via_endpoint, compare=compare, epsilon=epsilon)
    run = run_verify(state, prompts, options, progress)
    return LoadReport(run.report, summarise(run.report, concurrency, run.wall_s))
