"""The drafter pool behind a real gRPC server on loopback, on the tiny model."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from drafter_service.pool import DrafterPool
from drafter_service.registry import make_drafter
from drafter_service.servicer import serve
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from protos.convert import params_to_pb, tree_from_pb
from speculative.decoding import DraftRequest
from speculative.sampling import SamplingParams, make_generator
from tiny import TINY, tiny_model

GREEDY = SamplingParams(max_tokens=16)
REPETITIVE = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]  # prompt lookup finds "1 2" -> "3 4 5 1 2"
# Verified tokens per round: some follow the drafts, some do not, so the
# drafters' state must be rolled back and resynced.
ROUNDS = [[3, 4], [6], [5, 1, 2, 7], [0, 0]]
KINDS = ("pld", "layerskip")  # the drafters these tests ask the pool for


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture
def connect():
    """connect(pool) -> a Drafter stub on a fresh loopback server serving `pool`."""
    opened: list[tuple[grpc.Server, grpc.Channel]] = []

    def _connect(pool: DrafterPool) -> pb_grpc.DrafterStub:
        server, port = serve(pool)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        opened.append((server, channel))
        return pb_grpc.DrafterStub(channel)

    yield _connect
    for server, channel in opened:
        channel.close()
        server.stop(None)


def prefill(stub, request_id: str, kind: str, tokens: list[int], params: SamplingParams = GREEDY) -> None:
    stub.Prefill(pb.DrafterPrefillRequest(request_id=request_id, drafter=kind, token_ids=tokens,
                                          sampling=params_to_pb(params)))


def propose(stub, request_id: str, context_length: int, new_tokens: list[int], max_tokens: int = 5):
    return stub.Propose(pb.ProposeRequest(request_id=request_id, context_length=context_length,
                                          new_tokens=new_tokens, max_tokens=max_tokens))


def wire_tokens(response: pb.ProposeResponse) -> list[int]:
    assert not response.state_lost
    return list(response.tree.tokens)


@pytest.mark.parametrize("kind", ["pld", "layerskip"])
def test_proposals_over_grpc_equal_the_in_process_drafter(target, connect, kind):
    stub = connect(DrafterPool(target, KINDS))
    local = make_drafter(kind, target)
    rng = make_generator(None, stream=1)  # greedy: never drawn from
    context = list(REPETITIVE)
    prefill(stub, "r", kind, context)
    assert wire_tokens(propose(stub, "r", len(context), [])) == local.propose(DraftRequest(context, 5, GREEDY, rng)).tokens
    drafted = 0
    for new in ROUNDS:
        response = propose(stub, "r", len(context), new)
        context += new
        expected = local.propose(DraftRequest(context, 5, GREEDY, rng)).tokens
        assert wire_tokens(response) == expected
        assert response.seconds > 0
        drafted += len(expected)
    assert drafted >= 5  # the comparison was not between empty proposals


def test_state_loss_then_prefill_recovers(target, connect):
    stub = connect(DrafterPool(target, KINDS))
    local = make_drafter("layerskip", target)
    context = REPETITIVE + [3, 4]
    assert propose(stub, "never-seen", 3, [1]).state_lost
    prefill(stub, "r", "layerskip", context)
    expected = local.propose(DraftRequest(context, 4, GREEDY, make_generator(None, stream=1))).tokens
    assert wire_tokens(propose(stub, "r", len(context), [], max_tokens=4)) == expected
    assert propose(stub, "r", len(context) - 1, [2]).state_lost  # the caller's view of the context differs
    assert propose(stub, "r", len(context) + 1, []).state_lost
    assert stub.Release(pb.ReleaseRequest(request_id="r")).released
    assert not stub.Release(pb.ReleaseRequest(request_id="r")).released
    assert propose(stub, "r", len(context), []).state_lost


def test_idle_requests_are_evicted(target, connect):
    now = [0.0]
    pool = DrafterPool(target, KINDS, idle_timeout_s=300.0, clock=lambda: now[0])
    stub = connect(pool)
    prefill(stub, "old", "pld", REPETITIVE)
    now[0] = 200.0
    prefill(stub, "recent", "pld", REPETITIVE)
    now[0] = 350.0  # "old" idle 350 s, "recent" 150 s
    assert wire_tokens(propose(stub, "recent", len(REPETITIVE), []))
    assert pool.active_requests() == 1
    assert propose(stub, "old", len(REPETITIVE), []).state_lost
    now[0] = 700.0  # "recent" was last used at 350
    assert propose(stub, "recent", len(REPETITIVE), []).state_lost
    assert pool.active_requests() == 0


def test_seeded_drafts_are_keyed_and_unseeded_ones_sparse(target, connect):
    """Seeded: keyed drafts (the target's choice guessed with the seed's noise), the same from
    any pool and in process, with no q on the wire. Unseeded: draws whose q travel sparse."""
    top_k = 3
    keyed, unseeded = (SamplingParams(max_tokens=16, temperature=1.0, seed=7),
                       SamplingParams(max_tokens=16, temperature=1.0))
    stubs = [connect(DrafterPool(target, KINDS, draft_top_k=top_k)) for _ in range(2)]
    local = make_drafter("layerskip", target, draft_top_k=top_k)
    context = list(REPETITIVE)
    for stub in stubs:
        prefill(stub, "s", "layerskip", context, keyed)
    prefill(stubs[0], "u", "layerskip", context, unseeded)
    for new in [[], *ROUNDS]:
        responses = [propose(stub, "s", len(context), new) for stub in stubs]
        sampled = propose(stubs[0], "u", len(context), new)
        context += new
        expected = local.propose(DraftRequest(context, 5, keyed, make_generator(None)))
        assert responses[0].tree == responses[1].tree  # two fresh pools, one seed: the same drafts
        assert list(responses[0].tree.tokens) == expected.tokens and not responses[0].tree.draw_q
        wire = sampled.tree.draw_q
        assert len(wire) == len(sampled.tree.tokens) > 0
        for dist in wire:
            assert 1 <= len(dist.ids) <= top_k
            assert sum(dist.probs) == pytest.approx(1.0, abs=1e-5)
        tree_from_pb(responses[0].tree, TINY.vocab_size)  # well-formed for the verifier


@pytest.mark.parametrize("call, field", [
    (lambda s: prefill(s, "b", "nope", REPETITIVE), "drafter"),
    (lambda s: prefill(s, "b", "pld", []), "token_ids"),
    (lambda s: prefill(s, "b", "pld", REPETITIVE, SamplingParams(temperature=-1.0)), "temperature"),
    (lambda s: s.Prefill(pb.DrafterPrefillRequest(request_id="b", drafter="pld", token_ids=REPETITIVE,
                                                  sampling=params_to_pb(GREEDY), resumed=-1)), "resumed"),
    (lambda s: propose(s, "b", len(REPETITIVE), [], max_tokens=-1), "max_tokens"),
    (lambda s: propose(s, "b", len(REPETITIVE), [TINY.vocab_size]), "new_tokens"),
])
def test_bad_input_names_the_field_and_the_server_goes_on(target, connect, call, field):
    stub = connect(DrafterPool(target, KINDS))
    with pytest.raises(grpc.RpcError) as err:
        call(stub)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:")
    prefill(stub, "ok", "pld", REPETITIVE)
    assert wire_tokens(propose(stub, "ok", len(REPETITIVE), [])) == [3, 4, 5, 1, 2]


def test_health_and_reflection(target):
    server, port = serve(DrafterPool(target, KINDS))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "specserve.v1.Drafter"):
                status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
                assert status == health_pb2.HealthCheckResponse.SERVING
            assert "specserve.v1.Drafter" in ProtoReflectionDescriptorDatabase(channel).get_services()
    finally:
        server.stop(None)


def test_a_pool_measures_what_each_kind_costs_a_token():
    """What a starting pool publishes for routers to start from (drafter_service.costs): a
    drafted token's seconds over a one-token target pass's, per kind."""
    from drafter_service.costs import draft_token_costs
    from tiny import tiny_model

    target = tiny_model(0)
    costs = draft_token_costs(target, ["pld", "layerskip"])
    assert set(costs) == {"pld", "layerskip"} and all(c > 0 for c in costs.values())
    # layer-skip drafts with some of the target's own layers: a token costs a share of a pass;
    # prompt lookup reads a list
    assert costs["pld"] < 0.5 * costs["layerskip"]
