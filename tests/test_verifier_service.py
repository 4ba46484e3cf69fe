"""The verifier engine behind a real gRPC server on loopback.

Driven round by round from the test process with a prompt-lookup drafter, it
gives the tokens of the single-process loop (speculative.decoding.generate,
itself checked against Hugging Face): greedy on the real model, seeded
sampling and concurrent batched requests on the tiny one. Also: bad input,
lost state, resuming from a checkpoint on a new verifier, health and reflection.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator, Sequence

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from cluster.state import EmbeddedStateStore
from drafter_service.registry import make_drafter
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from protos.convert import params_to_pb, tree_to_pb
from speculative import batching
from speculative.decoding import DraftRequest, generate
from speculative.ngram import lookup_draft
from speculative.sampling import SamplingParams, make_generator
from speculative.tree import DraftTree
from tiny import tiny_model
from verifier_service.engine import VerifierEngine
from verifier_service.servicer import SERVICE_NAME, serve

DRAFT_LENGTH = 5
SAMPLED = SamplingParams(max_tokens=30, temperature=1.0, top_k=6, top_p=0.95, seed=11)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(0)


@contextmanager
def served(engine: VerifierEngine) -> Iterator[pb_grpc.VerifierStub]:
    """A Verifier stub on a fresh loopback server; server and engine stop on exit (a verifier going away)."""
    server, port = serve(engine)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.VerifierStub(channel)
    finally:
        channel.close()
        server.stop(None)
        engine.close()


def prompt(i: int, n: int = 10) -> list[int]:
    """A tiny-model prompt with repeats, so prompt lookup finds drafts."""
    return [(i + j * (i % 3 + 1)) % 7 for j in range(n)]


def single_run(model, prompt_ids: Sequence[int], params: SamplingParams, eos: Sequence[int] = ()) -> list[int]:
    return generate(model, prompt_ids, params, make_drafter("pld", model), DRAFT_LENGTH, eos).token_ids


class Remote:
    """One request driven over gRPC as speculative.decoding.generate drives it in process."""

    def __init__(self, stub: pb_grpc.VerifierStub, request_id: str, prompt_ids: Sequence[int],
                 params: SamplingParams, model, eos: Sequence[int] = ()):
        self.stub, self.request_id, self.prompt, self.params, self.eos = stub, request_id, list(prompt_ids), params, eos
        self.drafter = make_drafter("pld", model)
        self.drafter_rng = make_generator(params.seed, stream=1)
        self.tokens: list[int] = []
        self.done = False
        self.accepted_drafts = 0
        self.batch_sizes: list[int] = []
        self.passes: list[tuple] = []  # (pass id, batch size, seconds, tokens, width) and this row's tokens
        first = stub.Prefill(pb.VerifierPrefillRequest(
            request_id=request_id, token_ids=self.prompt, sampling=params_to_pb(params),
            max_len=len(self.prompt) + params.max_tokens + DRAFT_LENGTH + 1)).next_token
        self._emit([first])

    def _emit(self, new: list[int]) -> None:
        for i, tok in enumerate(new):
            if tok in self.eos:
                new, self.done = new[:i + 1], True
                break
        room = self.params.max_tokens - len(self.tokens)
        if len(new) >= room:
            new, self.done = new[:room], True
        self.tokens += new

    def step(self) -> None:
        budget = min(DRAFT_LENGTH, self.params.max_tokens - len(self.tokens) - 1)
        tree = DraftTree()
        if budget > 0:
            tree = self.drafter.propose(DraftRequest(self.prompt + self.tokens, budget, self.params, self.drafter_rng))
            tree = tree.truncated(budget)
        resp = self.stub.Verify(pb.VerifyRequest(request_id=self.request_id, tree=tree_to_pb(tree)))
        assert not resp.state_lost
        self.accepted_drafts += len(resp.accepted)
        self.batch_sizes.append(resp.batch_size)
        self.passes.append(((resp.pass_id, resp.batch_size, resp.pass_seconds, resp.pass_tokens, resp.pass_width),
                            1 + len(tree)))
        self._emit(list(resp.accepted) + [resp.bonus])

    def run(self) -> list[int]:
        while not self.done:
            self.step()
        return self.tokens


def test_greedy_over_grpc_equals_the_single_process_loop(smollm2):
    model, tok = smollm2
    eos = tok.eos_token_ids or model.config.eos_token_ids
    params = SamplingParams(max_tokens=32)
    prompts = ["Repeat this line twice: the quick brown fox jumps over the lazy dog.",
               "Add type hints to this function:\ndef area(width, height):\n    return width * height"]
    with served(VerifierEngine(model, max_batch=2, max_len=512)) as stub:
        for i, text in enumerate(prompts):
            ids = tok.encode_chat([{"role": "user", "content": text}])
            remote = Remote(stub, f"r{i}", ids, params, model, eos)
            assert remote.run() == single_run(model, ids, params, eos), text
            assert remote.accepted_drafts > 0, "no draft token was accepted: the trees were not exercised"
            assert stub.Release(pb.ReleaseRequest(request_id=f"r{i}")).released


def test_concurrent_requests_share_passes_and_match_single_runs(tiny):
    n = 8
    params = [SamplingParams(max_tokens=24) if i % 2 else SamplingParams(max_tokens=24, temperature=1.0, seed=i)
              for i in range(n)]
    all_prefilled = threading.Barrier(n)
    with served(VerifierEngine(tiny, max_batch=n, max_len=64, batch_wait_s=0.05)) as stub:
        def client(i: int) -> Remote:
            remote = Remote(stub, f"c{i}", prompt(i), params[i], tiny)
            all_prefilled.wait(timeout=30)
            remote.run()
            return remote

        with ThreadPoolExecutor(n) as pool:
            remotes = list(pool.map(client, range(n)))
        stats = stub.Stats(pb.VerifierStatsRequest())
        assert stats.active_requests == n
        for i, remote in enumerate(remotes):
            assert remote.tokens == single_run(tiny, prompt(i), params[i]), f"client {i}"
            assert stub.Release(pb.ReleaseRequest(request_id=f"c{i}")).released
        assert stub.Stats(pb.VerifierStatsRequest()).active_requests == 0
    rounds = sum(len(r.batch_sizes) for r in remotes)
    assert stats.verified_requests == rounds
    assert sum(size * count for size, count in stats.batch_size_histogram.items()) == rounds
    assert stats.max_batch_size > 1 and any(size > 1 for size in stats.batch_size_histogram)
    assert stats.forward_passes == n + sum(stats.batch_size_histogram.values())  # prefills + verification passes
    assert max(max(r.batch_sizes) for r in remotes) == stats.max_batch_size
    assert 0 < stats.busy_seconds < stats.uptime_seconds  # idle fraction: 1 - busy / uptime
    # every request of a pass reports the same pass, whose tokens are its rows' (for learning pass costs)
    rows: dict[tuple, list[int]] = {}
    for remote in remotes:
        for shape, row_tokens in remote.passes:
            rows.setdefault(shape, []).append(row_tokens)
    assert len({shape[0] for shape in rows}) == len(rows) == sum(stats.batch_size_histogram.values())
    for (pass_id, batch_size, seconds, tokens, width), row_tokens in rows.items():
        assert 0 < pass_id <= stats.forward_passes and 0 < seconds <= stats.busy_seconds
        assert (batch_size, tokens, width) == (len(row_tokens), sum(row_tokens), max(row_tokens))
    assert any(width > 1 for _, _, _, _, width in rows), "no pass held a draft"


def test_queued_verification_goes_earliest_deadline_first_within_the_token_budget(tiny):
    from verifier_service.engine import _Verify

    engine = VerifierEngine(tiny, max_batch=3, max_len=64, max_batch_tokens=8)
    engine.close()  # no worker: the test looks at what the next pass would take
    chain = lambda n: DraftTree.chain([1] * n)  # noqa: E731
    late, big, soon, none_set, other = (_Verify("a", chain(1), deadline=9.0), _Verify("b", chain(5), deadline=2.0),
                                        _Verify("c", chain(2), deadline=1.0), _Verify("d", chain(1)),
                                        _Verify("a", chain(1), deadline=0.5))
    engine._queue.extend([late, big, soon, none_set, other])
    # c (deadline 1) first; b (6 tokens) does not fit after c's 3, a's first call (2) does and
    # its second (deadline 0.5) waits for it; d has no deadline: last
    assert engine._batchable() == [soon, late, none_set]


def test_seeded_sampling_over_grpc_equals_the_single_process_loop(tiny):
    with served(VerifierEngine(tiny, max_len=64)) as stub:
        for seed in (11, 12):
            params = SamplingParams(max_tokens=30, temperature=1.0, top_k=6, top_p=0.95, seed=seed)
            remote = Remote(stub, f"s{seed}", prompt(seed), params, tiny)
            assert remote.run() == single_run(tiny, prompt(seed), params), f"seed {seed}"
            assert remote.accepted_drafts > 0


def decoded(stub: pb_grpc.VerifierStub, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
            eos: Sequence[int] = (), drafter: str = "pld", namespace: str = ""
            ) -> tuple[list[int], list[pb.VerifyResponse]]:
    """A request prefilled, then every round run by the verifier itself (Decode) in one call:
    its tokens, clipped as the router clips them, and each round's verdict."""
    first = stub.Prefill(pb.VerifierPrefillRequest(
        request_id=request_id, token_ids=list(prompt_ids), sampling=params_to_pb(params),
        max_len=len(prompt_ids) + params.max_tokens + DRAFT_LENGTH + 1)).next_token
    tokens, rounds = [first], []
    if first not in eos and params.max_tokens > 1:
        rounds = list(stub.Decode(pb.DecodeRequest(
            request_id=request_id, token_ids=[*prompt_ids, first], drafter=drafter, draft_length=DRAFT_LENGTH,
            max_tokens=params.max_tokens - 1, eos_token_ids=eos, namespace=namespace)))
    for resp in rounds:
        assert not resp.state_lost
        tokens += [*resp.accepted, resp.bonus]
    ends = [i for i, t in enumerate(tokens) if t in eos]
    return tokens[:ends[0] + 1] if ends else tokens, rounds


def test_decode_on_the_verifier_gives_the_single_process_loop(tiny):
    """The verifier's own rounds (Decode) draft prompt lookup's chains from the request's
    text: seeded sampling draws exactly what the single-process loop with the same drafter
    draws, greedy and plain decoding give its tokens, and the call ends at an end token."""
    greedy = SamplingParams(max_tokens=30)
    with served(VerifierEngine(tiny, max_len=64)) as stub:
        for seed in (11, 12):
            params = replace(SAMPLED, seed=seed)
            tokens, rounds = decoded(stub, f"s{seed}", prompt(seed), params)
            assert tokens == single_run(tiny, prompt(seed), params), f"seed {seed}"
            assert len(tokens) == params.max_tokens
            assert sum(len(r.accepted) for r in rounds) > 0 and all(r.drafted <= DRAFT_LENGTH for r in rounds)
        want = single_run(tiny, prompt(4), greedy)
        assert decoded(stub, "g", prompt(4), greedy)[0] == want
        plain, rounds = decoded(stub, "n", prompt(4), greedy, drafter="none")
        assert plain == want and {r.drafted for r in rounds} == {0} and len(rounds) == greedy.max_tokens - 1
        eos = [want[12]]
        tokens, rounds = decoded(stub, "e", prompt(4), greedy, eos)
        assert tokens == single_run(tiny, prompt(4), greedy, eos) and eos[0] in [*rounds[-1].accepted, rounds[-1].bonus]
        for request_id in ("s11", "s12", "g", "n", "e"):  # Decode leaves the request held, for more rounds
            assert stub.Release(pb.ReleaseRequest(request_id=request_id)).released


def test_suffix_decode_on_the_verifier_gives_the_single_process_loop(tiny):
    """The verifier's own rounds drafted by its suffix index (a namespace of their own): seeded
    sampling draws exactly what the single-process loop draws with a fresh suffix drafter
    (the same trees from the same text, one-hot q), and greedy gives its tokens."""
    with served(VerifierEngine(tiny, max_len=64)) as stub:
        for seed in (11, 12, None):
            params = replace(SAMPLED, seed=seed) if seed else SamplingParams(max_tokens=30)
            tokens, rounds = decoded(stub, f"x{seed}", prompt(seed or 4), params, drafter="suffix",
                                     namespace=f"verifier-{seed}")
            drafter = make_drafter("suffix", tiny, namespace=f"in-process-{seed}")
            assert tokens == generate(tiny, prompt(seed or 4), params, drafter, DRAFT_LENGTH).token_ids, seed
            assert sum(len(r.accepted) for r in rounds) > 0
            assert all(r.drafted_depth <= min(r.drafted, DRAFT_LENGTH) for r in rounds)


def test_the_verifiers_suffix_index_is_one_per_namespace():
    """A request's text drafts for later requests of its memory namespace, not for another's:
    a second request whose prompt is the first one's text cut short is drafted the rest of
    it in the first one's namespace, and nothing in another (a vocabulary large enough that
    a short text need not repeat itself). A text handed over at Release (a request whose
    rounds were drafted elsewhere) is learned the same way."""
    greedy = SamplingParams(max_tokens=12)
    with served(VerifierEngine(tiny_model(0, vocab_size=64), max_len=64)) as stub:
        first = list(range(8, 16))
        text, _ = decoded(stub, "a", first, greedy, drafter="suffix", namespace="a")
        again = [*first, *text[:2]]  # greedy, it goes on as the first request's text did
        _, same = decoded(stub, "b", again, greedy, drafter="suffix", namespace="a")
        _, other = decoded(stub, "c", again, greedy, drafter="suffix", namespace="b")
        stub.Release(pb.ReleaseRequest(request_id="d", learn_token_ids=[*first, *text], namespace="c"))
        _, taught = decoded(stub, "e", again, greedy, drafter="suffix", namespace="c")
        for field, bad in (("learn_token_ids", dict(learn_token_ids=[64])),
                           ("namespace", dict(learn_token_ids=[1], namespace="no spaces"))):
            with pytest.raises(grpc.RpcError) as info:
                stub.Release(pb.ReleaseRequest(request_id="f", **bad))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(field)
    assert same[0].drafted > 0 and same[0].accepted
    assert other[0].drafted == 0
    assert taught[0].drafted > 0 and taught[0].accepted


def test_greedy_decode_on_the_verifier_equals_the_single_process_loop(smollm2):
    model, tok = smollm2
    eos = tok.eos_token_ids or model.config.eos_token_ids
    params = SamplingParams(max_tokens=32)
    ids = tok.encode_chat([{"role": "user", "content": "Repeat this line twice: the quick brown fox jumps over "
                                                        "the lazy dog."}])
    with served(VerifierEngine(model, max_batch=1, max_len=512)) as stub:
        tokens, rounds = decoded(stub, "r", ids, params, eos)
    assert tokens == single_run(model, ids, params, eos)
    assert len(rounds) < len(tokens) - 1, "no round accepted a draft: the chains were not exercised"


def test_plain_decode_brings_back_the_candidates_verify_would(tiny):
    """Plain rounds on the verifier (Decode, drafter none) with `candidates` k: each verdict
    holds the target's k likeliest next tokens at its round's one scored position, what
    Verify gives the same request round by round."""
    params = SamplingParams(max_tokens=8)
    with served(VerifierEngine(tiny, max_len=64)) as stub:
        def prefill(request_id: str) -> int:
            return stub.Prefill(pb.VerifierPrefillRequest(request_id=request_id, token_ids=prompt(5),
                                                          sampling=params_to_pb(params), max_len=64)).next_token

        first = prefill("decoded")
        assert prefill("verified") == first
        rounds = list(stub.Decode(pb.DecodeRequest(request_id="decoded", token_ids=[*prompt(5), first],
                                                   drafter="none", max_tokens=6, candidates=3)))
        assert len(rounds) == 6
        for resp in rounds:
            want = stub.Verify(pb.VerifyRequest(request_id="verified", candidates=3))
            assert resp.bonus == want.bonus and len(resp.candidate_ids) == 3
            assert list(resp.candidate_ids) == list(want.candidate_ids)
            assert list(resp.candidate_probs) == pytest.approx(list(want.candidate_probs))


def test_after_decode_the_request_goes_on_and_a_cancelled_decode_stops(tiny):
    params = SamplingParams(max_tokens=40)
    want = single_run(tiny, prompt(3), params)
    with served(VerifierEngine(tiny, max_len=64)) as stub:
        first = stub.Prefill(pb.VerifierPrefillRequest(request_id="r", token_ids=prompt(3),
                                                       sampling=params_to_pb(params), max_len=64)).next_token
        tokens = [first]
        for resp in stub.Decode(pb.DecodeRequest(request_id="r", token_ids=[*prompt(3), first], drafter="pld",
                                                 draft_length=DRAFT_LENGTH, max_tokens=3)):
            tokens += [*resp.accepted, resp.bonus]
        assert 2 <= len(tokens) <= 4  # it stopped after 3 new tokens at most
        rounds = list(stub.Decode(pb.DecodeRequest(request_id="r", token_ids=[*prompt(3), *tokens], drafter="pld",
                                                   draft_length=DRAFT_LENGTH, max_tokens=30, max_rounds=2)))
        assert len(rounds) == 2  # ... and after 2 rounds
        tokens += [t for r in rounds for t in [*r.accepted, r.bonus]]
        while len(tokens) < 20:  # Verify takes the request over where Decode left it
            resp = stub.Verify(pb.VerifyRequest(request_id="r", context_length=len(prompt(3)) + len(tokens)))
            assert not resp.state_lost
            tokens += [*resp.accepted, resp.bonus]
        call = stub.Decode(pb.DecodeRequest(request_id="r", token_ids=[*prompt(3), *tokens], drafter="pld",
                                            draft_length=DRAFT_LENGTH, max_tokens=10**6))
        resp = next(call)
        call.cancel()
        assert tokens + [*resp.accepted, resp.bonus] == want[:len(tokens) + len(resp.accepted) + 1]
        assert stub.Release(pb.ReleaseRequest(request_id="r")).released


def test_a_decode_call_drafts_only_its_first_drafted_rounds(tiny):
    """`drafted_rounds` 1 (an adaptive caller's probe): the call's first round is drafted by
    prompt lookup over a text that repeats itself, the rest verify their bonus token alone;
    the tokens are the target's either way."""
    params = SamplingParams(max_tokens=40)
    out = single_run(tiny, prompt(6), params)
    # the prompt and as much of its output as puts prompt lookup's first draft right after it
    cut = next(m for m in range(len(out)) if len(lookup_draft(prompt(6) + out[:m + 1], DRAFT_LENGTH,
                                                               tiny.config.vocab_size, True)))
    text, want = prompt(6) + out[:cut], out[cut:]
    with served(VerifierEngine(tiny, max_len=64)) as stub:
        def rounds(request_id: str, drafted_rounds: int) -> list[pb.VerifyResponse]:
            first = stub.Prefill(pb.VerifierPrefillRequest(request_id=request_id, token_ids=text,
                                                           sampling=params_to_pb(params), max_len=64)).next_token
            return list(stub.Decode(pb.DecodeRequest(request_id=request_id, token_ids=[*text, first], drafter="pld",
                                                     draft_length=DRAFT_LENGTH, max_tokens=12, max_rounds=6,
                                                     drafted_rounds=drafted_rounds))), first

        drafted, first = rounds("all", 0)
        probed, again = rounds("probe", 1)
    assert [r.drafted > 0 for r in probed] == [True] + [False] * 5, [r.drafted for r in probed]
    assert sum(r.drafted > 0 for r in drafted) > 1, [r.drafted for r in drafted]  # 0: every round drafts
    for start, out in ((first, drafted), (again, probed)):
        tokens = [start] + [t for r in out for t in [*r.accepted, r.bonus]]
        assert tokens == want[:len(tokens)]


def test_decode_rounds_are_in_every_pass_while_they_last(tiny):
    """The engine queues each of a Decode call's rounds as the last one's pass ends
    (`VerifierEngine.verify_rounds`), so two requests decoding at once share every pass from the
    first both are in until one ends, with no wait for batches: a caller sending each round itself
    would miss passes that start before it comes back (a 1 between 2s). When the second joins
    depends on thread scheduling, so only the shape is asserted."""
    params = SamplingParams(max_tokens=60)
    engine = VerifierEngine(tiny, max_len=96, batch_wait_s=0.0)
    sizes = {"a": [], "b": []}
    both_prefilled = threading.Barrier(2)

    def decode(request_id: str) -> None:
        engine.prefill(request_id, prompt(3), params)
        left = iter(range(29))
        def next_tree(_) -> DraftTree | None:
            return None if next(left, None) is None else DraftTree()

        both_prefilled.wait(timeout=60)
        for out in engine.verify_rounds(request_id, DraftTree(), None, next_tree):
            sizes[request_id].append(out.batch_size)

    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(decode, sizes))
        shapes = {}
        for request_id, batch_sizes in sizes.items():
            assert len(batch_sizes) == 30 and set(batch_sizes) <= {1, 2}, (request_id, batch_sizes)
            alone_before = batch_sizes.index(2) if 2 in batch_sizes else 30
            shared = next((n for n, size in enumerate(batch_sizes[alone_before:]) if size == 1), 30 - alone_before)
            alone_after = 30 - alone_before - shared
            # alone, then in every pass with the other, then alone: never a lone pass between shared ones
            assert batch_sizes == [1] * alone_before + [2] * shared + [1] * alone_after, (request_id, batch_sizes)
            shapes[request_id] = (alone_before, shared, alone_after)
        (a_before, a_shared, a_after), (b_before, b_shared, b_after) = shapes.values()
        assert a_shared == b_shared >= 1, shapes  # they met, and shared the same passes
        assert {a_before, b_before} == {0, a_before + b_before} and a_before + b_before == a_after + b_after, shapes
    finally:
        engine.close()


def invalid(call, request, field: str) -> str:
    """The details of the INVALID_ARGUMENT error `call(request)` must raise; they name `field`."""
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith(f"{field}: "), info.value.details()
    return info.value.details()


def test_bad_input_is_invalid_argument_naming_the_field(tiny):
    greedy = params_to_pb(SamplingParams(max_tokens=4))

    def prefill(request_id: str, tokens: list[int], sampling: pb.SamplingParams = greedy, max_len: int | None = None):
        return pb.VerifierPrefillRequest(request_id=request_id, token_ids=tokens, sampling=sampling, max_len=max_len)

    def verify(tree: pb.DraftTree, request_id: str = "ok") -> pb.VerifyRequest:
        return pb.VerifyRequest(request_id=request_id, tree=tree)

    with served(VerifierEngine(tiny, max_batch=3, max_len=64, max_batch_tokens=16)) as stub:
        first = stub.Prefill(prefill("ok", [1, 2, 3])).next_token
        assert "parent" in invalid(stub.Verify, verify(pb.DraftTree(tokens=[1, 2], parents=[-1, 1])), "tree")
        assert "vocabulary" in invalid(stub.Verify, verify(pb.DraftTree(tokens=[99], parents=[-1])), "tree")
        assert "budget" in invalid(stub.Verify, verify(tree_to_pb(DraftTree.chain([1] * 16))), "tree")
        invalid(stub.Prefill, prefill("e", []), "token_ids")
        invalid(stub.Prefill, prefill("e", [1, 8]), "token_ids")
        invalid(stub.Prefill, prefill("e", [1], pb.SamplingParams(max_tokens=4, temperature=1.0, top_p=2.0)), "top_p")
        invalid(stub.Prefill, prefill("e", [1], max_len=65), "max_len")
        invalid(stub.Prefill, prefill("e", [1], max_len=0), "max_len")  # set, 0 is a value, and too few
        resumed = prefill("e", [1])
        resumed.resumed = -1
        invalid(stub.Prefill, resumed, "resumed")

        # unseeded sampling (rejection sampling) needs every draw's q, a distribution over the vocabulary
        stub.Prefill(prefill("s", [1, 2], params_to_pb(replace(SAMPLED, seed=None))))
        chain = tree_to_pb(DraftTree.chain([3, 4]))
        invalid(stub.Verify, verify(chain, "s"), "tree.draw_q")
        chain.draw_q.extend([pb.SparseDist(ids=[3], probs=[1.0]), pb.SparseDist(ids=[99], probs=[1.0])])
        invalid(stub.Verify, verify(chain, "s"), "tree.draw_q")
        chain.draw_q[1].ids[0] = 5  # token 4 drawn from a q that cannot give it
        invalid(stub.Verify, verify(chain, "s"), "tree.draw_q")

        # unknown requests lose their state rather than fail; a full verifier is exhausted
        assert stub.Verify(verify(pb.DraftTree(), "nobody")).state_lost
        stub.Prefill(prefill("b", [1]))
        with pytest.raises(grpc.RpcError) as info:
            stub.Prefill(prefill("c", [1]))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        def decode(**fields) -> pb.DecodeRequest:
            return pb.DecodeRequest(**{"request_id": "ok", "token_ids": [1, 2, 3, first], "drafter": "pld",
                                       "draft_length": 4, "max_tokens": 2, **fields})

        stream = lambda request: list(stub.Decode(request))  # noqa: E731
        assert "pld" in invalid(stream, decode(drafter="layerskip"), "drafter")
        invalid(stream, decode(drafter="suffix", max_nodes=-1), "max_nodes")
        invalid(stream, decode(drafter="suffix", max_nodes=16), "max_nodes")
        invalid(stream, decode(drafter="suffix", namespace="no spaces"), "namespace")
        invalid(stream, decode(draft_length=-1), "draft_length")
        invalid(stream, decode(draft_length=16), "draft_length")
        invalid(stream, decode(max_tokens=0), "max_tokens")
        invalid(stream, decode(max_rounds=-1), "max_rounds")
        invalid(stream, decode(drafted_rounds=-1), "drafted_rounds")
        invalid(stream, decode(token_ids=[]), "token_ids")
        invalid(stream, decode(token_ids=[1, 8]), "token_ids")
        invalid(stream, decode(candidates=4), "candidates")  # a pld round's tree is unknown to the caller
        invalid(stream, decode(drafter="none", candidates=-1), "candidates")
        assert [r.state_lost for r in stream(decode(request_id="nobody"))] == [True]
        assert [r.state_lost for r in stream(decode(token_ids=[1, 2, first]))] == [True]  # not what it holds

        # none of that disturbed the request that was going on
        resp = stub.Verify(verify(pb.DraftTree()))
        assert not resp.state_lost
        assert [first, resp.bonus] == single_run(tiny, [1, 2, 3], SamplingParams(max_tokens=2))


def test_new_verifier_resumes_from_the_checkpoint(tiny):
    want = single_run(tiny, prompt(5), SAMPLED)
    store = EmbeddedStateStore()
    with served(VerifierEngine(tiny, max_len=64, checkpoints=store)) as stub:
        assert stub.Verify(pb.VerifyRequest(request_id="nobody")).state_lost  # no checkpoint either
        remote = Remote(stub, "r", prompt(5), SAMPLED, tiny)
        for _ in range(3):
            remote.step()
        assert not remote.done
    # that verifier is gone; a new one with the same store takes the request over
    with served(VerifierEngine(tiny, max_len=64, checkpoints=store)) as stub:
        remote.stub = stub
        assert remote.run() == want
        assert stub.Release(pb.ReleaseRequest(request_id="r")).released
        # checkpoints are written (and deleted) in the background, off the verify path
        deadline = time.monotonic() + 5
        while store.load_checkpoint("r") is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.load_checkpoint("r") is None
        assert stub.Verify(pb.VerifyRequest(request_id="r")).state_lost


class CountingStore(EmbeddedStateStore):
    """Counts checkpoint writes."""

    saves = 0

    def save_checkpoint(self, *args, **kwargs) -> None:
        self.saves += 1
        super().save_checkpoint(*args, **kwargs)


def test_checkpoints_are_written_once_an_interval_and_the_latest_goes_with_the_verifier(tiny):
    """Rounds within one interval coalesce into one write; a verifier that goes away writes
    what is pending, so a new one resumes at the last round, exactly."""
    want = single_run(tiny, prompt(5), SAMPLED)
    store = CountingStore()
    with served(VerifierEngine(tiny, max_len=64, checkpoints=store, checkpoint_interval_s=30.0)) as stub:
        remote = Remote(stub, "r", prompt(5), SAMPLED, tiny)
        for _ in range(6):
            remote.step()
        assert not remote.done
        time.sleep(0.2)
        assert store.saves == 1  # the prefill's: the writer waits out its interval
    assert store.saves == 2  # the engine's close wrote the latest
    engine = VerifierEngine(tiny, max_len=64, checkpoints=store, checkpoint_interval_s=30.0)
    with served(engine) as stub:
        remote.stub = stub
        assert remote.run() == want  # no state lost: the checkpoint held the sixth round
        # a released request's checkpoint goes at once, interval or not
        assert stub.Release(pb.ReleaseRequest(request_id="r")).released
        deadline = time.monotonic() + 5
        while store.load_checkpoint("r") is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.load_checkpoint("r") is None and time.monotonic() < deadline - 4


def test_failed_pass_fails_its_requests_which_resume_from_checkpoints(tiny, monkeypatch):
    greedy = SamplingParams(max_tokens=30)
    cases = [("r", prompt(4), SAMPLED), ("c", prompt(5), replace(SAMPLED, seed=12)),  # rows 0-3
             ("idle", prompt(6), greedy), ("d", prompt(8), greedy)]
    real, calls = batching.verify_greedy, []  # seeded sampling is keyed: verified as greedy is

    def fail_at_row_1(*args):
        # after the forward wrote rows 0-3, row 0 was verified, and before
        # rows 2 and 3 were cut back: the worst moment
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real(*args)

    engine = VerifierEngine(tiny, max_len=64, batch_wait_s=0.2, checkpoints=EmbeddedStateStore())
    with served(engine) as stub, ThreadPoolExecutor(len(cases)) as pool:
        remotes = [Remote(stub, name, ids, params, tiny) for name, ids, params in cases]
        for remote in remotes:
            remote.step()
        monkeypatch.setattr(batching, "verify_greedy", fail_at_row_1)
        in_pass = [remotes[0], remotes[1], remotes[3]]  # one pass; "idle" is not in it
        for step in [pool.submit(remote.step) for remote in in_pass]:
            with pytest.raises(grpc.RpcError, match="device lost"):
                step.result()

        def finish(remote: Remote) -> list[int]:
            remote.run()
            stub.Release(pb.ReleaseRequest(request_id=remote.request_id))  # no pass waits for it any more
            return remote.tokens

        for tokens, (name, ids, params) in zip(pool.map(finish, remotes), cases):
            assert tokens == single_run(tiny, ids, params), name


def test_health_and_reflection(tiny):
    engine = VerifierEngine(tiny, max_len=64)
    server, port = serve(engine)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE_NAME):
                status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
                assert status == health_pb2.HealthCheckResponse.SERVING
            reflected = ProtoReflectionDescriptorDatabase(channel)
            assert SERVICE_NAME in reflected.get_services()
            service = descriptor_pool.DescriptorPool(reflected).FindServiceByName(SERVICE_NAME)
            assert {"Prefill", "Verify", "Release", "Stats"} <= set(service.methods_by_name)
    finally:
        server.stop(None)
        engine.close()


def test_verify_with_a_stale_context_length_is_state_lost_not_a_wrong_round(tiny):
    """A retried Verify (its first answer lost) must not verify on top of the state it already moved."""
    with served(VerifierEngine(tiny, max_batch=2, max_len=32)) as stub:
        stub.Prefill(pb.VerifierPrefillRequest(request_id="r", token_ids=[1, 2, 3],
                                               sampling=pb.SamplingParams(max_tokens=8), max_len=16))
        ok = stub.Verify(pb.VerifyRequest(request_id="r", tree=pb.DraftTree(), context_length=4))
        assert not ok.state_lost
        retried = stub.Verify(pb.VerifyRequest(request_id="r", tree=pb.DraftTree(), context_length=4))
        assert retried.state_lost
        assert not stub.Verify(pb.VerifyRequest(request_id="r", tree=pb.DraftTree(), context_length=5)).state_lost


def test_idle_requests_are_dropped(tiny):
    """A request whose router went away must not hold its row for ever."""
    now = [0.0]
    with served(VerifierEngine(tiny, max_batch=1, max_len=32, idle_timeout_s=60, clock=lambda: now[0])) as stub:
        sp = pb.SamplingParams(max_tokens=4)
        stub.Prefill(pb.VerifierPrefillRequest(request_id="gone", token_ids=[1, 2], sampling=sp, max_len=8))
        with pytest.raises(grpc.RpcError) as info:  # its row is the only one
            stub.Prefill(pb.VerifierPrefillRequest(request_id="new", token_ids=[1], sampling=sp, max_len=8))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        now[0] = 61.0
        stub.Prefill(pb.VerifierPrefillRequest(request_id="new", token_ids=[1], sampling=sp, max_len=8))
        assert stub.Verify(pb.VerifyRequest(request_id="gone", tree=pb.DraftTree())).state_lost
