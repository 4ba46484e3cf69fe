"""Confidence fusion in the served path, without Ray: a drafter pool and a
verifier behind real gRPC servers on loopback, the coordinator (and the
router servicer) in process, tiny models.

Three drafters of one request (prompt lookup and two small models) are
three requests in the pool, each under its own id and random stream; the
coordinator fuses their trees and the verifier checks the fused tree. Greedy
output equals the target's own decoding; sampled output equals the same
fusion done in one process with drafter i on stream 1 + i (whose exactness
test_fusion.py proves); one drafter alone goes exactly today's way; each
drafter's own tokens are counted and recorded.
"""

from __future__ import annotations

from collections import defaultdict

import grpc
import numpy as np
import pytest
import torch

from cluster.state import EmbeddedStateStore
from drafter_service.checkpoint import save_drafter
from drafter_service.pool import DrafterPool
from drafter_service.registry import make_drafter
from loopback import loopback
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from protos.convert import tree_from_pb, tree_to_pb
from router.coordinator import Coordinator, Job
from router.expertise import ExpertiseRouter
from router.goodput import candidate_routes, route_name
from router.servicer import RouterConfig, RouterServicer
from router.servicer import serve as serve_router
from router.stats import RoundStats
from speculative.batching import VerifyItem, verify_batch
from speculative.calibration import Calibration
from speculative.decoding import DraftRequest, generate
from speculative.fusion import fuse
from runtime.model import attention_mask, causal_ancestors
from speculative.sampling import InvalidArgument, SamplingParams, make_generator, probabilities, sample
from speculative.tree import DraftTree
from tiny import TINY, DigitTokenizer, tiny_model
from trees import path_to
from verifier_service.engine import VerifierEngine

V = TINY.vocab_size
DRAFT_LENGTH, TREE_BUDGET = 4, 6  # three 4-token chains fused into at most 6 nodes: pruning happens
PROMPTS = [[1, 2, 3, 1, 2], [5, 6, 7, 5], [0, 3, 3, 3, 3]]
MAX_TOKENS = 24
SAMPLED = dict(temperature=1.0, top_k=6, top_p=0.95)


class RecordingPool(DrafterPool):
    """A drafter pool that remembers each request's stream and proposals, and
    fails the prefills of the kinds in `broken`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.streams: dict[str, int] = {}
        self.proposals: dict[str, list[DraftTree]] = defaultdict(list)
        self.broken: set[str] = set()

    def prefill(self, request_id, kind, token_ids, params, stream=1, *args, **kwargs):
        if kind in self.broken:
            raise RuntimeError(f"{kind} is broken")  # UNKNOWN on the wire: the caller tries another pool
        self.streams[request_id] = stream
        super().prefill(request_id, kind, token_ids, params, stream, *args, **kwargs)

    def propose(self, request_id, *args, **kwargs):
        tree = super().propose(request_id, *args, **kwargs)
        if tree is not None:
            self.proposals[request_id].append(tree)
        return tree


class RecordingEngine(VerifierEngine):
    """A verifier engine that remembers each request's trees."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trees: dict[str, list[DraftTree]] = defaultdict(list)

    def verify(self, request_id, tree, *args):
        self.trees[request_id].append(tree)
        return super().verify(request_id, tree, *args)


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_model(0)


@pytest.fixture(scope="module")
def drafter_model():
    """The pool's model: another random tiny model, so that its layer-skip drafter
    (all of its 2 layers) is a small drafter the target often disagrees with."""
    return tiny_model(1)


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """(kind, reliability) of the fused drafters; drafter i draws from stream 1 + i.
    Not in reliability order, so fusion's order is not the streams' order."""
    small = tmp_path_factory.mktemp("drafter")
    save_drafter(tiny_model(2), None, small, {"target": {"vocab_size": V}})
    return (("layerskip", 0.7), (str(small), 0.5), ("pld", 0.6))


@pytest.fixture(scope="module")
def services(target, drafter_model, fused):
    pool = RecordingPool(drafter_model, kinds=[kind for kind, _ in fused])
    engine = RecordingEngine(target, max_batch=4, max_len=64)
    with loopback(pool, engine) as coordinator:
        yield coordinator, pool, engine


def job(request_id: str, prompt: list[int], params: SamplingParams, drafters,
        tree_budget: int = TREE_BUDGET) -> Job:
    # the services key it by its service id: the test names it, to find its trees there
    return Job(request_id=request_id, prompt_ids=prompt, params=params, drafters=drafters,
               draft_length=DRAFT_LENGTH, tree_budget=tree_budget, vocab_size=V, eos_token_ids=(),
               service_id=request_id)


def served(coordinator: Coordinator, j: Job) -> tuple[list[int], RoundStats]:
    stats = RoundStats()
    return [t for new in coordinator.run(j, stats) for t in new], stats


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[n] for n in path_to(tree, node)) for node in range(len(tree))}


def proposal(pool: RecordingPool, request_id: str, kind: str, i: int) -> DraftTree:
    """Drafter `kind`'s tree in round i of a fused request (empty if the round had no room to draft)."""
    own = pool.proposals[f"{request_id}/{kind}"]
    return own[i] if i < len(own) else DraftTree()


@pytest.fixture(scope="module")
def greedy_runs(services, fused):
    coordinator, _, _ = services
    params = SamplingParams(max_tokens=MAX_TOKENS)
    return [(f"g{i}", prompt, *served(coordinator, job(f"g{i}", prompt, params, fused)))
            for i, prompt in enumerate(PROMPTS)]


def test_fused_greedy_equals_the_targets_own_decoding(target, services, fused, greedy_runs):
    _, pool, engine = services
    own_nodes = dict.fromkeys((kind for kind, _ in fused), 0)  # fused nodes no other drafter proposed
    for rid, prompt, tokens, stats in greedy_runs:
        assert tokens == generate(target, prompt, SamplingParams(max_tokens=MAX_TOKENS)).token_ids
        assert stats.accepted_draft_tokens > 0
        for i, tree in enumerate(engine.trees[rid]):
            assert len(tree) <= TREE_BUDGET
            proposed = {kind: paths(proposal(pool, rid, kind, i)) for kind in own_nodes}
            for kind in own_nodes:
                others = set().union(*(p for k, p in proposed.items() if k != kind))
                own_nodes[kind] += len(paths(tree) & proposed[kind] - others)
    assert all(own_nodes.values()), f"a drafter never had a node of its own in a fused tree: {own_nodes}"
    assert pool.active_requests() == 0 and engine.stats()["active_requests"] == 0  # released under their own ids


def test_each_drafter_is_credited_with_its_own_tokens(services, fused, greedy_runs):
    """Replayed from what the services saw: per round, the accepted path is the
    longest run of the output that the fused tree holds, and each drafter earns
    the part of it that its own tree holds."""
    _, pool, engine = services
    for rid, _, tokens, stats in greedy_runs:
        want = {kind: [0, 0] for kind, _ in fused}  # proposed, accepted
        pos, accepted_total = 1, 0  # the first token came from the prefill
        for i, tree in enumerate(engine.trees[rid]):
            accepted = tokens[pos:pos + held(tree, tokens[pos:])]
            for kind, _ in fused:
                own = proposal(pool, rid, kind, i)
                want[kind][0] += len(own)
                want[kind][1] += held(own, accepted)
            accepted_total += len(accepted)
            pos += len(accepted) + 1
        assert pos == len(tokens)
        assert {kind: [s.proposed, s.accepted] for kind, s in stats.per_drafter.items()} == want
        assert stats.accepted_draft_tokens == accepted_total
        assert stats.draft_tokens == sum(len(t) for t in engine.trees[rid])
        assert all(proposed > 0 for proposed, _ in want.values())


def test_greedy_fusion_calibrates_each_drafter_from_every_verdict(services, fused, greedy_runs):
    """The router's calibration of each drafter kind holds exactly what replaying every
    round's verdict (accepted path, then bonus) on that drafter's own tree teaches."""
    coordinator, pool, engine = services
    replay = {kind: Calibration() for kind, _ in fused}
    for rid, _, tokens, _ in greedy_runs:
        pos = 1
        for i, tree in enumerate(engine.trees[rid]):
            took = tokens[pos:pos + held(tree, tokens[pos:]) + 1]
            for kind, _ in fused:
                replay[kind].learn(proposal(pool, rid, kind, i), took)
            pos += len(took)
    for kind, _ in fused:
        learned = coordinator.calibration(kind)
        assert sum(learned.labels) > 0
        assert learned.hits == pytest.approx(replay[kind].hits) and learned.labels == pytest.approx(replay[kind].labels)


def held(tree: DraftTree, tokens: list[int]) -> int:
    """How many of `tokens`, from the first, are a path of `tree` from its root."""
    return max((len(p) for p in paths(tree) if tuple(tokens[:len(p)]) == p), default=0)


@pytest.mark.parametrize("seed", [3, 4])
def test_each_drafter_of_a_request_draws_from_its_own_stream(target, drafter_model, services, fused, seed,
                                                            monkeypatch):
    """Sampled (unseeded: rejection sampling, whose streams the pools and the verifier draw
    here as seed `seed`'s, so that the run can be replayed): the pool sees streams 1, 2 and
    3, and the served tokens are those of the same fusion in one process with those streams
    (and not with the two model drafters sharing one)."""
    import drafter_service.pool
    import verifier_service.engine

    for module in (drafter_service.pool, verifier_service.engine):
        monkeypatch.setattr(module, "make_generator", lambda _, device="cpu", stream=0, resumed=0:
                            make_generator(seed, device, stream, resumed))
    coordinator, pool, _ = services
    params = SamplingParams(max_tokens=MAX_TOKENS, **SAMPLED)
    tokens, stats = served(coordinator, job(f"s{seed}", PROMPTS[0], params, fused))
    assert [pool.streams[f"s{seed}/{kind}"] for kind, _ in fused] == [1, 2, 3]
    assert tokens == local_fused_sampling(target, drafter_model, fused, PROMPTS[0], params, seed, streams=(1, 2, 3))
    assert tokens != local_fused_sampling(target, drafter_model, fused, PROMPTS[0], params, seed, streams=(1, 1, 3))
    assert all(s.proposed > 0 for s in stats.per_drafter.values())
    with pytest.raises(InvalidArgument, match="stream"):  # stream 0 is the verifier's
        pool.prefill("bad", "pld", PROMPTS[0], params, stream=0)


def local_fused_sampling(target, drafter_model, fused, prompt: list[int], params: SamplingParams, seed: int,
                         streams: tuple[int, ...]) -> list[int]:
    """The served fused rounds in one process: drafter i on stream streams[i], trees
    read back as the coordinator reads them, fused, verified on stream 0."""
    drafters = [make_drafter(kind, drafter_model, draft_top_k=32) for kind, _ in fused]
    streams = [make_generator(seed, stream=s) for s in streams]
    verifier_rng = make_generator(seed, stream=0)
    cache = target.new_cache(len(prompt) + params.max_tokens + TREE_BUDGET + 1)
    n = len(prompt)
    logits = target(torch.tensor([prompt]), torch.arange(n)[None], cache, attention_mask(0, causal_ancestors(n)),
                    logits_from=n - 1)
    out = [sample(probabilities(logits[0, -1], params), verifier_rng)]
    while len(out) < params.max_tokens:
        context = prompt + out
        budget = min(DRAFT_LENGTH, params.max_tokens - len(out) - 1)
        tree = DraftTree()
        if budget > 0:
            trees = [tree_from_pb(tree_to_pb(d.propose(DraftRequest(context, budget, params, rng))), V)
                     for d, rng in zip(drafters, streams)]
            tree = fuse([(t, r) for t, (_, r) in zip(trees, fused)], TREE_BUDGET, greedy=False)
        [verdict] = verify_batch(target, cache, [VerifyItem(0, context[-1], tree, params, verifier_rng)])
        path, bonus = verdict.path, verdict.bonus
        out += [tree.tokens[node] for node in path] + [bonus]
    return out[:params.max_tokens]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_drafter_goes_todays_way(target, drafter_model, services, temperature):
    """Its own request id and stream 1, its tree verified as it is: the served
    tokens are the single-process loop's with that drafter (chains: a budget of
    one chain, as the loop's default)."""
    coordinator, pool, engine = services
    params = SamplingParams(max_tokens=MAX_TOKENS, seed=5, **{**SAMPLED, "temperature": temperature})
    rid = f"one{temperature}"
    tokens, stats = served(coordinator, job(rid, PROMPTS[1], params, drafters=(("layerskip", 1.0),),
                                            tree_budget=DRAFT_LENGTH))
    local = make_drafter("layerskip", drafter_model, draft_top_k=32)
    assert tokens == generate(target, PROMPTS[1], params, local, DRAFT_LENGTH).token_ids
    assert pool.streams[rid] == 1
    assert [t.tokens for t in engine.trees[rid][:len(pool.proposals[rid])]] == [t.tokens for t in pool.proposals[rid]]
    assert stats.per_drafter["layerskip"].accepted == stats.accepted_draft_tokens


def test_a_failing_drafter_adds_nothing_and_the_others_go_on(target, services, fused):
    """One drafter's pool fails it and no other pool is left: it drafts nothing
    from then on, while the request's other drafters keep drafting on that pool."""
    coordinator, pool, _ = services
    pool.broken = {"pld"}
    try:
        tokens, stats = served(coordinator, job("f", PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS), fused))
    finally:
        pool.broken = set()
    assert tokens == generate(target, PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS)).token_ids
    assert stats.per_drafter.pop("pld").proposed == 0
    assert all(s.proposed > 0 for s in stats.per_drafter.values())


def test_a_routed_request_fuses_its_best_drafters_and_records_each(target, services, fused):
    """fused_drafters=2 of 3 candidates, the fused pairs measured fastest: the request gets a
    pair, both drafters' acceptance recorded for its domain, and the pair's speedup for its route."""
    coordinator, _, _ = services
    store = EmbeddedStateStore()
    candidates = tuple(kind for kind, _ in fused)
    for route in candidate_routes(candidates, 2):
        x = np.log(2.0 if len(route) == 2 else 0.5)  # 30 requests each: the pairs twice as fast as plain
        store.record_goodput(route_name(route), "coding", 30, 30 * x, 30 * x * x)
    expertise = ExpertiseRouter(store, refresh_s=0, rng=np.random.default_rng(0), epsilon=0.0)
    config = RouterConfig(context_length=TINY.max_position_embeddings - TREE_BUDGET - 4, eos_token_ids=[],
                          vocab_size=V, default_drafter="auto", routed_drafters=candidates,
                          fused_drafters=2, draft_length=DRAFT_LENGTH, tree_budget=TREE_BUDGET,
                          adaptive=False, stop_confidence=0.0)
    server, port = serve_router(RouterServicer(DigitTokenizer(), coordinator, config, expertise), "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        resp = pb_grpc.SpecserveStub(channel).Generate(pb.GenerateRequest(
            prompt="12312", domain_hint="coding", sampling=pb.SamplingParams(max_tokens=16)), timeout=60)
    finally:
        channel.close()
        server.stop(None)
    assert list(resp.token_ids) == generate(target, [1, 2, 3, 1, 2], SamplingParams(max_tokens=16)).token_ids
    chosen = resp.usage.drafter.split("+")
    assert len(set(chosen)) == 2 and set(chosen) <= set(candidates)
    expertise.refresh()
    recorded = store.acceptance_stats()
    assert {kind for kind, _ in recorded} == set(chosen) and {domain for _, domain in recorded} == {"coding"}
    assert all(0 <= accepted <= proposed and proposed > 0 for proposed, accepted in recorded.values())
    served = {key: stats.requests for key, stats in store.goodput_stats().items() if stats.requests > 30}
    assert served == {(route_name(chosen), "coding"): 31}


def test_a_greedy_model_drafter_alone_sends_trees_as_wide_as_the_budget(target, services):
    """`tree_budget` holds for one drafter too: a greedy model drafter branches to fill it,
    `draft_length` deep, and the output is still the target's own."""
    coordinator, pool, engine = services
    params = SamplingParams(max_tokens=MAX_TOKENS)
    tokens, _ = served(coordinator, job("wide", PROMPTS[0], params, drafters=(("layerskip", 1.0),)))
    assert tokens == generate(target, PROMPTS[0], params).token_ids
    trees = engine.trees["wide"]
    assert DRAFT_LENGTH < max(len(t) for t in trees) <= TREE_BUDGET
    assert max(max(t.depths, default=0) for t in trees) <= DRAFT_LENGTH
