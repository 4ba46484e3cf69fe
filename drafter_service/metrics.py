"""Prometheus metrics of a drafter pool: how long proposals take, by drafter kind, and
how many requests the pool holds.

The pool records into a `DrafterMetrics` (each its own registry); the host that serves
the pool exposes the registry over HTTP (cluster/actors.py), and the HTTP ingress's
/metrics gathers it with every other service's.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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


class LearnerMetrics:
    """The online learner's metrics (drafter_service/learner.py), in the pool's registry
    when it hosts one: its steps and loss, the versions it published and those it held
    back, its buffer, each domain's held-aside agreement with the target under the
    published drafter ("published") and the last candidate ("candidate"), and the rounds
    served and tokens accepted by each drafter version, per domain: acceptance before and
    after each swap."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.enabled = Gauge("specserve_learner_enabled", "Whether the online learner runs", registry=r)
        self.steps = Counter("specserve_learner_steps", "Distillation steps taken", ["drafter"], registry=r)
        self.loss = Gauge("specserve_learner_loss", "Loss of the last step (forward KL up to a constant)",
                          ["drafter"], registry=r)
        self.version = Gauge("specserve_learner_published_version", "Latest published version (0: shipped)",
                             ["drafter"], registry=r)
        self.rejected = Counter("specserve_learner_rejected", "Checkpoints not published: no better on the "
                                "held-aside slice", ["drafter"], registry=r)
        self.buffer_tokens = Gauge("specserve_learner_buffer_tokens", "Tokens buffered",
                                   ["drafter", "domain"], registry=r)
        self.agreement = Gauge("specserve_learner_heldout_agreement", "Top-1 agreement with the target on "
                               "the held-aside slice", ["drafter", "domain", "model"], registry=r)
        self.rounds = Counter("specserve_drafter_online_rounds", "Rounds drafted by a learning drafter",
                              ["drafter", "domain", "version"], registry=r)
        self.accepted = Counter("specserve_drafter_online_accepted", "Draft tokens accepted from a learning "
                                "drafter", ["drafter", "domain", "version"], registry=r)
