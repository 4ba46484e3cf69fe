"""Verification of several requests in one forward pass gives each request
what verifying it alone gives, and leaves each cache row exact."""

from __future__ import annotations

import pytest
import torch

from runtime import model as model_module
from speculative.batching import VerifyItem, verify_batch
from runtime.model import attention_mask, causal_ancestors
from speculative.sampling import SamplingParams
from speculative.tree import DraftTree
from tiny import tiny_model

GREEDY = SamplingParams()


def prefill_row(model, cache, row, tokens):
    view = cache.row_view(row)
    n = len(tokens)
    model(torch.tensor([tokens]), torch.arange(n)[None], view, attention_mask(0, causal_ancestors(n)))


def fresh_next_logits(model, tokens):
    cache = model.new_cache(len(tokens))
    n = len(tokens)
    return model(torch.tensor([tokens]), torch.arange(n)[None], cache, attention_mask(0, causal_ancestors(n)))[0, -1]


@pytest.mark.parametrize("first", [0, 2], ids=["from row 0", "from row 2"])
def test_batched_rows_match_single_requests(first):
    """Rows first, first+2 and first+3 verified (first+1 idle between them); rows before
    `first` hold requests that are not in the batch and must be left as they were."""
    model = tiny_model(0)
    rows = [first, first + 2, first + 3]
    prompts = dict(zip(rows, ([1, 2, 3, 4, 5, 6, 7], [3, 1], [5, 5, 6, 1, 2])))
    trees = dict(zip(rows, (DraftTree(tokens=[1, 2, 3], parents=[-1, 0, -1]), DraftTree.chain([4, 4, 4, 4, 4]),
                            DraftTree())))
    cache = model.new_cache(32, batch=first + 4)
    for row in range(first + 1):
        if row != first:
            prefill_row(model, cache, row, [6, 5, 4, 3])
    prefill_row(model, cache, first + 1, [7, 7, 7])
    for row, p in prompts.items():
        prefill_row(model, cache, row, p[:-1])
    before = cache.k[:, :first].clone(), cache.v[:, :first].clone()
    items = [VerifyItem(row, prompts[row][-1], trees[row], GREEDY, torch.Generator()) for row in prompts]
    got = verify_batch(model, cache, items)
    assert cache.lengths[first + 1] == 3, "an idle row's dummy token must be rolled back"
    assert cache.lengths[:first] == [4] * first, "rows below the batch are not part of it"
    assert torch.equal(cache.k[:, :first], before[0]) and torch.equal(cache.v[:, :first], before[1])
    for (row, p), verdict in zip(prompts.items(), got):
        path, bonus = verdict.path, verdict.bonus
        single = model.new_cache(32)
        prefill_row(model, single, 0, p[:-1])
        [want] = verify_batch(model, single, [VerifyItem(0, p[-1], trees[row], GREEDY, torch.Generator())])
        want_path, want_bonus = want.path, want.bonus
        assert (path, bonus) == (want_path, want_bonus), f"row {row}"
        accepted = p + [trees[row].tokens[n] for n in path]
        assert cache.lengths[row] == len(accepted)
        # the row's cache now continues exactly like a fresh prefill of the accepted tokens
        view = cache.row_view(row)
        nxt = model(torch.tensor([[bonus]]), torch.tensor([[len(accepted)]]), view,
                    attention_mask(len(accepted), causal_ancestors(1)))[0, -1]
        assert torch.allclose(nxt, fresh_next_logits(model, accepted + [bonus]), atol=1e-5), f"row {row}"


def test_a_rows_view_shares_the_rows_and_their_lengths():
    model = tiny_model(0)
    cache = model.new_cache(16, batch=5)
    view = cache.rows_view(2, 4)
    prefill_row(model, view, 1, [1, 2, 3])
    assert cache.lengths == [0, 0, 0, 3, 0] and list(view.lengths) == [0, 3] and len(view.lengths) == 2
    assert torch.equal(view.k[:, 1], cache.k[:, 3]) and cache.k[:, 3, :, :3].abs().sum() > 0
    view.rollback(1, row=1)
    assert cache.lengths[3] == 1
    with pytest.raises(IndexError):
        view.lengths[2]
    with pytest.raises(ValueError, match="rows 3..5"):
        cache.rows_view(3, 6)


@pytest.mark.parametrize("wide_rows_share", [1, 1000], ids=["wide rows attend alone", "all rows padded"])
def test_packed_rows_score_like_padded_rows(wide_rows_share, monkeypatch):
    """With `real`, only the real tokens go through the linear layers and the head; their
    logits and cache entries are those the padded forward gives, whether attention runs on
    the padded rows or on every row's first token and then each wide row alone."""
    monkeypatch.setattr(model_module, "WIDE_ROWS_SHARE", wide_rows_share)
    model = tiny_model(0)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [0, 3, 5]]
    real = [4, 1, 0]  # a 4-node chain, one token, an idle row
    width = max(real)
    padded, packed = (model.new_cache(32, batch=3) for _ in range(2))
    for cache in (padded, packed):
        for row, p in enumerate(prompts):
            prefill_row(model, cache, row, p)
    starts = [len(p) for p in prompts]
    span = max(starts) + width
    tokens = torch.tensor([[7, 6, 5, 4], [3, 0, 0, 0], [0, 0, 0, 0]])
    positions = torch.tensor([[s + j for j in range(width)] for s in starts])
    mask = torch.zeros(3, width, span, dtype=torch.bool)
    for row, (start, n) in enumerate(zip(starts, real)):
        mask[row, :n, :start] = True
        mask[row, :n, start:start + n] = causal_ancestors(n)
        for j in range(n, width):
            mask[row, j, start + j] = True
    want = model(tokens, positions, padded, mask)
    got = model(tokens, positions, packed, mask, real=real)
    assert got.shape == (sum(real), want.shape[-1])
    expected = torch.cat([want[row, :n] for row, n in enumerate(real)])
    assert torch.allclose(got, expected, atol=1e-5)
    for row, (start, n) in enumerate(zip(starts, real)):
        assert packed.lengths[row] == padded.lengths[row] == start + width
        assert torch.allclose(packed.k[:, row, :, :start + n], padded.k[:, row, :, :start + n], atol=1e-5)
        assert torch.allclose(packed.v[:, row, :, :start + n], padded.v[:, row, :, :start + n], atol=1e-5)
