"""The pipelined coordinator across processes' worth of gRPC, without Ray: a
drafter pool and a verifier on loopback, the coordinator in process, tiny models.

Greedy output equals the target's own decoding; sampled output equals the
single-process pipelined loop (whose exact distribution
test_sampling_distribution.py checks); and the trace shows each round's next
draft being made while the round is verified.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from prometheus_client import generate_latest

from drafter_service.pool import DrafterPool
from drafter_service import registry
from drafter_service.registry import make_drafter
from loopback import loopback
from router.adaptive import SpeculationControl
from router.coordinator import Coordinator, Job
from router.metrics import RouterMetrics
from router.stats import RoundStats
from speculative.decoding import generate
from speculative.sampling import SamplingParams
from tiny import TINY, tiny_model
from verifier_service.engine import VerifierEngine

V = TINY.vocab_size
PROMPTS = [[1, 2, 3, 1, 2], [5, 6, 7, 5], [0, 3, 3, 3, 3]]
DRAFT_LENGTH, MAX_TOKENS = 3, 24
TREE_BUDGET = 6  # two chains: a sampled model drafter draws a two-branch tree


class SlowPool(DrafterPool):
    """Drafting that takes `delay` seconds a call, and a prefill `prefill_delay`, as a real
    drafter network's would; it notes every prefill, and when each began and ended."""
    delay = prefill_delay = 0.0
    fail_prefill = False  # every prefill fails, as a pool that breaks would

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefilled: list[tuple[str, str, int]] = []  # (request, drafter, tokens)
        self.prefill_times: dict[str, tuple[float, float]] = {}  # request -> (start, end), time.monotonic()
        self.prefill_began = threading.Event()  # set as each prefill begins

    def prefill(self, request_id, kind, token_ids, *args, **kwargs):
        start = time.monotonic()
        self.prefilled.append((request_id, kind, len(token_ids)))
        self.prefill_began.set()
        time.sleep(self.prefill_delay)
        if self.fail_prefill:
            raise RuntimeError("the pool broke")
        try:
            return super().prefill(request_id, kind, token_ids, *args, **kwargs)
        finally:
            self.prefill_times[request_id] = (start, time.monotonic())

    def propose(self, *args, **kwargs):
        time.sleep(self.delay)
        return super().propose(*args, **kwargs)


class SlowEngine(VerifierEngine):
    """A target pass that takes `delay` seconds more, as a large target's would (the pass
    time the verifier reports includes it), and a prefill `prefill_delay` more; a prefill
    answers only once `gate` (when set) is, as a long prompt's would after a pool's began."""
    delay = prefill_delay = 0.0
    gate: threading.Event | None = None

    def _pass(self, view, items):
        time.sleep(self.delay)
        return super()._pass(view, items)

    def _prefill(self, work):
        time.sleep(self.prefill_delay)
        if self.gate is not None:
            assert self.gate.wait(30), "the gate never opened"
        return super()._prefill(work)


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_model(0, logit_scale=2.0)


@pytest.fixture(scope="module")
def services(target):
    # the pool's model is the target itself: its layer-skip drafter (both layers) always
    # drafts the target's own greedy tokens, so drafts made ahead are often kept
    pool = SlowPool(target, kinds=["layerskip", "pld", "suffix"])
    engine = SlowEngine(target, max_batch=4, max_len=64)
    with loopback(pool, engine) as coordinator:
        yield coordinator, pool, engine


def job(rid: str, prompt: list[int], params: SamplingParams, drafters, pipelined: bool = True,
        adaptive: bool = False) -> Job:
    return Job(request_id=rid, prompt_ids=prompt, params=params, drafters=drafters, draft_length=DRAFT_LENGTH,
               tree_budget=TREE_BUDGET, vocab_size=V, eos_token_ids=(), pipelined=pipelined,
               speculation=SpeculationControl(DRAFT_LENGTH) if adaptive else None,
               service_id=rid)  # the services' records are found by it


def served(coordinator: Coordinator, j: Job) -> tuple[list[int], RoundStats]:
    stats = RoundStats()
    return [t for new in coordinator.run(j, stats) for t in new], stats


@pytest.mark.parametrize("drafters", [(("layerskip", 1.0),), (("layerskip", 0.7), ("pld", 0.6), ("suffix", 0.5))],
                         ids=["single", "fused"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_pipelined_greedy_equals_the_targets_own_decoding(target, services, drafters, adaptive):
    coordinator, pool, engine = services
    reused = 0
    # adaptive lengths weigh drafting against the target's pass: make it a real model's, not
    # the tiny one's fraction of a call's round trip
    engine.delay = 0.01 if adaptive else 0.0
    try:
        for i, prompt in enumerate(PROMPTS):
            params = SamplingParams(max_tokens=MAX_TOKENS)
            rid = f"g{len(drafters)}{adaptive}-{i}"
            tokens, stats = served(coordinator, job(rid, prompt, params, drafters, adaptive=adaptive))
            assert tokens == generate(target, prompt, params).token_ids, prompt
            reused += stats.reused_drafts
    finally:
        engine.delay = 0.0
    assert reused > 0, "no round used a draft made ahead: pipelining was not exercised"
    assert pool.active_requests() == 0 and engine.stats()["active_requests"] == 0


@pytest.mark.parametrize("seed", [1, 2])
def test_pipelined_sampling_equals_the_single_process_pipelined_loop(target, services, seed):
    coordinator, _, _ = services
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=6, seed=seed)
    tokens, stats = served(coordinator, job(f"s{seed}", PROMPTS[0], params, (("layerskip", 1.0),)))
    local = make_drafter("layerskip", target, draft_top_k=32)
    want = generate(target, PROMPTS[0], params, local, DRAFT_LENGTH, pipelined=True, tree_budget=TREE_BUDGET)
    assert tokens == want.token_ids
    assert stats.reused_drafts == want.reused_drafts > 0


def idle_fractions(stats: RoundStats) -> dict[str, float]:
    """Each side's share of one request's wall time it was not working on it, as the
    router's metrics export it."""
    metrics = RouterMetrics()
    metrics.observe(stats, "layerskip", 0)
    return {side: metrics.idle_fraction(side) for side in ("drafter", "verifier")}


def test_drafting_the_next_round_overlaps_verifying_this_one(target, services):
    """Drafting and verifying each take 50 ms a call. Pipelined, a round's draft-ahead
    span lies inside its verify span; sequential, no spans overlap and a round costs both."""
    coordinator, pool, engine = services
    pool.delay = engine.delay = 0.05
    try:
        params = SamplingParams(max_tokens=16)
        _, piped = served(coordinator, job("p", PROMPTS[2], params, (("layerskip", 1.0),)))
        _, seq = served(coordinator, job("q", PROMPTS[2], params, (("layerskip", 1.0),), pipelined=False))
    finally:
        pool.delay = engine.delay = 0.0

    verify = {s.round: s for s in piped.trace if s.what == "verify"}
    ahead = [s for s in piped.trace if s.what == "ahead"]
    assert len(ahead) >= 2
    for a in ahead:
        v = verify[a.round]
        overlap = min(a.end, v.end) - max(a.start, v.start)
        assert overlap > 0.03, f"round {a.round}: drafting ahead overlapped verification by {overlap:.3f}s"
    # pipelined, the sides work at the same time: their busy shares add up to more than the wall time
    idle = idle_fractions(piped)
    assert idle["drafter"] + idle["verifier"] < 1.0, idle

    spans = sorted((s for s in seq.trace if s.what != "prefill"), key=lambda s: s.start)
    assert all(b.start >= a.end for a, b in zip(spans, spans[1:])), "sequential rounds overlapped"
    assert not any(s.what == "ahead" for s in seq.trace)
    seq_idle = idle_fractions(seq)
    assert seq_idle["drafter"] + seq_idle["verifier"] >= 0.99 - 1e-3, seq_idle


@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
def test_pools_prefill_while_the_verifier_does_when_told(target, services, pipelined):
    """Prefills of 200 ms on each side. With `prefill_pools_ahead` the pool's prefill runs
    during the verifier's, and the output is the target's own; without, the pool is
    prefilled only once the verifier's prefill has answered."""
    coordinator, pool, engine = services
    pool.prefill_delay = engine.prefill_delay = 0.2
    params = SamplingParams(max_tokens=8)
    try:
        for ahead in (True, False):
            rid = f"ahead-{pipelined}-{ahead}"
            tokens, stats = served(coordinator, dataclasses.replace(
                job(rid, PROMPTS[1], params, (("layerskip", 1.0),), pipelined=pipelined), prefill_pools_ahead=ahead))
            assert tokens == generate(target, PROMPTS[1], params).token_ids
            verifier = next(s for s in stats.trace if s.what == "prefill")
            pool_start, pool_end = pool.prefill_times[rid]
            if ahead:
                assert pool_start < verifier.start + 0.1 and pool_end < verifier.end + 0.1, "the prefills did not overlap"
            else:
                assert pool_start >= verifier.end
    finally:
        pool.prefill_delay = engine.prefill_delay = 0.0
    assert pool.active_requests() == 0 and engine.stats()["active_requests"] == 0


def test_a_request_that_ends_before_its_pool_is_prefilled_leaves_nothing_there(target, services):
    """One token: the request ends at the verifier's prefill, while the pool's prefill sent
    ahead is still running; its release waits for that prefill and frees it. (The verifier
    answers only once the pool's prefill has begun: on a loaded machine the thread sending it
    could otherwise start after the request ended, and a prefill not started is dropped.)"""
    coordinator, pool, engine = services
    pool.prefill_delay = 0.3
    pool.prefill_began.clear()
    engine.gate = pool.prefill_began
    try:
        tokens, _ = served(coordinator, dataclasses.replace(
            job("one-ahead", PROMPTS[0], SamplingParams(max_tokens=1), (("layerskip", 1.0),), pipelined=False),
            prefill_pools_ahead=True))
    finally:
        pool.prefill_delay, engine.gate = 0.0, None
    assert tokens == generate(target, PROMPTS[0], SamplingParams(max_tokens=1)).token_ids
    assert "one-ahead" in pool.prefill_times, "the pool was not prefilled ahead"
    assert pool.active_requests() == 0


def test_a_pool_that_fails_its_prefill_ahead_leaves_the_request_to_plain_decoding(target, services):
    coordinator, pool, _ = services
    params = SamplingParams(max_tokens=8)
    pool.fail_prefill = True
    try:
        tokens, stats = served(coordinator, dataclasses.replace(
            job("fail-ahead", PROMPTS[2], params, (("layerskip", 1.0),), pipelined=False), prefill_pools_ahead=True))
    finally:
        pool.fail_prefill = False
    assert tokens == generate(target, PROMPTS[2], params).token_ids
    assert [rid for rid, _, _ in pool.prefilled].count("fail-ahead") == 1, "the failed pool was tried again"
    assert stats.draft_tokens == 0 and pool.active_requests() == 0


def test_router_metrics_export_each_sides_idle_fraction(target, services):
    coordinator, _, _ = services
    metrics = RouterMetrics()
    _, stats = served(coordinator, job("m", PROMPTS[1], SamplingParams(max_tokens=12), (("layerskip", 1.0),)))
    metrics.observe(stats, "layerskip", 12)
    text = generate_latest(metrics.registry).decode()
    for side in ("drafter", "verifier"):
        assert f'specserve_idle_fraction{{side="{side}"}}' in text
        assert 0.0 <= metrics.idle_fraction(side) < 1.0
    assert "specserve_reused_drafts_total" in text and "specserve_busy_seconds_total" in text


def test_a_busy_verifier_gets_no_speculation_from_the_first_round(services):
    """Goodput under load: a verifier that holds other requests makes every extra token of a
    pass cost more, so a request arriving then drafts nothing, not even in its first round
    (its load is known from the verifier's prefill answer, before any verdict)."""
    coordinator, _, engine = services
    params = SamplingParams(max_tokens=16)

    def first_lengths() -> list[int]:
        control = SpeculationControl(DRAFT_LENGTH, prior=0.9, verify_token_cost=0.5, verify_pad_cost=0.1)
        _, stats = served(coordinator, dataclasses.replace(
            job("busy", PROMPTS[0], params, (("layerskip", 1.0),), pipelined=False), speculation=control,
            tree_budget=DRAFT_LENGTH))  # chains: the width of trees costs more, as tested in test_adaptive
        return stats.draft_lengths[:2]

    # idle: the first round drafts (the second may not: it also weighs the drafter's measured
    # time, which on a loaded test machine can be as slow as a tiny target's pass)
    assert first_lengths()[0] > 0, "an idle verifier: the request drafts"
    others = [f"other-{i}" for i in range(3)]
    for rid in others:
        engine.prefill(rid, PROMPTS[1], params)
    try:
        assert first_lengths() == [0, 0]
    finally:
        for rid in others:
            engine.release(rid)



def test_a_drafter_with_nothing_to_draft_is_not_called_but_the_suffix_index_learns_the_output(target, services):
    """Fused, a drafter the request trusts little drafts 0 tokens a round while the other
    drafts: it is not even prefilled then, yet as a suffix drafter it gets the request's
    whole output, for its shared index, when the request ends."""
    coordinator, pool, _ = services
    prompt, params = [4, 6, 4, 6, 2, 7, 7, 0, 5], SamplingParams(max_tokens=6)  # a prompt no other test uses
    control = SpeculationControl(DRAFT_LENGTH)  # each drafter's prior: its reliability below
    tokens, stats = served(coordinator, dataclasses.replace(
        job("quiet", prompt, params, (("layerskip", 0.95), ("suffix", 0.05)), pipelined=False),
        speculation=control, tree_budget=DRAFT_LENGTH))
    assert len(tokens) == 6 and stats.per_drafter["layerskip"].proposed > 0, "layer-skip drafted"
    assert stats.per_drafter["suffix"].proposed == 0
    # prefilled once, at the end, with everything: never during the rounds
    assert [n for rid, kind, n in pool.prefilled if rid == "quiet/suffix"] == [len(prompt) + len(tokens)]
    index = registry.memory(target).suffix_index()  # the default namespace's, which the request used
    # after the whole prompt, which no other text holds, the index goes on with the output
    assert index.propose(prompt, len(tokens)).tokens == tokens, "the suffix index never saw the request's output"


def wait_for(condition, seconds: float) -> bool:
    give_up = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.05)
    return True


def test_a_release_the_busy_pool_times_out_is_sent_again(target, services, monkeypatch):
    """A pool too busy to answer a release within its timeout (every gRPC thread drafting for
    a burst) still lets the request go soon after, not at its idle eviction minutes later."""
    from router.coordinator import services as services_module

    coordinator, pool, _ = services
    real_release, slow = DrafterPool.release, [1]

    def busy_release(self, request_id):
        if slow:  # the first release waits past the router's timeout, as a busy pool's would
            slow.pop()
            time.sleep(getattr(services_module, "RELEASE_TIMEOUT_S", 2.0) + 0.5)
            return False
        return real_release(self, request_id)

    monkeypatch.setattr(services_module, "RELEASE_RETRY_PAUSE_S", 0.1, raising=False)
    monkeypatch.setattr(DrafterPool, "release", busy_release)
    tokens, _ = served(coordinator, job("busy-release", PROMPTS[0], SamplingParams(max_tokens=8),
                                        (("layerskip", 1.0),), pipelined=False))
    assert tokens == generate(target, PROMPTS[0], SamplingParams(max_tokens=8)).token_ids
    assert wait_for(lambda: pool.active_requests() == 0, 10.0), "the pool still holds the request"


def test_a_pool_that_fails_a_call_past_the_deadline_is_released(target, services):
    """A drafting call that outlives the request's deadline fails the request, and the pool,
    which took the request, lets it go rather than hold it until its idle eviction."""
    coordinator, pool, engine = services
    pool.delay = 1.0
    try:
        j = dataclasses.replace(job("late-pool", PROMPTS[1], SamplingParams(max_tokens=8), (("layerskip", 1.0),),
                                    pipelined=False), deadline=time.monotonic() + 0.6)
        with pytest.raises(Exception):
            served(coordinator, j)
    finally:
        pool.delay = 0.0
    assert wait_for(lambda: pool.active_requests() == 0 and engine.stats()["active_requests"] == 0, 10.0)
