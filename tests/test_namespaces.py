"""Memory namespaces: what drafters learn from one namespace's requests never reaches
another's. Served end to end (router, drafter pool and verifier over real gRPC on
loopback, the default target, a Spec-Bench question) the way `specserve bench` runs its
served modes: a mode that runs after another on the same question drafts as it would on
a fresh server, not from the other mode's answer."""

from __future__ import annotations

import grpc
import pytest

from bench.harness import ServedRunner, mode_namespace
from cluster.state import EmbeddedStateStore
from conftest import dev_prompts
from drafter_service.pool import DrafterPool
from loopback import loopback
from router.expertise import ExpertiseRouter
from router.servicer import RouterConfig, RouterServicer
from router.servicer import serve as serve_router
from speculative.namespaces import MAX_NAMESPACE_LENGTH, Namespaces, check_namespace
from speculative.sampling import InvalidArgument, SamplingParams
from verifier_service.engine import VerifierEngine

MAX_TOKENS = 48
LEARNING_DRAFTERS = ["suffix", "recycle"]  # the drafters that learn across requests


@pytest.mark.parametrize("name", ["", "tenant-a", "bench-1a2b/served-suffix/0", "key:7@org.example+x"])
def test_valid_namespaces(name):
    assert check_namespace(name) == name


@pytest.mark.parametrize("name", ["a b", "tenant\n", "é", "x" * (MAX_NAMESPACE_LENGTH + 1)])
def test_bad_namespaces_name_the_field(name):
    with pytest.raises(InvalidArgument) as e:
        check_namespace(name)
    assert e.value.field == "namespace"


def test_namespaces_forget_the_least_recently_used():
    made = []
    spaces = Namespaces(lambda ns: made.append(ns) or {"ns": ns}, capacity=2)
    a = spaces.get("a")
    assert spaces.get("a") is a and made == ["a"]
    spaces.get("b")
    spaces.get("a")  # a is now the most recently used
    spaces.get("c")  # so b goes
    assert "a" in spaces and "c" in spaces and "b" not in spaces and len(spaces) == 2
    assert spaces.get("b") is not None and made == ["a", "b", "c", "b"]  # b starts afresh


@pytest.fixture(scope="module")
def server(smollm2):
    """HOST:PORT of a real router over a real pool and verifier serving the default target;
    fixed draft length, so a drafter with the same memory drafts the same trees."""
    model, tokenizer = smollm2
    pool = DrafterPool(model, kinds=LEARNING_DRAFTERS)
    engine = VerifierEngine(model, max_batch=4, max_len=2048)
    config = RouterConfig(context_length=model.config.max_position_embeddings,
                          eos_token_ids=list(tokenizer.eos_token_ids or model.config.eos_token_ids),
                          vocab_size=model.config.vocab_size, default_drafter="suffix", draft_length=5,
                          adaptive=False, pipelined=False)
    expertise = ExpertiseRouter(EmbeddedStateStore())
    with loopback(pool, engine) as coordinator:
        router, port = serve_router(RouterServicer(tokenizer, coordinator, config, expertise), "127.0.0.1", 0)
        yield f"127.0.0.1:{port}"
        router.stop(None)


@pytest.mark.parametrize("drafter", LEARNING_DRAFTERS)
def test_a_served_mode_does_not_draft_another_modes_answer_to_the_same_question(server, drafter):
    """The bench's served modes, one after the other on one question, each in its namespace:
    the later one drafts exactly what a fresh server drafts. In the earlier one's namespace
    the same request drafts the remembered answer (learning within a mode stays)."""
    [(_, question)] = dev_prompts(1)
    runner, params = ServedRunner(server), SamplingParams(max_tokens=MAX_TOKENS)
    served, pipelined = f"served-{drafter}", f"pipelined-{drafter}"

    fresh = runner.run(question, params, served, mode_namespace("fresh", served, 0))
    earlier = runner.run(question, params, pipelined, mode_namespace("run", pipelined, 0))
    later = runner.run(question, params, served, mode_namespace("run", served, 0))
    remembered = runner.run(question, params, served, mode_namespace("run", pipelined, 0))

    tokens, _, passes, drafts = fresh
    assert earlier[0] == later[0] == remembered[0] == tokens, "the output never depends on memory"
    assert (later[2], later[3]) == (passes, drafts), "the later mode drafted from the earlier mode's memory"
    assert remembered[2] < passes and remembered[3][1] > drafts[1], "a namespace remembers its own answers"


def test_a_bad_namespace_is_invalid_argument_and_the_server_keeps_serving(server):
    from specserve.client import Client, SpecserveError

    with Client(server) as client:
        with pytest.raises(SpecserveError) as e:
            client.generate("Hello", max_tokens=2, namespace="not ok")
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "namespace" in e.value.details
        assert len(client.generate("Hello", max_tokens=2, namespace="ok").token_ids) == 2


def test_in_process_drafters_learn_in_their_namespaces_memory():
    """`make_drafter` (the CLI, the bench's in-process modes, the pools) hands a learning
    drafter its namespace's memory: the same for the same namespace, another for another."""
    from drafter_service import registry
    from tiny import tiny_model

    target = tiny_model(0)
    a, again, b = (registry.make_drafter("suffix+recycle", target, namespace=ns) for ns in ("a", "a", "b"))
    index, table = a.members[0][0].index, a.members[1][0].table
    assert again.members[0][0].index is index and again.members[1][0].table is table
    assert b.members[0][0].index is not index and b.members[1][0].table is not table
    assert again.calibrations[0] is a.calibrations[0] is not b.calibrations[0]
    assert registry.memory(target, "a").suffix_index() is index
