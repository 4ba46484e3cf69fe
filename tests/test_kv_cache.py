"""After rejected drafts, the cache is exactly what a fresh prefill of the
accepted tokens would build (float32, 1e-4)."""

from __future__ import annotations

import torch

from speculative.model import attention_mask, causal_ancestors
from speculative.tree import DraftTree


def next_logits_fresh(model, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(len(tokens))
    n = len(tokens)
    return model(torch.tensor([tokens]), torch.arange(n)[None], cache, attention_mask(0, causal_ancestors(n)),
                 logits_from=n - 1)[0, -1]


def test_tree_rejection_then_next_token_matches_fresh_prefill(smollm2):
    model, tok = smollm2
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. The quick brown")
    cache = model.new_cache(64)
    n = len(prompt)
    model(torch.tensor([prompt[:-1]]), torch.arange(n - 1)[None], cache, attention_mask(0, causal_ancestors(n - 1)))
    # root = last prompt token; a tree whose accepted path is nodes 1 -> 3, the rest rejected
    tree = DraftTree(tokens=[100, 200, 300, 400, 500, 600], parents=[-1, -1, 0, 1, 1, 3])
    root_pos = n - 1
    tokens = torch.tensor([[prompt[-1]] + tree.tokens])
    positions = torch.tensor([[root_pos] + [root_pos + d for d in tree.depths]])
    model(tokens, positions, cache, attention_mask(root_pos, tree.ancestors()))
    path = [1, 3]
    cache.keep(root_pos, [0] + [p + 1 for p in path])
    accepted = prompt + [tree.tokens[p] for p in path]
    assert cache.lengths[0] == len(accepted)

    nxt = 777
    got = model(torch.tensor([[nxt]]), torch.tensor([[len(accepted)]]), cache,
                attention_mask(len(accepted), causal_ancestors(1)))[0, -1]
    want = next_logits_fresh(model, accepted + [nxt])
    assert torch.allclose(got, want, atol=1e-4), f"max diff {(got - want).abs().max():.2e}"


def test_chain_rollback_matches_fresh_prefill(smollm2):
    model, tok = smollm2
    prompt = tok.encode("Speculative decoding drafts tokens and verifies them")
    cache = model.new_cache(64)
    n = len(prompt)
    model(torch.tensor([prompt]), torch.arange(n)[None], cache, attention_mask(0, causal_ancestors(n)))
    draft = [11, 22, 33, 44, 55]
    model(torch.tensor([draft]), torch.arange(n, n + 5)[None], cache, attention_mask(n, causal_ancestors(5)))
    cache.rollback(n + 2)  # keep two draft tokens
    got = model(torch.tensor([[66]]), torch.tensor([[n + 2]]), cache, attention_mask(n + 2, causal_ancestors(1)))[0, -1]
    want = next_logits_fresh(model, prompt + draft[:2] + [66])
    assert torch.allclose(got, want, atol=1e-4), f"max diff {(got - want).abs().max():.2e}"


def test_additive_mask_attends_exactly_as_the_boolean_one():
    """The model turns the mask into SDPA's additive scores once a pass (model.additive_mask);
    attention must come out bit for bit as SDPA computes it from the boolean mask."""
    import torch.nn.functional as F

    from speculative.model import additive_mask

    torch.manual_seed(0)
    tree = DraftTree(tokens=[3, 4, 5, 6], parents=[-1, 0, 0, 2])
    mask = attention_mask(7, tree.ancestors()).unsqueeze(1)  # [1, 1, 5, 12]: a prefix and a tree
    for dtype in (torch.float32, torch.float64):
        q, k, v = (torch.randn(1, 6, n, 16, dtype=dtype) for n in (5, 12, 12))
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(mask, dtype))
        assert torch.equal(got, want)
