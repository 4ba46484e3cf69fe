"""Post-verify pipelining in `speculative.pipeline`: what a draft made ahead keeps,
and that the pipelined loop decodes exactly what plain decoding does (greedy).
Sampling exactness: tests/test_sampling_distribution.py (the pipelined cases)."""

from __future__ import annotations

import torch

import speculative.decoding as decoding
from drafter_service.drafters import ModelDrafter, SuffixDrafter
from speculative.decoding import DraftRequest
from speculative.pipeline import likeliest_path, reuse_ahead, subtree
from speculative.sampling import SamplingParams
from speculative.suffix import SuffixIndex
from speculative.tree import DraftTree
from tiny import TINY, tiny_model


def test_likeliest_path_follows_first_children():
    tree = DraftTree()
    tree.add_chain([5, 6, 7])
    tree.add_chain([5, 2])
    tree.add_chain([3, 4])
    assert [tree.tokens[n] for n in likeliest_path(tree)] == [5, 6, 7]
    assert likeliest_path(DraftTree()) == []


def test_subtree_keeps_the_draws_below_in_order_with_their_q_and_confidence():
    q = torch.eye(8)
    tree = DraftTree()
    tree.add_chain([1, 2, 3], q[[1, 2, 3]], confidence=[0.9, 0.8, 0.7])
    tree.add_chain([4], q[[4]], confidence=[0.5])
    tree.add_chain([1, 5], q[[1, 5]], confidence=[0.6, 0.4])
    sub = subtree(tree, 0)  # below token 1
    assert sub.tokens == [2, 3, 5] and sub.parents == [-1, 0, -1]
    assert sub.confidence == [0.8, 0.7, 0.4]
    assert sub.draw_nodes == [0, 1, 2]
    assert torch.equal(sub.draw_q, q[[2, 3, 5]])


def test_reuse_needs_the_whole_guess_accepted_and_the_bonus_drafted():
    ahead = DraftTree.chain([7, 6, 5])
    assert reuse_ahead(ahead, [1, 2], [1, 2], 7).tokens == [6, 5]
    assert reuse_ahead(ahead, [1, 2], [1], 7) is None  # the guess was cut short
    assert reuse_ahead(ahead, [1, 2], [1, 2], 3) is None  # the target's token is not the drafted one
    assert reuse_ahead(ahead, [], [], 7).tokens == [6, 5]  # an empty draft: the bonus alone decides


def test_pipelined_greedy_equals_plain_decoding():
    target = tiny_model(0, logit_scale=2.0)
    prompts = [[1, 2, 3, 1, 2], [4, 4, 4], [7, 1, 6, 2, 5, 3]]
    for drafter_model in (target, tiny_model(1, logit_scale=2.0)):  # always right, often wrong
        reused = 0
        for prompt in prompts:
            params = SamplingParams(max_tokens=30)
            plain = decoding.generate(target, prompt, params)
            piped = decoding.generate(target, prompt, params, ModelDrafter(drafter_model, max_len=64), 3,
                                      pipelined=True)
            assert piped.token_ids == plain.token_ids, prompt
            reused += piped.reused_drafts
        if drafter_model is target:
            assert reused > 0, "the target drafting for itself never had a draft reused"


def test_drafting_ahead_does_not_teach_the_suffix_index_unverified_tokens():
    index = SuffixIndex(depth=4, max_draft=4)
    drafter = SuffixDrafter(index, TINY.vocab_size)
    context = [1, 2, 3]
    drafter.propose(DraftRequest(context + [4, 5], 2, SamplingParams(), None, verified=len(context)))
    assert index.propose([3], 2).tokens == []  # 3 was never seen followed by 4
    drafter.propose(DraftRequest(context + [4, 5], 2, SamplingParams(), None))
    assert index.propose([3], 2).tokens == [4, 5]


def test_confidence_stop_ends_the_draft_after_an_unsure_token():
    model = tiny_model(1, logit_scale=0.5)  # flat: no token is drafted with confidence 0.9
    drafter = ModelDrafter(model, max_len=64)
    assert len(drafter.propose(DraftRequest([1, 2, 3], 4, SamplingParams(), None))) == 4
    drafter.stop_below = 0.9
    tree = drafter.propose(DraftRequest([1, 2, 3], 4, SamplingParams(), None))
    assert len(tree) == 1 and tree.confidence[0] < 0.9
