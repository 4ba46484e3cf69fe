"""Prometheus metrics of a drafter pool: how long proposals take, by drafter kind, and
how many requests the pool holds.

The pool records into a `DrafterMetrics` (each its own registry); the host that serves
the pool exposes the registry over HTTP (cluster/actors.py), and the HTTP ingress's
/metrics gathers it with every other service's.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram

PROPOSE_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class DrafterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.propose_seconds = Histogram("specserve_drafter_propose_seconds", "Time of one proposal (drafting "
                                         "a round's tree)", ["drafter"], buckets=PROPOSE_SECONDS_BUCKETS,
                                         registry=r)
        self.requests_held = Gauge("specserve_drafter_requests_held", "Requests whose drafting state the pool "
                                   "holds", registry=r)

    def watch(self, requests_held: Callable[[], float]) -> None:
        """Read the gauge from the pool when scraped."""
        self.requests_held.set_function(requests_held)

    def observe_propose(self, kind: str, seconds: float) -> None:
        self.propose_seconds.labels(kind).observe(seconds)
