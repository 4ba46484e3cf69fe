"""Prometheus metrics of the router: how requests went, and how busy each side was.

Idle fractions are what batch scheduling and pipelining are judged by: the
share of the requests' wall time the drafters, and the verifier, were not
working on them. The counters give them over any window (PromQL:
1 - rate(specserve_busy_seconds_total[5m]) / rate(specserve_request_seconds_total[5m]));
the gauges give them since the router started.

The speculation counters also go by vLLM's names (`spec_decode_num_drafts`, ...),
so dashboards made for vLLM work on specserve: labelled by the request's drafter
(fused ones joined with "+") and its domain ("" when the router knows none).
`spec_decode_num_accepted_tokens_per_pos{position=p}` counts the rounds whose
accepted path reached depth p + 1 (0-based p), so its sum over positions is
`spec_decode_num_accepted_tokens`.

`specserve_route_speedup{route, domain}`: each completed request's estimated speedup over
plain decoding (router.goodput), by the route that served it: what "auto" routing ranks by.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .adaptive import PassCostModel
from .stats import RoundStats


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("specserve_requests", "Finished requests", ["drafter"], registry=r)
        self.tokens = Counter("specserve_generated_tokens", "Generated tokens", registry=r)
        self.passes = Counter("specserve_target_passes", "Target forward passes (rounds)", registry=r)
        self.drafted = Counter("specserve_draft_tokens", "Draft tree nodes sent to the verifier", registry=r)
        self.accepted = Counter("specserve_accepted_draft_tokens", "Draft tokens the verifier accepted", registry=r)
        self.reused = Counter("specserve_reused_drafts", "Rounds whose tree was drafted ahead (pipelining)",
                              registry=r)
        self.wall = Counter("specserve_request_seconds", "Wall time of requests", registry=r)
        self.busy = Counter("specserve_busy_seconds", "Time a side worked on requests", ["side"], registry=r)
        spec = ["drafter", "domain"]  # vLLM's speculation counters, by its names
        self.spec_drafts = Counter("spec_decode_num_drafts", "Rounds that sent a draft to the verifier", spec,
                                   registry=r)
        self.spec_draft_tokens = Counter("spec_decode_num_draft_tokens", "Draft tokens (tree nodes) verified",
                                         spec, registry=r)
        self.spec_accepted = Counter("spec_decode_num_accepted_tokens", "Draft tokens the verifier accepted",
                                     spec, registry=r)
        self.spec_accepted_per_pos = Counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Rounds whose accepted path reached this 0-based depth (position + 1 tokens or more accepted)",
            spec + ["position"], registry=r)
        self.speedup = Histogram("specserve_route_speedup", "A request's estimated speedup over plain decoding "
                                 "(router.goodput), by its route", ["route", "domain"], registry=r,
                                 buckets=(0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0))
        self.idle = Gauge("specserve_idle_fraction", "Share of request wall time a side was idle, since start",
                          ["side"], registry=r)
        self._lock = threading.Lock()
        self._wall = 0.0
        self._busy = {"drafter": 0.0, "verifier": 0.0}
        for side in self._busy:
            self.idle.labels(side).set_function(lambda side=side: self.idle_fraction(side))

    def watch_pass_costs(self, model: PassCostModel) -> None:
        """Export the verify costs adaptive lengths use, as learned (`router.adaptive.PassCostModel`)."""
        gauge = Gauge("specserve_verify_cost", "Cost of one more row, token or padded slot in a verification "
                      "pass, as a share of a one-row, one-token pass (learned)", ["term"], registry=self.registry)
        for i, term in enumerate(("row", "token", "pad")):
            gauge.labels(term).set_function(lambda i=i: model.costs()[i])
        Gauge("specserve_verify_cost_passes", "Verification passes the verify costs were learned from",
              registry=self.registry).set_function(lambda: model.passes)

    def observe(self, stats: RoundStats, drafter: str, tokens: int, domain: str | None = None) -> None:
        wall, busy = stats.wall_seconds(), stats.busy_by_side()  # a stop string ends a request early
        self.requests.labels(drafter).inc()
        spec = (drafter, domain or "")
        self.spec_drafts.labels(*spec).inc(len(stats.accepted_lengths))
        self.spec_draft_tokens.labels(*spec).inc(stats.draft_tokens)
        self.spec_accepted.labels(*spec).inc(stats.accepted_draft_tokens)
        for position in range(max(stats.accepted_lengths, default=0)):
            self.spec_accepted_per_pos.labels(*spec, str(position)).inc(
                sum(length > position for length in stats.accepted_lengths))
        self.tokens.inc(tokens)
        self.passes.inc(stats.target_forward_passes)
        self.drafted.inc(stats.draft_tokens)
        self.accepted.inc(stats.accepted_draft_tokens)
        self.reused.inc(stats.reused_drafts)
        self.wall.inc(wall)
        for side, seconds in busy.items():
            self.busy.labels(side).inc(seconds)
        with self._lock:
            self._wall += wall
            for side, seconds in busy.items():
                self._busy[side] += seconds

    def observe_speedup(self, route: str, domain: str, speedup: float) -> None:
        self.speedup.labels(route, domain).observe(speedup)

    def idle_fraction(self, side: str) -> float:
        with self._lock:
            return max(0.0, 1.0 - self._busy[side] / self._wall) if self._wall else 0.0
