"""Prometheus metrics of a verifier: how full its passes are and how long they take.

The engine records into a `VerifierMetrics` (each its own registry); the host that
serves the engine exposes the registry over HTTP (cluster/actors.py), and the HTTP
ingress's /metrics gathers it with every other service's.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PASS_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class VerifierMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.batch_size = Histogram("specserve_verifier_batch_size", "Requests (rows) verified per forward pass",
                                    buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.pass_seconds = Histogram("specserve_verifier_pass_seconds", "Time of one verification forward pass",
                                      buckets=PASS_SECONDS_BUCKETS, registry=r)
        # tokens scored by the passes (each row's root and its tree's nodes): with the rows and the
        # seconds, what a pass costs by its width (scripts/validate_simulator.py fits it)
        self.pass_tokens = Counter("specserve_verifier_pass_tokens", "Tokens scored by verification passes "
                                   "(each row's root and its draft tree's nodes)", registry=r)
        self.queue_depth = Gauge("specserve_verifier_queue_depth", "Work items (prefills, verifications, "
                                 "releases) queued for the engine", registry=r)
        self.rows_held = Gauge("specserve_verifier_rows_held", "Requests the verifier holds (each its KV cache "
                               "blocks; preempted ones included)", registry=r)
        # the paged KV cache, named as vLLM names its metrics (vllm:kv_cache_usage_perc, ...)
        self.kv_cache_usage = Gauge("specserve_verifier_kv_cache_usage_perc", "Share of the KV cache's blocks "
                                    "held by requests (0-1; cached blocks no request holds count as free)",
                                    registry=r)
        self.prefix_cache_queries = Counter("specserve_verifier_prefix_cache_queries", "Tokens looked up in the "
                                            "prefix cache (every prompt, resumed and preempted request's)",
                                            registry=r)
        self.prefix_cache_hits = Counter("specserve_verifier_prefix_cache_hits", "Tokens the prefix cache held "
                                         "of those looked up (not computed again)", registry=r)
        self.num_preemptions = Counter("specserve_verifier_num_preemptions", "Requests preempted for lack of "
                                       "KV cache blocks (computed again when there was room)", registry=r)

    def watch(self, queue_depth: Callable[[], float], rows_held: Callable[[], float],
              kv_cache_usage: Callable[[], float] | None = None) -> None:
        """Read the gauges from the engine when scraped."""
        self.queue_depth.set_function(queue_depth)
        self.rows_held.set_function(rows_held)
        if kv_cache_usage is not None:
            self.kv_cache_usage.set_function(kv_cache_usage)

    def observe_pass(self, batch_size: int, seconds: float, tokens: int | None = None) -> None:
        """A pass over `batch_size` rows scoring `tokens` tokens (None: one a row)."""
        self.batch_size.observe(batch_size)
        self.pass_seconds.observe(seconds)
        self.pass_tokens.inc(batch_size if tokens is None else tokens)
