"""Prepacked CPU linear layers: the same logits as the plain model, and one path for one
row chosen by what this CPU does faster."""

from __future__ import annotations

import copy

import pytest
import torch

from speculative import model as model_module
from speculative.model import PackedLinear, attention_mask, causal_ancestors, pack_for_cpu
from tiny import tiny_model


def logits(model, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(len(tokens) + 1)
    prefix = tokens[:-1]
    model(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache, attention_mask(0, causal_ancestors(len(prefix))))
    # the last token alone: a one-row pass
    one = model(torch.tensor([tokens[-1:]]), torch.tensor([[len(prefix)]]), cache,
                attention_mask(len(prefix), causal_ancestors(1)))
    return torch.cat((one[0], model(torch.tensor([tokens]), torch.arange(len(tokens))[None], model.new_cache(len(tokens)),
                                    attention_mask(0, causal_ancestors(len(tokens))))[0]))


@pytest.mark.parametrize("one_row_blas", [True, False])
def test_packed_model_scores_like_the_plain_one(one_row_blas, monkeypatch):
    plain = tiny_model(0)
    packed = copy.deepcopy(plain)
    monkeypatch.setattr(model_module, "_one_row_blas_wins", lambda layers: one_row_blas)
    if not pack_for_cpu(packed):
        pytest.skip("this torch has no oneDNN packed linear")
    layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 4 * len(packed.layers) + 1
    assert {m.one_row_blas for m in layers} == {one_row_blas}
    tokens = [1, 2, 3, 4, 5, 6]
    assert torch.allclose(logits(packed, tokens), logits(plain, tokens), atol=1e-4)


def test_one_path_for_every_layer_by_the_weighed_total(monkeypatch):
    """Per-shape timings weighed by how many layers have each shape: BLAS wins on the
    small shape, packed on the big one, and the count decides."""
    small, big = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 16, bias=False)
    threads = torch.get_num_threads()
    monkeypatch.setattr(model_module, "_one_row_seconds", {(4, 4, False, threads): (1.0, 2.0),
                                                           (16, 4, False, threads): (5.0, 3.0)})
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        pytest.skip("this torch has no oneDNN packed linear")
    few_big = [PackedLinear(small) for _ in range(3)] + [PackedLinear(big)]  # BLAS 8 s, packed 9 s
    many_big = [PackedLinear(small)] + [PackedLinear(big) for _ in range(2)]  # BLAS 11 s, packed 8 s
    assert model_module._one_row_blas_wins(few_big)
    assert not model_module._one_row_blas_wins(many_big)
