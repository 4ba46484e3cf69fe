"""Goodput routing through a real router, verifier and pool on loopback (a tiny target):
what a served request records for its route, and that plain decoding measures at most 1."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest

from cluster.state import EmbeddedStateStore
from drafter_service.pool import DrafterPool
from loopback import loopback
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from router.adaptive import PassCostModel
from router.expertise import ExpertiseRouter
from router.goodput import route_name
from router.servicer import RouterConfig, RouterServicer
from router.servicer import serve as serve_router
from tiny import TINY, DigitTokenizer, tiny_model
from verifier_service.engine import VerifierEngine


@pytest.fixture(scope="module")
def served():
    """(stub, store, servicer) of a router routing "auto" among plain decoding, prompt lookup,
    the suffix drafter, the recycling drafter and their fusions."""
    target = tiny_model(0)
    kinds = ("pld", "suffix", "recycle")
    pool, engine = DrafterPool(target, kinds=list(kinds)), VerifierEngine(target, max_batch=4, max_len=64)
    config = RouterConfig(context_length=TINY.max_position_embeddings - 12, eos_token_ids=[],
                          vocab_size=TINY.vocab_size, default_drafter="auto", routed_drafters=kinds,
                          fused_drafters=2, draft_length=3, adaptive=True, verifier_drafting=True)
    store = EmbeddedStateStore()
    expertise = ExpertiseRouter(store, refresh_s=0, rng=np.random.default_rng(0))
    with loopback(pool, engine, pass_costs=PassCostModel()) as coordinator:
        servicer = RouterServicer(DigitTokenizer(), coordinator, config, expertise)
        router, port = serve_router(servicer, "127.0.0.1", 0)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            yield pb_grpc.SpecserveStub(channel), store, servicer
        finally:
            channel.close()
            router.stop(None)


def generate(stub, drafter: str = "", max_tokens: int = 12, namespace: str = "", prompt: str = "12312312"):
    return stub.Generate(pb.GenerateRequest(prompt=prompt, drafter=drafter, domain_hint="coding",
                                            namespace=namespace, sampling=pb.SamplingParams(max_tokens=max_tokens)),
                         timeout=60)


def test_plain_decoding_measures_at_most_plain_speed(served):
    """A plainly decoded request, one at a time: every token took a pass and more, so its
    estimated speedup over plain decoding is positive and at most 1."""
    stub, store, servicer = served
    for i in range(3):
        assert generate(stub, "none", namespace="plain", prompt=f"1231{i}").usage.drafter == "none"
    servicer.close()  # writes every namespace's outcomes
    [(key, g)] = store.goodput_stats(namespace="plain").items()
    assert key == ("none", "coding") and g.requests == 3
    assert g.log_sum <= 1e-9 and np.isfinite(g.log_sum)
    metrics = generate_latest(servicer.metrics.registry).decode()
    assert 'specserve_route_speedup_count{domain="coding",route="none"} 3.0' in metrics


def test_every_completed_request_records_its_route_once(served):
    """"auto" requests: each records its speedup under the route it was served by (the one
    `usage.drafter` names), pinned ones under theirs; one too short to tell records nothing."""
    stub, store, servicer = served
    routes = [generate(stub, namespace="auto", prompt=f"3123{i}").usage.drafter for i in range(6)]
    routes.append(generate(stub, "pld+recycle", namespace="auto").usage.drafter)
    generate(stub, "pld", max_tokens=2, namespace="auto")  # 1 token after the first: too short
    servicer.close()
    recorded = {route: g.requests for (route, domain), g in store.goodput_stats(namespace="auto").items()}
    expected: dict[str, int] = {}
    for r in routes:
        name = route_name(r.split("+"))
        expected[name] = expected.get(name, 0) + 1
    assert recorded == expected


def test_a_routed_request_teaches_the_suffix_index_whatever_drafted_it(served):
    """A routed request served by prompt lookup still feeds the verifier's suffix index of its
    namespace, so a later request there drafted by the suffix drafter drafts the remembered
    answer: the suffix route is judged with the memory it would have had serving them all."""
    stub, store, _ = served
    x = np.log(3.0)
    store.record_goodput("pld", "coding", 30, 30 * x, 30 * x * x, namespace="memory")  # prompt lookup is fastest
    prompt = "3213213"
    assert generate(stub, namespace="memory", prompt=prompt, max_tokens=16).usage.drafter == "pld"
    fresh = generate(stub, "suffix", namespace="fresh", prompt=prompt, max_tokens=16)
    remembered = generate(stub, "suffix", namespace="memory", prompt=prompt, max_tokens=16)
    assert list(remembered.token_ids) == list(fresh.token_ids)
    assert remembered.usage.target_forward_passes < fresh.usage.target_forward_passes
