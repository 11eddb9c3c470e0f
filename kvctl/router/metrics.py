"""The router's metrics in Prometheus' text format (0.0.4), written by hand. Pure.

kvctl's light venv has no prometheus_client; the format is small:

    kvctl_router_requests_total{path,status}            requests answered, by what the client got
    kvctl_router_instance_requests_total{role,instance} requests sent to each instance
    kvctl_router_errors_total{role,instance,kind}       failures per instance: connect, timeout,
                                                        status (a 5xx), broken (cut mid-answer)
    kvctl_router_prefill_seconds{instance}              P's whole answer (histogram)
    kvctl_router_decode_first_byte_seconds{instance}    D's first byte (histogram)
    kvctl_router_decode_seconds{instance}               D's whole answer, relayed (histogram)
    kvctl_router_request_seconds{path}                  the client's whole request (histogram)
    kvctl_router_instance_healthy{role,instance}        1 while healthy (gauge)
    kvctl_router_instance_outstanding{role,instance}    requests in flight (gauge)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

# Seconds; a CPU prefill of a long prompt takes seconds, a GPU one milliseconds.
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
             30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Labels = tuple[tuple[str, str], ...]


@dataclass
class _Histogram:
    buckets: list[int] = field(default_factory=lambda: [0] * len(BUCKETS_S))
    sum: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        for k, upper in enumerate(BUCKETS_S):
            if value <= upper:
                self.buckets[k] += 1
        self.sum += value
        self.count += 1


@dataclass
class _Family:
    name: str
    kind: str  # counter | histogram | gauge
    help: str
    counters: dict[Labels, float] = field(default_factory=dict)
    histograms: dict[Labels, _Histogram] = field(default_factory=dict)


def _labels(**kw: object) -> Labels:
    return tuple((k, str(v)) for k, v in kw.items())


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_labels(labels: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}" if inner else ""


def _fmt_value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class Metrics:
    """What the router counts; `render(gauges)` gives the /metrics text."""

    def __init__(self) -> None:
        f = _Family
        self.requests = f("kvctl_router_requests_total", "counter", "Requests answered, by path and status.")
        self.instance_requests = f("kvctl_router_instance_requests_total", "counter",
                                   "Requests sent to each instance.")
        self.errors = f("kvctl_router_errors_total", "counter",
                        "Failures per instance: connect, timeout, status (5xx), broken (cut mid-answer).")
        self.prefill = f("kvctl_router_prefill_seconds", "histogram", "Prefill answer time per instance.")
        self.decode_first = f("kvctl_router_decode_first_byte_seconds", "histogram",
                              "Time to the decode instance's first byte.")
        self.decode = f("kvctl_router_decode_seconds", "histogram",
                        "Decode answer time per instance, relayed to the client.")
        self.total = f("kvctl_router_request_seconds", "histogram", "Whole request time at the router.")
        self._families = [self.requests, self.instance_requests, self.errors, self.prefill,
                          self.decode_first, self.decode, self.total]

    @staticmethod
    def inc(family: _Family, **labels: object) -> None:
        key = _labels(**labels)
        family.counters[key] = family.counters.get(key, 0.0) + 1

    @staticmethod
    def observe(family: _Family, seconds: float, **labels: object) -> None:
        family.histograms.setdefault(_labels(**labels), _Histogram()).observe(seconds)

    def render(self, gauges: Iterable[tuple[str, str, str, dict[str, str], float]] = ()) -> str:
        """The text exposition; `gauges` adds (name, help, kind, labels, value) samples."""
        lines: list[str] = []
        for fam in self._families:
            lines += [f"# HELP {fam.name} {fam.help}", f"# TYPE {fam.name} {fam.kind}"]
            for labels, value in sorted(fam.counters.items()):
                lines.append(f"{fam.name}{_fmt_labels(labels)} {_fmt_value(value)}")
            for labels, h in sorted(fam.histograms.items()):
                for upper, n in zip(BUCKETS_S, h.buckets):
                    lines.append(f"{fam.name}_bucket{_fmt_labels((*labels, ('le', _fmt_value(upper))))} {n}")
                lines.append(f"{fam.name}_bucket{_fmt_labels((*labels, ('le', '+Inf')))} {h.count}")
                lines.append(f"{fam.name}_sum{_fmt_labels(labels)} {_fmt_value(h.sum)}")
                lines.append(f"{fam.name}_count{_fmt_labels(labels)} {h.count}")
        declared: set[str] = set()
        for name, help_, kind, labels, value in gauges:
            if name not in declared:
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
                declared.add(name)
            lines.append(f"{name}{_fmt_labels(labels.items())} {_fmt_value(value)}")
        return "\n".join(lines) + "\n"
