"""The router's metrics, counted and rendered by prometheus_client (text format 0.0.4). Pure.

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

Each Metrics has its own registry (two routers in one process count apart); the
gauges are read from the pools at scrape time, so they are passed to `render`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

# Seconds; a CPU prefill of a long prompt takes seconds, a GPU one milliseconds.
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
             30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# A `<name>_created` sample per counter and histogram series would double what a scrape
# carries for no use here (the router's start is its process's start).
prometheus_client.disable_created_metrics()

Gauge = tuple[str, str, Mapping[str, str], float]  # name, help, labels, value


class _Samples:
    """A collector of metric families built for one scrape."""

    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class Metrics:
    """What the router counts; `render(gauges)` gives the /metrics text."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("kvctl_router_requests_total", "Requests answered, by path and status.",
                                ["path", "status"], registry=r)
        self.instance_requests = Counter("kvctl_router_instance_requests_total",
                                         "Requests sent to each instance.", ["role", "instance"], registry=r)
        self.errors = Counter("kvctl_router_errors_total",
                              "Failures per instance: connect, timeout, status (5xx), broken (cut mid-answer).",
                              ["role", "instance", "kind"], registry=r)
        self.prefill = Histogram("kvctl_router_prefill_seconds", "Prefill answer time per instance.",
                                 ["instance"], registry=r, buckets=BUCKETS_S)
        self.decode_first = Histogram("kvctl_router_decode_first_byte_seconds",
                                      "Time to the decode instance's first byte.", ["instance"], registry=r,
                                      buckets=BUCKETS_S)
        self.decode = Histogram("kvctl_router_decode_seconds",
                                "Decode answer time per instance, relayed to the client.", ["instance"],
                                registry=r, buckets=BUCKETS_S)
        self.total = Histogram("kvctl_router_request_seconds", "Whole request time at the router.", ["path"],
                               registry=r, buckets=BUCKETS_S)

    @staticmethod
    def inc(family: Counter, **labels: object) -> None:
        family.labels(**labels).inc()

    @staticmethod
    def observe(family: Histogram, seconds: float, **labels: object) -> None:
        family.labels(**labels).observe(seconds)

    def render(self, gauges: Iterable[Gauge] = ()) -> str:
        """The text exposition; `gauges` adds (name, help, labels, value) gauge samples."""
        families: dict[str, GaugeMetricFamily] = {}
        for name, help_, labels, value in gauges:
            family = families.get(name)
            if family is None:
                family = families[name] = GaugeMetricFamily(name, help_, labels=list(labels))
            family.add_metric([str(v) for v in labels.values()], value)
        return (generate_latest(self.registry) + generate_latest(_Samples(families.values()))).decode()
