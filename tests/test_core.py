"""Units of the shared core: trees, greedy verification, prompt lookup, sampling."""

from __future__ import annotations

import pytest
import torch

from speculative.ngram import lookup_continuation
from speculative.sampling import InvalidArgument, SamplingParams, probabilities
from speculative.tree import DraftTree
from speculative.verification import verify_greedy


def test_tree_merges_shared_prefixes_and_keeps_draw_order():
    tree = DraftTree()
    tree.add_chain([5, 6, 7])
    tree.add_chain([5, 8])
    assert tree.tokens == [5, 6, 7, 8] and tree.parents == [-1, 0, 1, 0]
    assert tree.draw_nodes == [0, 1, 2, 0, 3]
    assert tree.depths == [1, 2, 3, 2]
    anc = tree.ancestors()
    assert anc[3].tolist() == [True, True, True, True, False]  # node 2 (row 3): root, 0, 1, itself
    assert anc[4].tolist() == [True, True, False, False, True]  # node 3 (row 4): root, 0, itself


def test_truncation_cuts_in_draw_order():
    tree = DraftTree()
    tree.add_chain([5, 6], torch.eye(10)[[5, 6]])
    tree.add_chain([5, 9], torch.eye(10)[[5, 9]])
    cut = tree.truncated(2)
    # draws after the first one that lands beyond the budget are dropped, even the one landing on node 0
    assert cut.tokens == [5, 6] and cut.draw_nodes == [0, 1] and cut.draw_q.shape[0] == 2


def test_verify_greedy_follows_target_argmax():
    tree = DraftTree(tokens=[1, 2, 3, 4], parents=[-1, -1, 1, 2])
    logits = torch.full((5, 8), -1.0)
    logits[0, 2] = 1  # root -> 2 (node 1)
    logits[2, 3] = 1  # node 1 -> 3 (node 2)
    logits[3, 7] = 1  # node 2 -> 7: no such child, so 7 is the bonus token
    assert verify_greedy(tree, logits) == ([1, 2], 7)
    assert verify_greedy(DraftTree(), logits[:1]) == ([], 2)


def test_prompt_lookup_prefers_longest_latest_match():
    assert lookup_continuation([1, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]
    assert lookup_continuation([1, 2, 3], 3) == []
    assert lookup_continuation([7, 8, 7], 5) == [8, 7]


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"), ({"top_k": -2}, "top_k"),
])
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs).validate()
    assert err.value.field == field


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95, atol=1e-6)


def test_suffix_index_grows_trees_best_first():
    from speculative.suffix import SuffixIndex

    index = SuffixIndex(depth=4, max_draft=4)
    for seq in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3, 4, 5, 9]):
        index.add(seq)
    tree = index.propose([9, 9, 1, 2, 3], 6)
    # after 1 2 3: "4 5" twice, "7 8" once; then 6 or 9 after 4 5
    assert tree.tokens == [4, 5, 7, 6, 9, 8] and tree.parents == [-1, 0, -1, 1, 1, 2]
    assert index.propose([9, 9, 1, 2, 3], 2).tokens == [4, 5]
    assert index.propose([42], 4).tokens == []


def test_suffix_stream_feeding_equals_whole_sequence_and_resets_when_full():
    from speculative.suffix import SuffixIndex, SuffixStream

    whole, streamed = SuffixIndex(depth=3, max_draft=3), SuffixIndex(depth=3, max_draft=3)
    seq = [5, 1, 2, 5, 1, 3, 5, 1, 2]
    whole.add(seq)
    stream = SuffixStream()
    for i in range(0, len(seq), 2):
        streamed.feed(stream, seq[i:i + 2])
    assert whole.tokens == streamed.tokens == len(seq)
    for ctx in ([5, 1], [2, 5], [3]):
        assert whole.propose(ctx, 5).tokens == streamed.propose(ctx, 5).tokens
    small = SuffixIndex(depth=3, max_draft=3, max_tokens=8)
    small_stream = SuffixStream()
    small.feed(small_stream, seq)
    small.feed(small_stream, [7])  # over max_tokens: starts afresh from the stream's recent tokens
    assert small.generation == 1 and small.propose([5, 1], 3).tokens
