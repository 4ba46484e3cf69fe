"""Prometheus metrics of every service, without Ray: a drafter pool and a verifier on
loopback gRPC (tiny models), the coordinator in process, and the router's metrics
fed as the servicer feeds them. Then the HTTP ingress's side (deploy/metrics.py):
services' registries served over HTTP as the hosts serve them, fetched, labelled
with their service and instance, and merged into one exposition text that parses."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.actors import serve_metrics
from deploy.metrics import ServiceScraper, merge
from drafter_service.metrics import DrafterMetrics
from drafter_service.pool import DrafterPool
from loopback import loopback
from router.coordinator import Job
from router.metrics import RouterMetrics
from router.stats import RoundStats
from speculative.sampling import SamplingParams
from tiny import TINY, tiny_model
from verifier_service.engine import VerifierEngine
from verifier_service.metrics import VerifierMetrics

PROMPTS = [[1, 2, 3, 1, 2], [5, 6, 7, 5], [0, 3, 3, 3, 3]]
DRAFTERS = (("layerskip", 0.7), ("pld", 0.6))
FUSED = "layerskip+pld"
# the services' names on deploy/grafana.json (tests/test_deploy_manifests.py holds the whole list)
ROUTER_NAMES = {"spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                "spec_decode_num_accepted_tokens_per_pos", "specserve_requests", "specserve_generated_tokens"}
VERIFIER_NAMES = {"specserve_verifier_batch_size", "specserve_verifier_pass_seconds",
                  "specserve_verifier_pass_tokens", "specserve_verifier_queue_depth", "specserve_verifier_rows_held"}
DRAFTER_NAMES = {"specserve_drafter_propose_seconds", "specserve_drafter_requests_held"}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def per_position(registry: CollectorRegistry, drafter: str, domain: str) -> dict[int, float]:
    return {int(s.labels["position"]): s.value
            for f in registry.collect() if f.name == "spec_decode_num_accepted_tokens_per_pos"
            for s in f.samples if s.name.endswith("_total")
            and s.labels["drafter"] == drafter and s.labels["domain"] == domain}


@pytest.fixture(scope="module")
def served():
    """Three greedy requests with fused drafters through a pool and a verifier of their own:
    (stats of each request, pool, engine)."""
    torch.set_num_threads(1)
    target = tiny_model(0, logit_scale=2.0)
    pool = DrafterPool(target, kinds=["layerskip", "pld"])
    engine = VerifierEngine(target, max_batch=4, max_len=64)
    runs = []
    with loopback(pool, engine) as coordinator:
        for i, prompt in enumerate(PROMPTS):
            job = Job(request_id=f"m{i}", prompt_ids=prompt, params=SamplingParams(max_tokens=20),
                      drafters=DRAFTERS, draft_length=3, tree_budget=6, vocab_size=TINY.vocab_size,
                      eos_token_ids=())
            stats = RoundStats()
            tokens = [t for new in coordinator.run(job, stats) for t in new]
            runs.append((stats, len(tokens)))
    return runs, pool, engine


def test_round_stats_keep_each_drafted_rounds_accepted_length():
    stats = RoundStats()
    for drafted, accepted in [(3, 2), (3, 0), (0, 0), (4, 3)]:  # the third sent no draft
        stats.record_round(drafted, accepted, batch_size=1)
    assert stats.accepted_lengths == [2, 0, 3]
    metrics = RouterMetrics()
    metrics.observe(stats, "pld", 9)  # no domain known: ""
    value = metrics.registry.get_sample_value
    labels = {"drafter": "pld", "domain": ""}
    assert value("spec_decode_num_drafts_total", labels) == 3
    assert value("spec_decode_num_draft_tokens_total", labels) == 10
    assert value("spec_decode_num_accepted_tokens_total", labels) == 5
    # rounds reaching depth 1, 2, 3 of the accepted path
    assert per_position(metrics.registry, "pld", "") == {0: 2, 1: 2, 2: 1}


def test_router_counts_speculation_under_vllms_names(served):
    runs, _, _ = served
    metrics = RouterMetrics()
    for stats, count in runs:
        metrics.observe(stats, FUSED, count, "code")
    value = metrics.registry.get_sample_value
    labels = {"drafter": FUSED, "domain": "code"}
    drafts = sum(len(s.accepted_lengths) for s, _ in runs)
    accepted = sum(s.accepted_draft_tokens for s, _ in runs)
    assert drafts > 0 and accepted > 0, "the drafters' tokens were never accepted: nothing was checked"
    assert value("spec_decode_num_drafts_total", labels) == drafts
    assert value("spec_decode_num_draft_tokens_total", labels) == sum(s.draft_tokens for s, _ in runs)
    assert value("spec_decode_num_accepted_tokens_total", labels) == accepted
    pos = per_position(metrics.registry, FUSED, "code")
    assert sum(pos.values()) == accepted  # each accepted token is one round reaching its depth
    assert [pos[p] for p in sorted(pos)] == sorted(pos.values(), reverse=True)  # deeper: fewer rounds
    assert pos[0] <= drafts
    assert value("specserve_requests_total", {"drafter": FUSED}) == len(runs)
    assert value("specserve_generated_tokens_total") == sum(c for _, c in runs)
    assert ROUTER_NAMES <= set(families(generate_latest(metrics.registry).decode()))


def test_verifier_records_its_passes(served):
    _, _, engine = served
    value = engine.metrics.registry.get_sample_value
    histogram = engine.stats()["batch_size_histogram"]
    passes = sum(histogram.values())
    assert passes > 0
    assert value("specserve_verifier_batch_size_count") == passes
    assert value("specserve_verifier_batch_size_sum") == sum(size * n for size, n in histogram.items())
    assert value("specserve_verifier_pass_seconds_count") == passes
    assert value("specserve_verifier_pass_seconds_sum") > 0
    # every row scores its root; drafted rounds score their trees' nodes too
    rows = value("specserve_verifier_batch_size_sum")
    assert value("specserve_verifier_pass_tokens_total") > rows
    assert value("specserve_verifier_rows_held") == 0  # every request released
    assert value("specserve_verifier_queue_depth") == 0
    assert VERIFIER_NAMES <= set(families(generate_latest(engine.metrics.registry).decode()))


def test_verifier_gauges_follow_rows_held():
    engine = VerifierEngine(tiny_model(0), max_batch=2, max_len=32, metrics=VerifierMetrics())
    try:
        engine.prefill("a", [1, 2, 3], SamplingParams(max_tokens=4))
        assert engine.metrics.registry.get_sample_value("specserve_verifier_rows_held") == 1
        engine.release("a")
        assert engine.metrics.registry.get_sample_value("specserve_verifier_rows_held") == 0
    finally:
        engine.close()


def test_drafter_pool_records_proposals_by_kind(served):
    _, pool, _ = served
    value = pool.metrics.registry.get_sample_value
    for kind, _ in DRAFTERS:
        assert value("specserve_drafter_propose_seconds_count", {"drafter": kind}) > 0, kind
    assert value("specserve_drafter_requests_held") == pool.active_requests() == 0
    assert DRAFTER_NAMES <= set(families(generate_latest(pool.metrics.registry).decode()))


def test_drafter_requests_held_follows_the_pool():
    registry = CollectorRegistry()
    pool = DrafterPool(tiny_model(0), kinds=["pld"], metrics=DrafterMetrics(registry))
    pool.prefill("a", "pld", [1, 2, 3, 1, 2], SamplingParams(max_tokens=4))
    pool.prefill("b", "pld", [1, 2, 3], SamplingParams(max_tokens=4))
    assert registry.get_sample_value("specserve_drafter_requests_held") == 2
    assert pool.propose("a", 5, [], 3) is not None
    assert registry.get_sample_value("specserve_drafter_propose_seconds_count", {"drafter": "pld"}) == 1
    pool.release("a")
    assert registry.get_sample_value("specserve_drafter_requests_held") == 1


def _verifier_text(batch_sizes) -> str:
    metrics = VerifierMetrics()
    for size in batch_sizes:
        metrics.observe_pass(size, 0.01)
    return generate_latest(metrics.registry).decode()


def test_merge_keeps_one_family_per_name_and_labels_each_service():
    router = RouterMetrics()
    stats = RoundStats()
    stats.record_round(3, 2, 1)
    router.observe(stats, "pld", 3, "math")
    clash = CollectorRegistry()  # a service's own `service` label is kept as exported_service
    Counter("specserve_things", "Things", ["service"], registry=clash).labels("mine").inc()
    text = merge([({"service": "verifier", "instance": "verifier-a"}, _verifier_text([1, 2])),
                  ({"service": "verifier", "instance": "verifier-b"}, _verifier_text([4])),
                  ({"service": "router", "instance": "router-a"}, generate_latest(router.registry).decode()),
                  ({"service": "drafter", "instance": "drafter-a"}, "not { exposition text"),  # left out
                  ({"service": "drafter", "instance": "drafter-b"}, generate_latest(clash).decode())])
    assert text.count("# TYPE specserve_verifier_batch_size histogram") == 1
    assert text.count("# HELP specserve_verifier_batch_size ") == 1
    parsed = families(text)  # valid exposition text
    batch = parsed["specserve_verifier_batch_size"]
    counts = {s.labels["instance"]: s.value for s in batch.samples if s.name.endswith("_count")}
    assert counts == {"verifier-a": 2, "verifier-b": 1}
    assert all(s.labels["service"] == "verifier" for s in batch.samples)
    drafts = [s for s in parsed["spec_decode_num_drafts"].samples if s.name.endswith("_total")]
    assert [(s.labels, s.value) for s in drafts] == [
        ({"drafter": "pld", "domain": "math", "service": "router", "instance": "router-a"}, 1.0)]
    things = [s for s in parsed["specserve_things"].samples if s.name.endswith("_total")]
    assert things[0].labels == {"exported_service": "mine", "service": "drafter", "instance": "drafter-b"}


def test_ingress_gathers_every_registered_services_metrics():
    """Each service serves its registry as the hosts do (cluster/actors.py); the ingress's
    scraper fetches them, skips one that does not answer and counts it."""
    verifier, drafter = VerifierMetrics(), DrafterMetrics()
    verifier.observe_pass(3, 0.02)
    drafter.observe_propose("pld", 0.001)
    drafter.watch(lambda: 5)
    own = CollectorRegistry()
    Counter("specserve_http_requests", "HTTP API requests", ["route", "status"], registry=own).labels(
        "/v1/completions", "200").inc()
    stops = []
    try:
        v_address, stop = serve_metrics(verifier.registry, "127.0.0.1", "127.0.0.1")
        stops.append(stop)
        d_address, stop = serve_metrics(drafter.registry, "127.0.0.1", "127.0.0.1")
        stops.append(stop)
        gone, stop = serve_metrics(CollectorRegistry(), "127.0.0.1", "127.0.0.1")
        stop()  # a service gone since it registered: its port refuses
        scraper = ServiceScraper(timeout_s=1.0)
        targets = [("verifier", "verifier-1", v_address), ("drafter", "drafter-1", d_address),
                   ("drafter", "drafter-2", gone)]
        text = asyncio.run(scraper.exposition([own], targets))
    finally:
        for stop in stops:
            stop()
    parsed = families(text)
    # the ingress's own metrics as before: unlabelled
    assert 'specserve_http_requests_total{route="/v1/completions",status="200"} 1.0' in text
    passes = [(s.labels, s.value) for s in parsed["specserve_verifier_pass_seconds"].samples
              if s.name.endswith("_count")]
    assert passes == [({"service": "verifier", "instance": "verifier-1"}, 1.0)]
    held = [(s.labels, s.value) for s in parsed["specserve_drafter_requests_held"].samples]
    assert held == [({"service": "drafter", "instance": "drafter-1"}, 5.0)]
    proposals = [s.labels for s in parsed["specserve_drafter_propose_seconds"].samples if s.name.endswith("_count")]
    assert proposals == [{"drafter": "pld", "service": "drafter", "instance": "drafter-1"}]
    errors = {s.labels["service"]: s.value for s in parsed["specserve_metrics_scrape_errors"].samples
              if s.name.endswith("_total")}
    assert errors == {"drafter": 1}
