"""Rounds the verifier drafts itself (the Decode call), driven by the router's coordinator.

A request with prompt lookup or the suffix drafter, or no drafter, runs its rounds on
the verifier: the pool is never asked, the output is the target's (greedy; seeded
sampling gives what the same request gives round by round through the router, which
the pool drafts), the stats count each round, and a verifier that goes away mid-call
(its gRPC server stopped, as a dying process's is) leaves the request to another
verifier with the same output. The verifier's suffix index is one per memory namespace.
Real gRPC servers on loopback, tiny models.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import grpc
import pytest
import torch

from drafter_service import registry
from drafter_service.pool import DrafterPool
from drafter_service.registry import make_drafter
from loopback import loopback
from oracle import MAX_TOKENS, PROMPTS as ORACLE_PROMPTS, near_tie_or_equal
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from router.adaptive import SpeculationControl
import router.coordinator.draft_side as draft_side_module
from router.coordinator import DECODE_ROUNDS, Channels, Coordinator, Job
from router.servicer import RouterConfig, RouterServicer
from router.servicer import serve as serve_router
from router.stats import RoundStats
from speculative.decoding import generate
from speculative.sampling import SamplingParams
from tiny import TINY, DigitTokenizer, tiny_model
import verifier_service.engine as engine_module
from verifier_service.engine import VerifierEngine
from verifier_service.servicer import VerifierServicer
from verifier_service.servicer import serve as serve_verifier

V = TINY.vocab_size
DRAFT_LENGTH = 4
PROMPTS = [[1, 2, 3, 1, 2], [5, 6, 7, 5], [0, 3, 3, 3, 3]]
GREEDY = SamplingParams(max_tokens=30)


class CountingPool(DrafterPool):
    """A pool that counts the Propose calls it answers, and those that ask for a draft (a
    finished request's output goes to the suffix drafter as a Propose of 0 tokens)."""

    proposals = drafts = 0

    def propose(self, request_id, context_length, new_tokens, max_tokens, *args, **kwargs):
        self.proposals += 1
        self.drafts += max_tokens > 0
        return super().propose(request_id, context_length, new_tokens, max_tokens, *args, **kwargs)


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_model(0)


def job(prompt: list[int], params: SamplingParams, drafter: str, verifier_drafting: bool) -> Job:
    return Job(request_id="r", prompt_ids=prompt, params=params, drafters=((drafter, 1.0),),
               draft_length=DRAFT_LENGTH, tree_budget=DRAFT_LENGTH, vocab_size=V, eos_token_ids=(),
               verifier_drafting=verifier_drafting)


def lookup_and_recycling(pld: float, recycle: float, verifier_drafting: bool = True, namespace: str = "") -> Job:
    """A request fused from prompt lookup and Token Recycling (which only a pool runs), with
    these reliabilities, adaptive lengths, over a prompt that repeats itself (prompt lookup
    finds drafts). `namespace`: the memory its drafters learn in (a fresh one: a recycling
    table no earlier test filled)."""
    return Job(request_id="r", prompt_ids=[1, 2, 3, 4] * 4, params=GREEDY,
               drafters=(("pld", pld), ("recycle", recycle)), draft_length=DRAFT_LENGTH, tree_budget=DRAFT_LENGTH,
               vocab_size=V, eos_token_ids=(),
               speculation=SpeculationControl(DRAFT_LENGTH), verifier_drafting=verifier_drafting, namespace=namespace)


def decode_calls(monkeypatch, *fields: str) -> list:
    """Each Decode call the verifier answers from now on, as its request's `fields` (a tuple,
    or the value of a single field)."""
    calls = []
    decode = VerifierServicer.Decode

    def counted(self, request, context):
        values = tuple(getattr(request, name) for name in fields)
        calls.append(values if len(values) > 1 else values[0])
        yield from decode(self, request, context)

    monkeypatch.setattr(VerifierServicer, "Decode", counted)
    return calls


def served(coordinator: Coordinator, j: Job) -> tuple[list[int], RoundStats]:
    stats = RoundStats()
    return [t for new in coordinator.run(j, stats) for t in new], stats


@pytest.mark.parametrize("drafter", ["pld", "suffix", "none"])
def test_verifier_drafted_rounds_give_the_targets_tokens_without_the_pool(target, drafter):
    pool = CountingPool(target, kinds=["pld", "suffix"])
    with loopback(pool, VerifierEngine(target, max_batch=2, max_len=64)) as coordinator:
        for prompt in PROMPTS:
            tokens, stats = served(coordinator, job(prompt, GREEDY, drafter, verifier_drafting=True))
            want = generate(target, prompt, GREEDY, make_drafter("pld", target), DRAFT_LENGTH, ()).token_ids
            assert tokens == want, prompt
            assert stats.target_forward_passes == 1 + len(stats.batch_sizes)  # the prefill, then a pass a round
            assert sum(stats.batch_sizes) == len(stats.batch_sizes)  # each a pass of its own
            if drafter != "none":
                assert stats.per_drafter[drafter].accepted == stats.accepted_draft_tokens
                assert stats.draft_tokens >= stats.accepted_draft_tokens > 0
            else:
                assert stats.draft_tokens == 0 and stats.target_forward_passes == GREEDY.max_tokens
    assert pool.drafts == 0 and pool.active_requests() == 0  # (suffix learns each output: a Propose of 0)


def test_a_served_request_drafted_on_the_verifier_teaches_the_pools_suffix_index_its_output(target):
    """Through a router, a suffix request's rounds run on the verifier and never ask the pool;
    once it ends, the pool's index (for rounds drafted there: pipelined, or fused with a
    drafter only a pool runs) holds its whole text too."""
    pool, engine = CountingPool(target, kinds=["pld", "suffix"]), VerifierEngine(target, max_batch=2, max_len=64)
    config = RouterConfig(context_length=TINY.max_position_embeddings - 12, eos_token_ids=[], vocab_size=V,
                          default_drafter="suffix", draft_length=DRAFT_LENGTH, verifier_drafting=True)
    prompt = "70625143"  # no other test's text: only this request can teach the index to go on after it
    with loopback(pool, engine) as coordinator:
        router, port = serve_router(RouterServicer(DigitTokenizer(), coordinator, config, None), "127.0.0.1", 0)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            resp = pb_grpc.SpecserveStub(channel).Generate(pb.GenerateRequest(
                prompt=prompt, sampling=pb.SamplingParams(max_tokens=8)), timeout=60)
        finally:
            channel.close()
            router.stop(None)
    output = list(resp.token_ids)
    assert resp.usage.drafter == "suffix" and pool.drafts == 0 and len(output) == 8
    index = registry.memory(target).suffix_index()
    assert index.propose(DigitTokenizer().encode(prompt), 8).tokens == output


@pytest.mark.parametrize("second", ["layerskip", "recycle"])
def test_rounds_no_drafter_is_asked_to_draft_are_plain_rounds_on_the_verifier(target, monkeypatch, second):
    """A fused request whose drafters all get length 0 (what adaptive lengths choose when the
    load makes no draft pay) decodes plainly on the verifier, not a router call a round; with
    a drafter that learns from the target's scores (recycle), those come back each round and
    are kept for it until it next drafts."""
    calls = decode_calls(monkeypatch, "drafter", "candidates")
    observed = []
    keep = draft_side_module.DraftSide.observe

    def kept(self, tokens, ids, probs):
        observed.append((self.drafter, len(tokens), len(ids)))
        keep(self, tokens, ids, probs)

    monkeypatch.setattr(draft_side_module.DraftSide, "observe", kept)
    pool = CountingPool(target, kinds=["pld", second])
    with loopback(pool, VerifierEngine(target, max_batch=2, max_len=64)) as coordinator:
        fused = Job(request_id="r", prompt_ids=PROMPTS[0], params=GREEDY, drafters=(("pld", 0.5), (second, 0.5)),
                    draft_length=0, tree_budget=DRAFT_LENGTH, vocab_size=V, eos_token_ids=(), verifier_drafting=True)
        tokens, stats = served(coordinator, fused)
    assert tokens == generate(target, PROMPTS[0], GREEDY, make_drafter("pld", target), DRAFT_LENGTH, ()).token_ids
    assert stats.target_forward_passes == GREEDY.max_tokens
    # after the prefill, one Decode call per DECODE_ROUNDS rounds: not a Verify call a round
    learns = second == "recycle"
    assert [drafter for drafter, _ in calls] == ["none"] * math.ceil((GREEDY.max_tokens - 1) / DECODE_ROUNDS)
    assert all((candidates > 0) == learns for _, candidates in calls)
    assert pool.proposals == 0
    # recycle keeps the target's candidates at each round's token (and the prompt's last
    # tokens, from the prefill) until it next drafts
    rounds = [o for o in observed if o[1] == 1]
    assert len(rounds) == (GREEDY.max_tokens - 1 if learns else 0)
    assert all(drafter == "recycle" and ids > 0 for drafter, _, ids in observed)


def test_rounds_whose_only_draft_is_prompt_lookup_run_on_the_verifier(target, monkeypatch):
    """A fused request whose adaptive lengths give prompt lookup a draft and its other
    drafter (one only a pool runs) none: prompt lookup is drafted on the verifier (Decode),
    the pool is never asked to draft and no round pays a Verify call's hop. The output is
    the target's."""
    calls = decode_calls(monkeypatch, "drafter")
    pool = CountingPool(target, kinds=["pld", "recycle"])
    fused = lookup_and_recycling(pld=1.0, recycle=0.0)
    with loopback(pool, VerifierEngine(target, max_batch=2, max_len=64)) as coordinator:
        tokens, stats = served(coordinator, fused)
    assert tokens == generate(target, fused.prompt_ids, GREEDY, None, 0, ()).token_ids
    assert pool.drafts == 0 and calls and set(calls) == {"pld"}
    assert stats.per_drafter["pld"].accepted == stats.accepted_draft_tokens > 0


def test_rounds_on_the_verifier_with_no_draft_still_probe(target, monkeypatch):
    """Prompt lookup whose control starts sure that no draft pays (prior 0): the first Decode
    call runs its 16 rounds plain, and they count towards the control's next probe, so the
    next call drafts again (one token), over a prompt that repeats itself, in its first round
    only (`drafted_rounds` 1): a probe's verdict teaches the control before more is drafted.
    The output is the target's."""
    calls = decode_calls(monkeypatch, "drafter", "draft_length", "drafted_rounds")
    lookup = dataclasses.replace(job([1, 2, 3, 4] * 4, GREEDY, "pld", True),
                                 speculation=SpeculationControl(DRAFT_LENGTH, prior=0.0))
    with loopback(CountingPool(target, kinds=["pld"]), VerifierEngine(target, max_batch=2, max_len=64)) as coordinator:
        tokens, stats = served(coordinator, lookup)
    assert tokens == generate(target, lookup.prompt_ids, GREEDY, None, 0, ()).token_ids
    assert calls[0] == ("none", 0, 0) and calls[1] == ("pld", 1, 1), calls
    assert stats.draft_tokens <= len(calls) - 1, (stats.draft_tokens, calls)  # a token a probe, no more


@pytest.mark.parametrize("verifier_drafting", [True, False])
def test_a_drafted_rounds_verify_hop_counts_only_against_plain_rounds_on_the_verifier(
        target, monkeypatch, verifier_drafting):
    """Each pass takes 10 ms and each Verify call waits 200 ms more before it reaches the
    engine (a slow hop, as the wait for a busy verifier's pass in flight is). Rounds with no
    draft run on the verifier with no hop: the adaptive lengths learn the hop and stop
    drafting through the pools, the rounds going on the verifier, drafted there by prompt
    lookup. Without rounds on the verifier a
    round with no draft pays the same hop, so drafting still pays. The next request at that
    load starts from the costs the first learned. The output is the target's either way."""
    real_pass, real_verify = engine_module.verify_batch, VerifierServicer.Verify

    def slow_pass(*args, **kwargs):
        time.sleep(0.01)
        return real_pass(*args, **kwargs)

    hops = []

    def slow_hop(self, request, context):
        hops.append(len(request.tree.tokens))
        time.sleep(0.2)
        return real_verify(self, request, context)

    monkeypatch.setattr(engine_module, "verify_batch", slow_pass)
    monkeypatch.setattr(VerifierServicer, "Verify", slow_hop)
    pool = CountingPool(target, kinds=["pld", "recycle"])
    # a fresh memory: what the table learned in earlier tests would change what drafting pays here
    fused = lookup_and_recycling(pld=0.9, recycle=0.9, verifier_drafting=verifier_drafting,
                                 namespace=f"hop-{verifier_drafting}")
    prompt = fused.prompt_ids
    with loopback(pool, VerifierEngine(target, max_batch=2, max_len=64)) as coordinator:
        tokens, stats = served(coordinator, fused)
        first = len(hops)
        # the next request at the same load starts from the costs the first learned
        again, _ = served(coordinator, dataclasses.replace(
            fused, speculation=SpeculationControl(DRAFT_LENGTH, prior=0.9), service_id="next"))
    assert tokens == again == generate(target, prompt, GREEDY, None, 0, ()).token_ids
    if verifier_drafting:
        # the first round that asks the pools teaches the hop: rounds on the verifier since, but
        # for a probe or two (how soon the control probes again weighs the hop against the
        # pass, which a loaded machine slows); the next request starts knowing it: no hop at all
        assert first <= 3 and len(hops) == first, hops
        assert stats.per_drafter["pld"].accepted > 0  # ... drafted there by prompt lookup
    else:
        assert first > 2 and len(hops) > first + 2 and sum(hops) > 0 and stats.accepted_draft_tokens > 0


def test_fused_rounds_on_the_verifier_give_hugging_faces_tokens(smollm2, hf_oracle, monkeypatch):
    """The default model on loopback; a fused suffix + Token Recycling request whose Verify
    calls each wait 200 ms (a slow hop): once the adaptive lengths have learned it they stop
    drafting through the pools, and its rounds go on on the verifier, drafted there by its
    suffix index. The tokens are Hugging Face's (the external oracle), near-ties aside."""
    model, tok = smollm2
    real_verify = VerifierServicer.Verify
    hops = []

    def slow_hop(self, request, context):
        hops.append(request.request_id)
        time.sleep(0.2)
        return real_verify(self, request, context)

    real_decode, decoded = VerifierServicer.Decode, []

    def counted(self, request, context):
        for resp in real_decode(self, request, context):
            decoded.append((request.drafter, resp.drafted))
            yield resp

    monkeypatch.setattr(VerifierServicer, "Verify", slow_hop)
    monkeypatch.setattr(VerifierServicer, "Decode", counted)
    pool = DrafterPool(model, kinds=["suffix", "recycle"])
    eos = tok.eos_token_ids or model.config.eos_token_ids
    ids = tok.encode_chat([{"role": "user", "content": ORACLE_PROMPTS[0][1]}])
    with loopback(pool, VerifierEngine(model, max_batch=2, max_len=512)) as coordinator:
        fused = Job(request_id="r", prompt_ids=ids, params=SamplingParams(max_tokens=MAX_TOKENS),
                    drafters=(("suffix", 0.9), ("recycle", 0.9)), draft_length=5, tree_budget=8,
                    vocab_size=model.config.vocab_size, eos_token_ids=eos,
                    speculation=SpeculationControl(5, prior=0.9), verifier_drafting=True)
        tokens, stats = served(coordinator, fused)
    near_tie_or_equal(hf_oracle, 0, tokens, "fused, rounds on the verifier")
    assert len(hops) + len(decoded) == len(stats.batch_sizes)  # every round one or the other
    assert hops and sum(drafted for drafter, drafted in decoded if drafter == "suffix") > 0


@pytest.mark.parametrize("drafter", ["pld", "suffix"])
def test_seeded_sampling_is_what_the_round_by_round_path_draws(target, drafter):
    """The verifier's drafts are the pool's (the same lookup, n-gram sizes and lengths; the
    same suffix trees from indexes that have learned the same text: each path's in a fresh
    namespace), so a seeded request draws the same tokens either way."""
    pool = CountingPool(target, kinds=["pld", "suffix"])
    with loopback(pool, VerifierEngine(target, max_batch=2, max_len=64)) as coordinator:
        for seed, prompt in enumerate(PROMPTS):
            params = SamplingParams(max_tokens=30, temperature=1.0, top_k=6, seed=seed)
            drafts = pool.drafts
            on_verifier, stats = served(coordinator, dataclasses.replace(
                job(prompt, params, drafter, verifier_drafting=True), namespace=f"{drafter}-{seed}-verifier"))
            assert pool.drafts == drafts and stats.accepted_draft_tokens > 0
            by_rounds, _ = served(coordinator, dataclasses.replace(
                job(prompt, params, drafter, verifier_drafting=False), namespace=f"{drafter}-{seed}-pool"))
            assert on_verifier == by_rounds and len(on_verifier) == params.max_tokens


def test_a_verifier_gone_mid_call_leaves_the_request_to_another(target):
    """The first verifier's server stops (every call on it ends UNAVAILABLE or CANCELLED) in
    its fourth round; the router prefills the request on the second with every token verified
    so far and goes on there: the output is the target's."""
    stopped = threading.Event()

    class Dying(VerifierEngine):
        rounds = 0

        def count_round(self) -> None:
            self.rounds += 1
            if self.rounds == 4:
                first_server.stop(None)
                stopped.set()

        def verify(self, *args, **kwargs):
            self.count_round()
            return super().verify(*args, **kwargs)

        def verify_rounds(self, request_id, tree, context_length, next_tree, *args, **kwargs):
            self.count_round()  # the Decode call's first round; the others as the worker queues them

            def counted(outcome):
                self.count_round()
                return next_tree(outcome)

            return super().verify_rounds(request_id, tree, context_length, counted, *args, **kwargs)

    dying, healthy = Dying(target, max_batch=2, max_len=64), VerifierEngine(target, max_batch=2, max_len=64)
    (first_server, first), (second_server, second) = serve_verifier(dying), serve_verifier(healthy)
    coordinator = Coordinator(verifiers=lambda: [f"127.0.0.1:{first}", f"127.0.0.1:{second}"],
                              drafters=lambda: [], channels=Channels())
    try:
        tokens, stats = served(coordinator, job(PROMPTS[0], GREEDY, "pld", verifier_drafting=True))
    finally:
        coordinator.services.channels.close()
        second_server.stop(None)
        for engine in (dying, healthy):
            engine.close()
    assert stopped.is_set()
    assert tokens == generate(target, PROMPTS[0], GREEDY, make_drafter("pld", target), DRAFT_LENGTH, ()).token_ids
    assert stats.target_forward_passes > dying.rounds  # the second verifier's prefill and rounds
    assert healthy.stats()["forward_passes"] >= 2 and healthy.active_requests() == 0
