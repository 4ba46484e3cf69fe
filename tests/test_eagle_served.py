"""The eagle drafter served, in both placements (`[router] eagle_placement`).

- "pool": the verifier answers the target's features of each verified position (float16,
  VerifyResponse.features) and the router hands them to a pool's eagle drafter in its
  Propose. Driven call by call over gRPC, the pool's head proposes exactly what the
  in-process head (speculative.eagle) proposes given the same features, round by round;
  the features are a whole-sequence forward's at the same positions (float16 rounding).
- Greedy output through the router equals Hugging Face's in both placements, eagle alone
  and fused with the lookup drafters; "verifier" never calls a pool (the Decode rounds
  draft there, fused as in process), "pool" sends the pool features.
- A pool that dies, or loses the request's state, mid-request: the next pool (or the same
  one, prefilled again) is sent every position's features from 0, drafts again, and the
  output is still the oracle's.
- A bad GenerateRequest.eagle_placement is INVALID_ARGUMENT naming the field.
- Sampled, in both placements: seeded (keyed sampling, a function of the seed alone) the
  tokens are Hugging Face's keyed choices and the served plain decoding's with that seed;
  unseeded (multi-draft speculative sampling on the head's draft distributions) a request
  completes with valid tokens and sane acceptance counts.
- Fused on the verifier (eagle+pld+suffix, Decode rounds), each member is credited its own
  tree's nodes and its share of the accepted path (VerifyResponse.member_drafted /
  member_accepted), as a pool round credits them, not the whole tree to eagle.
- Adaptive, a pinned eagle request whose head would not draft at all at the load it starts
  at (by what the head last cost there) is served without it: no features captured, the
  prefix cache taken.
- Over the OpenAI-compatible HTTP API (deploy/openai_api.py, through tests/http_front.py):
  `eagle_placement` picks the placement (a pool is sent features only for "pool"), both
  give plain decoding's greedy text, and a bad value is a 400 naming the field.

Real gRPC servers on loopback (tests/loopback.py), the default target and the shipped head.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from drafter_service.pool import DrafterPool
from drafter_service.registry import make_drafter
from drafter_service.servicer import serve as serve_drafters
from http_front import http_front, post_json
from loopback import loopback
from oracle import GREEDY_PROMPTS, MAX_TOKENS, PROMPTS, hf_keyed, keyed_near_tie_or_equal, near_tie_or_equal
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from protos.convert import features_from_pb, params_to_pb, tree_from_pb, tree_to_pb
from router.adaptive import SpeculationControl
from router.coordinator import Coordinator, Job
from router.servicer import RouterConfig, RouterServicer
from router.servicer import serve as serve_router
from router.stats import RoundStats
from runtime.model import attention_mask, causal_ancestors
from specserve.client import Client
from speculative.decoding import DraftRequest
from speculative.drafter_kinds import eagle_feature_layers
from speculative.sampling import SamplingParams
from verifier_service.engine import VerifierEngine

DRAFT_LENGTH, TREE_BUDGET = 5, 8
KINDS = ["eagle", "pld", "suffix"]
# seeded sampling: one prompt, a few dozen tokens
SAMPLED_PROMPT, SAMPLED_TOKENS = 1, 24
SAMPLED = SamplingParams(max_tokens=SAMPLED_TOKENS, temperature=0.8, top_p=0.95, seed=7)


def background_jobs(item) -> list[tuple]:
    """The oracle's keyed answer, computed while the servers start (tests/conftest.py)."""
    if item.originalname == "test_seeded_sampling_is_keyed_hf_and_plain_decoding_in_both_placements":
        return [(hf_keyed, SAMPLED_PROMPT, SAMPLED, SAMPLED_TOKENS)]
    return []


class RecordingPool(DrafterPool):
    """A pool that records each Propose: how many feature rows it was sent, from which
    position, and how many nodes it answered."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (features_start, rows, nodes proposed; None: answered state_lost)
        self.calls: list[tuple[int, int, int | None]] = []

    def propose(self, *args, features=None, **kwargs):
        tree = super().propose(*args, features=features, **kwargs)
        start, rows = (features[0], len(features[1])) if features is not None else (-1, 0)
        self.calls.append((start, rows, None if tree is None else len(tree)))
        return tree


class Served:
    def __init__(self, model, tokenizer, pool, coordinator, router: str, engine: VerifierEngine):
        self.model, self.tokenizer, self.pool, self.coordinator = model, tokenizer, pool, coordinator
        self.engine = engine
        self.router = router
        self.client = Client(router, timeout=300)
        self.eos = list(tokenizer.eos_token_ids or model.config.eos_token_ids)
        self.verifier = coordinator.services.verifiers()[0]
        self.drafters = coordinator.services.drafters()[0]


@pytest.fixture(scope="module")
def served(smollm2):
    """A router over one pool (eagle, pld, suffix) and one verifier, all on loopback, shared
    by this module's tests."""
    model, tokenizer = smollm2
    pool, engine = RecordingPool(model, kinds=KINDS), VerifierEngine(model, max_batch=4, max_len=2048)
    config = RouterConfig(context_length=model.config.max_position_embeddings,
                          eos_token_ids=list(tokenizer.eos_token_ids or model.config.eos_token_ids),
                          vocab_size=model.config.vocab_size, routed_drafters=tuple(KINDS), default_drafter="eagle",
                          draft_length=DRAFT_LENGTH, tree_budget=TREE_BUDGET, adaptive=False, pipelined=False,
                          stop_confidence=0.0)
    with loopback(pool, engine) as coordinator:
        router, port = serve_router(RouterServicer(tokenizer, coordinator, config), "127.0.0.1", 0)
        done = Served(model, tokenizer, pool, coordinator, f"127.0.0.1:{port}", engine)
        try:
            yield done
        finally:
            done.client.close()
            router.stop(None)


def _prompt_ids(tokenizer, i: int) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": PROMPTS[i][1]}])


def test_the_pools_head_fed_over_grpc_proposes_what_the_in_process_head_proposes(served):
    """Round by round over gRPC: the verifier's features (prefill, then each verdict) go to the
    pool's eagle drafter in Propose and to an in-process EagleDrafter alike; their trees are
    the same, and the features are a whole-sequence forward's at those positions."""
    model = served.model
    layers = list(eagle_feature_layers("eagle"))
    prompt = _prompt_ids(served.tokenizer, 1)
    params = SamplingParams(max_tokens=64)
    verifier = pb_grpc.VerifierStub(grpc.insecure_channel(served.verifier))
    pool = pb_grpc.DrafterStub(grpc.insecure_channel(served.drafters))
    rid = "eagle-rounds"
    first = verifier.Prefill(pb.VerifierPrefillRequest(request_id=rid, token_ids=prompt, sampling=params_to_pb(params),
                                                       max_len=len(prompt) + 128, feature_layers=layers), timeout=60)
    assert (first.features_start, first.features_count) == (0, len(prompt))
    assert len(first.features) == len(prompt) * len(layers) * model.config.hidden_size * 2  # float16
    context = prompt + [first.next_token]
    pool.Prefill(pb.DrafterPrefillRequest(request_id=rid, drafter="eagle", token_ids=context,
                                          sampling=params_to_pb(params)), timeout=60)
    local = make_drafter("eagle", model)
    features, synced, answer, accepted = [features_from_pb(first)], len(context), first, 0
    try:
        for _ in range(8):
            fed = features_from_pb(answer)
            req = pb.ProposeRequest(request_id=rid, context_length=synced, new_tokens=context[synced:],
                                    max_tokens=DRAFT_LENGTH, max_nodes=TREE_BUDGET, features=answer.features,
                                    features_start=answer.features_start, features_count=answer.features_count)
            proposed = pool.Propose(req, timeout=60)
            assert not proposed.state_lost
            synced = len(context)
            tree = tree_from_pb(proposed.tree, model.config.vocab_size)
            want = local.propose(DraftRequest(list(context), DRAFT_LENGTH, params, max_nodes=TREE_BUDGET,
                                              features=fed))
            assert (tree.tokens, tree.parents) == (want.tokens, want.parents)
            assert len(tree)  # the head drafts: it has every position's features
            answer = verifier.Verify(pb.VerifyRequest(request_id=rid, tree=tree_to_pb(tree),
                                                      context_length=len(context), feature_layers=layers), timeout=60)
            assert (answer.features_start, answer.features_count) == (len(context) - 1, 1 + len(answer.accepted))
            features.append(features_from_pb(answer))
            accepted += len(answer.accepted)
            context += [*answer.accepted, answer.bonus]
    finally:
        verifier.Release(pb.ReleaseRequest(request_id=rid), timeout=10)
        pool.Release(pb.ReleaseRequest(request_id=rid), timeout=10)
    assert accepted > 0
    # the verifier's features at every verified position (batched, paged passes, only the
    # capturing row's tokens copied out) are a whole-sequence forward's there
    n = features[-1][0] + len(features[-1][1])
    got = torch.cat([rows for _, rows in features])
    assert [start for start, _ in features] == [0] + [start + len(rows) for start, rows in features[:-1]]
    _, whole = model(torch.tensor([context[:n]]), torch.arange(n)[None], model.new_cache(n),
                     attention_mask(0, causal_ancestors(n)), capture=layers)
    assert torch.allclose(got, whole[0].half().float(), rtol=4e-3, atol=2e-2)


@pytest.mark.parametrize("placement", ["verifier", "pool"])
def test_greedy_equals_hugging_face_in_both_placements(served, hf_oracle, placement):
    """Every dev category's first prompt, eagle alone; the first two fused with the lookups too."""
    runs = [(i, "eagle") for i in range(GREEDY_PROMPTS)] + [(0, "eagle+pld+suffix")]
    for i, drafter in runs:
        calls = len(served.pool.calls)
        done = served.client.generate(messages=[{"role": "user", "content": PROMPTS[i][1]}], max_tokens=MAX_TOKENS,
                                      drafter=drafter, eagle_placement=placement, namespace=f"oracle-{placement}")
        near_tie_or_equal(hf_oracle, i, list(done.token_ids), f"served {drafter}@{placement}")
        assert done.usage.accepted_draft_tokens > 0
        eagle_calls = [c for c in served.pool.calls[calls:] if c[0] >= 0]
        if placement == "verifier":  # drafted beside the target: no feature crossed the network
            assert not eagle_calls and done.usage.target_forward_passes < len(done.token_ids)
        else:  # the first Propose is sent the prompt's features, then each round's
            assert eagle_calls and eagle_calls[0][0] == 0 and eagle_calls[0][1] >= done.usage.prompt_tokens
            assert any(nodes for _, _, nodes in eagle_calls)


@pytest.mark.parametrize("failure", ["pool dies", "pool loses the request"])
def test_a_pool_failover_mid_request_keeps_the_head_drafting_and_the_output_the_oracles(served, hf_oracle, failure):
    """Placement "pool" across two pools: after its third Propose the first pool's server stops
    (or it forgets its requests); the request goes on at the second pool (or the first, prefilled
    again), which is sent every position's features from 0 and drafts from them."""
    model = served.model
    first, second = RecordingPool(model, kinds=KINDS), RecordingPool(model, kinds=KINDS)
    (first_server, first_port), (second_server, second_port) = serve_drafters(first), serve_drafters(second)
    propose = first.propose

    def failing(*args, **kwargs):
        tree = propose(*args, **kwargs)
        if len(first.calls) == 3:
            if failure == "pool dies":
                threading.Thread(target=first_server.stop, args=(None,)).start()
            else:
                first._requests.clear()
        return tree

    first.propose = failing
    coordinator = Coordinator(verifiers=served.coordinator.services.verifiers,
                              drafters=lambda: [f"127.0.0.1:{first_port}", f"127.0.0.1:{second_port}"])
    i = 2
    job = Job(request_id="failover", prompt_ids=_prompt_ids(served.tokenizer, i),
              params=SamplingParams(max_tokens=MAX_TOKENS), drafters=(("eagle", 1.0),), draft_length=DRAFT_LENGTH,
              tree_budget=TREE_BUDGET, vocab_size=model.config.vocab_size, eos_token_ids=served.eos,
              eagle_placement="pool")
    try:
        stats = RoundStats()
        tokens = [t for new in coordinator.run(job, stats) for t in new]
    finally:
        coordinator.services.channels.close()
        first_server.stop(None)
        second_server.stop(None)
    near_tie_or_equal(hf_oracle, i, tokens, f"eagle@pool, {failure}")
    after = [c for c in (second.calls if failure == "pool dies" else first.calls[3:]) if c[2] is not None]
    assert len(first.calls) >= 3 and after, (first.calls, second.calls)
    # prefilled again: the whole feature history from position 0, then the head drafts again
    assert after[0][0] == 0 and after[0][1] >= len(job.prompt_ids), after[0]
    assert any(nodes for _, _, nodes in after)


def test_a_bad_eagle_placement_is_invalid_argument_naming_the_field(served):
    stub = pb_grpc.SpecserveStub(grpc.insecure_channel(served.router))
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(pb.GenerateRequest(prompt="Hi", drafter="eagle", eagle_placement="gpu",
                                         sampling=pb.SamplingParams(max_tokens=4)), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("eagle_placement"), err.value.details()


def test_a_fused_decode_round_credits_each_member_its_own_share(served, hf_oracle):
    """The same request twice in one namespace, eagle fused with the lookups on the verifier:
    the second time the verifier's suffix index holds the first output, so suffix drafts it.
    Each member is credited its own nodes and accepted prefix: every round's accepted path
    lies in some member's tree (summed, the members hold at least every accepted token, and
    none more than there were), and the fused tree has no node no member proposed."""
    i, kinds = 0, ("eagle", "pld", "suffix")
    prompt = _prompt_ids(served.tokenizer, i)
    coordinator = Coordinator(verifiers=served.coordinator.services.verifiers,
                              drafters=served.coordinator.services.drafters)
    try:
        for run in range(2):
            calls = len(served.pool.calls)
            job = Job(request_id=f"credit-{run}", prompt_ids=prompt, params=SamplingParams(max_tokens=MAX_TOKENS),
                      drafters=tuple((k, 1.0) for k in kinds), draft_length=DRAFT_LENGTH, tree_budget=TREE_BUDGET,
                      vocab_size=served.model.config.vocab_size, eos_token_ids=served.eos, namespace="member-credit",
                      verifier_drafting=True, eagle_placement="verifier")
            stats = RoundStats()
            tokens = [t for new in coordinator.run(job, stats) for t in new]
            near_tie_or_equal(hf_oracle, i, tokens, f"eagle+pld+suffix on the verifier, run {run}")
            drafted = [c for c in served.pool.calls[calls:] if c[0] >= 0 or c[2]]  # (suffix learns: 0 nodes)
            assert not drafted, f"Decode rounds: the pool drafts nothing, {drafted}"
            own = {k: (s.proposed, s.accepted) for k, s in stats.per_drafter.items()}
            assert set(own) == set(kinds), own
            assert stats.accepted_draft_tokens > 0 and own["eagle"][1] > 0, own
            assert all(accepted <= stats.accepted_draft_tokens for _, accepted in own.values()), own
            assert sum(accepted for _, accepted in own.values()) >= stats.accepted_draft_tokens, own
            assert sum(proposed for proposed, _ in own.values()) >= stats.draft_tokens, (own, stats.draft_tokens)
        # the second run: suffix knew the first's output, and earned its share of it
        assert own["suffix"][0] > 0 and own["suffix"][1] > 0, own
    finally:
        coordinator.services.channels.close()


def test_decode_rounds_teach_the_control_what_the_eagle_head_costs(served, hf_oracle):
    """Adaptive eagle on the verifier: each Decode round reports the seconds the verifier spent
    drafting its tree, and the request's control learns the head's cost a level from them
    (it weighs it under load, test_adaptive); the tokens are the oracle's."""
    i = 1
    control = SpeculationControl(DRAFT_LENGTH, prior=0.6)
    job = Job(request_id="eagle-cost", prompt_ids=_prompt_ids(served.tokenizer, i),
              params=SamplingParams(max_tokens=MAX_TOKENS), drafters=(("eagle", 1.0),), draft_length=DRAFT_LENGTH,
              tree_budget=TREE_BUDGET, vocab_size=served.model.config.vocab_size, eos_token_ids=served.eos,
              speculation=control, verifier_drafting=True, eagle_placement="verifier")
    stats = RoundStats()
    tokens = [t for new in served.coordinator.run(job, stats) for t in new]
    near_tie_or_equal(hf_oracle, i, tokens, "adaptive eagle on the verifier")
    assert stats.draft_tokens > 0, "the head drafted nothing"
    # a level of the head: more than nothing, less than a whole target pass
    assert 0.0 < control.draft_token_cost < 1.0, control.draft_token_cost


def test_an_eagle_request_whose_head_would_not_draft_at_its_load_is_served_without_it(served, hf_oracle):
    """Adaptive lengths, eagle on the verifier: a pinned request leaves its head out when, at
    the load it starts at and by what the head last cost there (the coordinator's draft-cost
    memory), the head would not draft at all. It is served by the lookups it is fused with, or
    plainly, and takes the prefix cache (a request with a head computes every position for its
    features); with the head cheap again, the head drafts. The tokens are the oracle's each time."""
    model, tokenizer, i = served.model, served.tokenizer, 2
    config = RouterConfig(context_length=model.config.max_position_embeddings, eos_token_ids=served.eos,
                          vocab_size=model.config.vocab_size, routed_drafters=tuple(KINDS), default_drafter="eagle",
                          draft_length=DRAFT_LENGTH, tree_budget=TREE_BUDGET, adaptive=True, pipelined=False,
                          eagle_placement="verifier", verifier_drafting=True)
    router, port = serve_router(RouterServicer(tokenizer, served.coordinator, config), "127.0.0.1", 0)
    client = Client(f"127.0.0.1:{port}", timeout=300)
    memory = served.coordinator.draft_costs

    def generate(drafter: str):
        hits = served.engine.kv_stats()["prefix_cache_hits"]
        done = client.generate(messages=[{"role": "user", "content": PROMPTS[i][1]}], max_tokens=MAX_TOKENS,
                               drafter=drafter, namespace="idle-head")
        near_tie_or_equal(hf_oracle, i, list(done.token_ids), f"adaptive {drafter} on the verifier")
        return done.usage, served.engine.kv_stats()["prefix_cache_hits"] - hits

    try:
        assert generate("none")[1] == 0  # the namespace's first request: nothing cached
        memory.remember(SpeculationControl(DRAFT_LENGTH, draft_token_cost=5.0), "eagle", 1)  # a level: 5 passes
        usage, hits = generate("eagle")
        assert usage.drafter == "none" and hits > 0, (usage.drafter, hits)
        usage, hits = generate("eagle+pld+suffix")
        assert usage.drafter == "pld+suffix" and hits > 0, (usage.drafter, hits)
        memory.remember(SpeculationControl(DRAFT_LENGTH, draft_token_cost=0.02), "eagle", 1)
        usage, hits = generate("eagle")
        assert usage.drafter == "eagle" and usage.accepted_draft_tokens > 0 and hits == 0, (usage, hits)
    finally:
        client.close()
        router.stop(None)


def _sampled(served, placement: str | None, drafter: str = "eagle", seed: int | None = SAMPLED.seed, **extra):
    """A sampled request of SAMPLED_PROMPT through the router, and the eagle Proposes (those
    sent features) it cost the pool."""
    calls = len(served.pool.calls)
    done = served.client.generate(messages=[{"role": "user", "content": PROMPTS[SAMPLED_PROMPT][1]}],
                                  max_tokens=SAMPLED_TOKENS, temperature=SAMPLED.temperature, top_p=SAMPLED.top_p,
                                  seed=seed, drafter=drafter, eagle_placement=placement or "",
                                  namespace=f"sampled-{placement}", **extra)
    return done, [c for c in served.pool.calls[calls:] if c[0] >= 0]


def test_seeded_sampling_is_keyed_hf_and_plain_decoding_in_both_placements(served, hf_oracle):
    """Keyed sampling makes the tokens a function of the seed alone: served eagle, in either
    placement and fused with the lookups, gives Hugging Face's keyed choices and the served
    plain decoding's (no speculation) for the same seed."""
    plain, _ = _sampled(served, None, drafter="none", draft_length=0)
    assert plain.usage.draft_tokens == 0
    keyed_near_tie_or_equal(hf_oracle, SAMPLED_PROMPT, SAMPLED, list(plain.token_ids), "served plain, seeded")
    for placement, drafter in [("verifier", "eagle"), ("pool", "eagle"), ("verifier", "eagle+pld+suffix")]:
        label = f"served {drafter}@{placement}, seeded"
        done, fed = _sampled(served, placement, drafter)
        tie = keyed_near_tie_or_equal(hf_oracle, SAMPLED_PROMPT, SAMPLED, list(done.token_ids), label)
        assert list(done.token_ids) == list(plain.token_ids) or tie, label
        assert done.usage.accepted_draft_tokens > 0, (label, done.usage)
        assert bool(fed) == (placement == "pool"), (label, fed)


@pytest.mark.parametrize("placement", ["verifier", "pool"])
def test_unseeded_sampling_completes_with_valid_tokens_and_sane_acceptance(served, placement):
    """Unseeded, verification is speculative sampling on the head's draft distributions (no
    oracle of one draw: the distribution tests are in process, tests/test_sampling_distribution.py).
    Served, the request completes; its tokens are the vocabulary's and its text theirs; each
    target pass yields its accepted drafts plus one, never more drafts than were verified."""
    done, fed = _sampled(served, placement, seed=None)
    ids, usage = list(done.token_ids), done.usage
    assert done.finish_reason in ("stop", "length") and 0 < len(ids) <= SAMPLED_TOKENS
    assert len(ids) == SAMPLED_TOKENS or ids[-1] in served.eos, ids
    assert all(0 <= t < served.model.config.vocab_size for t in ids)
    assert done.text == served.tokenizer.decode(ids), (done.text, ids)
    assert usage.completion_tokens == len(ids)
    assert 0 <= usage.accepted_draft_tokens <= usage.draft_tokens and usage.draft_tokens > 0, usage
    assert usage.target_forward_passes + usage.accepted_draft_tokens == len(ids), usage
    assert bool(fed) == (placement == "pool"), fed


def _post(url: str, body: dict) -> tuple[int, dict]:
    return post_json(f"{url}/v1/chat/completions", body, timeout=300)


def test_the_http_api_takes_eagle_placement(served):
    """`eagle_placement` in the body of an HTTP chat request reaches the router: "pool" sends a
    pool the target's features, "verifier" none; both give plain decoding's greedy tokens and
    text (no speculation: draft_length 0); any other value is a 400 naming the field."""
    body = {"model": "specserve-test", "messages": [{"role": "user", "content": PROMPTS[0][1]}],
            "max_tokens": 16, "temperature": 0, "return_token_ids": True, "namespace": "http-placement"}
    with http_front(served.router) as url:
        status, plain = _post(url, {**body, "draft_length": 0})
        assert status == 200, plain
        want = plain["choices"][0]
        assert len(want["token_ids"]) == 16 and plain["usage"]["accepted_draft_tokens"] == 0
        for placement in ("pool", "verifier"):
            calls = len(served.pool.calls)
            status, got = _post(url, {**body, "drafter": "eagle", "eagle_placement": placement})
            assert status == 200, got
            choice = got["choices"][0]
            assert (choice["token_ids"], choice["message"]["content"]) == (want["token_ids"],
                                                                           want["message"]["content"]), placement
            assert got["usage"]["accepted_draft_tokens"] > 0, (placement, got["usage"])
            fed = [c for c in served.pool.calls[calls:] if c[0] >= 0]  # Proposes sent features
            assert bool(fed) == (placement == "pool"), (placement, served.pool.calls[calls:])
        status, refused = _post(url, {**body, "drafter": "eagle", "eagle_placement": "gpu"})
    assert status == 400, refused
    error = refused["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert (error["param"], error["code"], error["type"]) == ("eagle_placement", "invalid_value",
                                                              "invalid_request_error"), error
    assert error["message"].startswith("eagle_placement: ") and "'gpu'" in error["message"], error
