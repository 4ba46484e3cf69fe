"""After rejected drafts, the cache is exactly what a fresh prefill of the
accepted tokens would build (float32, 1e-4)."""

from __future__ import annotations

import torch

from runtime.model import attention_mask, causal_ancestors
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

    from runtime.model import additive_mask

    torch.manual_seed(0)
    tree = DraftTree(tokens=[3, 4, 5, 6], parents=[-1, 0, 0, 2])
    mask = attention_mask(7, tree.ancestors()).unsqueeze(1)  # [1, 1, 5, 12]: a prefix and a tree
    for dtype in (torch.float32, torch.float64):
        q, k, v = (torch.randn(1, 6, n, 16, dtype=dtype) for n in (5, 12, 12))
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(mask, dtype))
        assert torch.equal(got, want)


def test_a_prefill_attends_without_a_mask_exactly_as_with_it(smollm2, monkeypatch):
    """A causal pass from an empty cache (a long prompt's prefill) attends with SDPA's
    is_causal and no mask, which skips the hidden blocks: its logits and cache must be bit
    for bit those of the masked pass, in float32 and in the int modes' float64 attention.
    A pass after a cached prefix, or a tree's, keeps the mask."""
    import torch.nn.functional as F

    import runtime.model as model_module
    from runtime.model import CAUSAL_MIN_TOKENS, KVCache

    model, tok = smollm2
    prompt = tok.encode("The quick brown fox jumps over the lazy dog, again and again. " * 12)
    n = len(prompt)
    assert n >= CAUSAL_MIN_TOKENS
    causal_calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, is_causal=False, **kwargs):
        causal_calls.append(is_causal)
        return sdpa(*args, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", spy)

    def prefill(dtype):
        cache = KVCache(model.config.num_layers, 1, model.config.num_kv_heads, n + 8, model.config.head_dim,
                        dtype=dtype)
        logits = model(torch.tensor([prompt]), torch.arange(n)[None], cache, attention_mask(0, causal_ancestors(n)))
        return logits, cache

    for dtype in (torch.float32, torch.float64):
        causal_calls.clear()
        fast, fast_cache = prefill(dtype)
        assert causal_calls == [True] * model.config.num_layers
        monkeypatch.setattr(model_module, "CAUSAL_MIN_TOKENS", n + 1)
        causal_calls.clear()
        masked, masked_cache = prefill(dtype)
        assert causal_calls == [False] * model.config.num_layers
        monkeypatch.setattr(model_module, "CAUSAL_MIN_TOKENS", CAUSAL_MIN_TOKENS)
        assert torch.equal(fast, masked)
        assert torch.equal(fast_cache.k, masked_cache.k) and torch.equal(fast_cache.v, masked_cache.v)

    # after a cached prefix the pass is not from an empty cache; a tree's mask is not causal
    cache = model.new_cache(2 * n + 8)
    model(torch.tensor([prompt[:4]]), torch.arange(4)[None], cache, attention_mask(0, causal_ancestors(4)))
    causal_calls.clear()
    model(torch.tensor([prompt]), torch.arange(4, n + 4)[None], cache, attention_mask(4, causal_ancestors(n)))
    branching = causal_ancestors(n).clone()
    branching[n - 1, n - 2] = False  # the last token a sibling of the one before, not its child
    model(torch.tensor([prompt]), torch.arange(n)[None], model.new_cache(n + 8), attention_mask(0, branching))
    assert causal_calls == [False] * (2 * model.config.num_layers)
