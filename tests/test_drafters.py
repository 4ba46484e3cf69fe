"""Drafter state: growth of a model drafter's cache, and recovery from lost state."""

from __future__ import annotations

import pytest
import torch

from drafter_service.drafters import ModelDrafter
from speculative.decoding import DraftRequest
from speculative.sampling import SamplingParams
from tiny import tiny_model
from trees import path_to

GREEDY = SamplingParams()


def test_cache_grows_with_the_request_and_proposals_stay_the_same():
    model = tiny_model(0, max_positions=1024)
    context = [int(t) for t in torch.randint(0, 8, (700,), generator=torch.Generator().manual_seed(0))]
    long_lived = ModelDrafter(model)
    sizes = []
    for n in (5, 200, 300, 650):
        got = long_lived.propose(DraftRequest(context[:n], 4, GREEDY, torch.Generator())).tokens
        fresh = ModelDrafter(model).propose(DraftRequest(context[:n], 4, GREEDY, torch.Generator())).tokens
        assert got == fresh, f"context of {n} tokens"
        sizes.append(long_lived.cache.max_len)
    assert sizes == [256, 256, 512, 1024], sizes


def test_lost_state_recovers_by_reprefilling():
    model = tiny_model(1)
    ctx = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    a = ModelDrafter(model, max_len=64)
    a.propose(DraftRequest(ctx[:4], 3, GREEDY, torch.Generator()))
    # a new process knows nothing: it rebuilds from the verified context alone
    b = ModelDrafter(model, max_len=64)
    assert a.propose(DraftRequest(ctx, 3, GREEDY, torch.Generator())).tokens == b.propose(DraftRequest(ctx, 3, GREEDY, torch.Generator())).tokens


def test_trimmed_vocabulary_drafter_maps_tokens_both_ways():
    """Its token i is the target's vocab_ids[i]; target tokens it lacks read as its last row."""
    small = tiny_model(2, vocab_size=4)
    vocab_ids = [1, 4, 6]
    drafter = ModelDrafter(small, max_len=64, vocab_ids=vocab_ids, target_vocab_size=8)
    ctx = [1, 4, 6, 0, 7, 1]  # 0 and 7 are outside its vocabulary
    tokens = drafter.propose(DraftRequest(ctx, 4, GREEDY, torch.Generator())).tokens
    assert set(tokens) <= set(vocab_ids)
    # the same chain drafted directly with the small model on mapped ids
    mapped = [0, 1, 2, 3, 3, 0]
    plain = ModelDrafter(small, max_len=64)
    plain.propose(DraftRequest(mapped, 1, GREEDY, torch.Generator()))
    expect, ctx2 = [], list(mapped)
    for _ in range(4):
        logits = plain._sync(ctx2, 1).clone()
        logits[3] = float("-inf")  # the "other" row is never proposed
        nxt = int(logits.argmax())
        expect.append(vocab_ids[nxt])
        ctx2.append(nxt)
    assert tokens == expect
    sampled = drafter.propose(DraftRequest(ctx, 3, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0)))
    assert sampled.draw_q.shape == (3, 8)
    assert torch.allclose(sampled.draw_q.sum(-1), torch.ones(3))
    assert sampled.draw_q[:, [0, 2, 3, 5, 7]].sum() == 0  # no mass outside its vocabulary


def _probability_after(model, context, token) -> float:
    """The drafter's probability of `token` after `context`, from a fresh prefill."""
    return float(torch.softmax(ModelDrafter(model, max_len=64)._sync(context, 1).float(), -1)[token])


def test_greedy_tree_holds_the_drafters_likeliest_paths_and_leaves_the_cache_clean():
    model = tiny_model(3)
    ctx = [1, 5, 2, 7, 3]
    drafter = ModelDrafter(model, max_len=64)
    tree = drafter.propose(DraftRequest(ctx, 3, GREEDY, torch.Generator(), max_nodes=7))
    assert 1 < len(tree) <= 7 and max(tree.depths) <= 3
    assert all(p < i for i, p in enumerate(tree.parents))  # parents first
    chain = ModelDrafter(model, max_len=64).propose(DraftRequest(ctx, 3, GREEDY, torch.Generator()))
    assert tree.tokens[0] == chain.tokens[0]  # the best node is the drafter's argmax
    scores = []
    for node in range(len(tree)):
        path = [tree.tokens[n] for n in path_to(tree, node)]
        # each node's confidence is the drafter's own probability of it after its path
        assert abs(tree.confidence[node] - _probability_after(model, ctx + path[:-1], path[-1])) < 1e-5
        scores.append(torch.tensor([tree.confidence[n] for n in path_to(tree, node)]).prod().item())
    assert scores == sorted(scores, reverse=True)  # best-first: truncated(k) keeps the best k
    # the tree's keys and values are gone: the next proposal is a fresh drafter's
    longer = ctx + [tree.tokens[0], 4]
    assert drafter.propose(DraftRequest(longer, 3, GREEDY, torch.Generator())).tokens == \
        ModelDrafter(model, max_len=64).propose(DraftRequest(longer, 3, GREEDY, torch.Generator())).tokens


def test_greedy_tree_of_a_trimmed_vocabulary_drafter_proposes_target_tokens():
    small = tiny_model(2, vocab_size=4)
    drafter = ModelDrafter(small, max_len=64, vocab_ids=[1, 4, 6], target_vocab_size=8)
    tree = drafter.propose(DraftRequest([1, 4, 6, 0, 7, 1], 3, GREEDY, torch.Generator(), max_nodes=6))
    assert len(tree) > 3 and set(tree.tokens) <= {1, 4, 6}


def test_sampled_tree_draws_each_chain_from_the_drafters_own_q_and_leaves_the_cache_clean():
    """Sampling with room for 3 chains: every draw lands on a node whose token it is,
    carries the drafter's q after that node's path, 3 draws a level, and the cache is a
    fresh drafter's afterwards."""
    model = tiny_model(3)
    ctx = [1, 5, 2, 7, 3]
    params = SamplingParams(temperature=1.0)
    drafter = ModelDrafter(model, max_len=64)
    tree = drafter.propose(DraftRequest(ctx, 3, params, torch.Generator().manual_seed(0), max_nodes=9))
    assert len(tree.draw_nodes) == 9 and tree.draw_q.shape == (9, 8)
    assert 3 <= len(tree) <= 9 and max(tree.depths) == 3
    assert all(p < i for i, p in enumerate(tree.parents))
    assert sorted(tree.depths[n] for n in tree.draw_nodes) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    for d, node in enumerate(tree.draw_nodes):
        path = [tree.tokens[n] for n in path_to(tree, node)]
        q = torch.softmax(ModelDrafter(model, max_len=64)._sync(ctx + path[:-1], 1).float(), -1)
        assert torch.allclose(tree.draw_q[d], q, atol=1e-5), f"draw {d}"
    # more than one distinct chain over many seeds: the chains really are drawn apart
    shapes = {len(drafter.propose(DraftRequest(ctx, 3, params, torch.Generator().manual_seed(s), max_nodes=9)))
              for s in range(20)}
    assert max(shapes) > 3
    longer = ctx + [tree.tokens[0], 4]
    assert drafter.propose(DraftRequest(longer, 3, GREEDY, torch.Generator())).tokens == \
        ModelDrafter(model, max_len=64).propose(DraftRequest(longer, 3, GREEDY, torch.Generator())).tokens


@pytest.mark.parametrize("name", ["pld", "suffix", "recycle", "layerskip", "pld+suffix", "recycle+layerskip",
                                  "suffix+recycle+layerskip"])
def test_each_drafter_declares_the_abilities_its_name_has(name):
    """The router and the pool read a drafter's abilities by name (no torch) or on the drafter
    itself; both must say the same, and what a drafter declares it must have."""
    from drafter_service.registry import make_drafter
    from speculative.drafter_kinds import abilities

    drafter = make_drafter(name, tiny_model(0))
    assert drafter.abilities == abilities(name)
    assert callable(getattr(drafter, "observe", None)) or not drafter.abilities.learns_from_target
    assert hasattr(drafter, "stop_below") or not drafter.abilities.stops_on_confidence
