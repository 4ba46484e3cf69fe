"""`self-int4`: the target drafting for itself with int4 weights (runtime.quantize.quantized_copy).

Its greedy losslessness is the oracle test's (tests/test_oracle_greedy.py runs every drafter
kind); here: the twin leaves the target as it was, the pool serves it, a target it cannot
quantise gets a clear error, it drafts what the float32 target says, and speculative sampling
with it keeps the float32 target's distribution.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import dev_prompts
from drafter_service.pool import DrafterPool
from drafter_service.registry import make_drafter
from speculative.decoding import generate
from runtime.model import Transformer, attention_mask, causal_ancestors
from runtime.quantize import LINEAR_PARTS, Int4Linear, Int8Linear, quantize, quantized_copy
from speculative.sampling import InvalidArgument, SamplingParams
from test_sampling_distribution import PROMPT, chi_square_p, exact_drafted_joint
from tiny import TINY, tiny_model


def scores(model, tokens: list[int]) -> torch.Tensor:
    n = len(tokens)
    return model(torch.tensor([tokens]), torch.arange(n)[None], model.new_cache(n + 4),
                 attention_mask(0, causal_ancestors(n)))[0]


def tiny_target(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(TINY).requires_grad_(False).eval()


def test_the_int4_twin_quantises_its_own_layers_and_leaves_the_target_as_it_was():
    target = tiny_target()
    tokens = [1, 5, 2, 7, 3, 3, 6]
    before = scores(target, tokens)
    twin = quantized_copy(target, "int4")
    assert torch.equal(scores(target, tokens), before)
    assert all(type(layer.get_submodule(part)) is torch.nn.Linear for layer in target.layers for part in LINEAR_PARTS)
    assert all(type(layer.get_submodule(part)) is Int4Linear for layer in twin.layers for part in LINEAR_PARTS)
    assert type(twin.lm_head) is Int8Linear
    assert twin.embed.weight is target.embed.weight  # shared, not copied
    assert twin.attention_dtype is None  # a draft need not round as a lone token does
    # the twin computes with weights close to the target's
    assert (scores(twin, tokens) - before).abs().max() < 0.5 * before.abs().max()


def test_a_target_int4_cannot_twin_is_an_invalid_drafter():
    quantised = quantize(tiny_target(), "int4")
    with pytest.raises(ValueError, match="int4 already"):
        quantized_copy(quantised)
    with pytest.raises(InvalidArgument, match="int4 already") as err:
        make_drafter("self-int4", quantised)
    assert err.value.field == "drafter"
    narrow = Transformer(replace(TINY, hidden_size=48))  # 48 inputs: not whole groups of 32
    with pytest.raises(InvalidArgument, match="not a multiple of int4's group") as err:
        make_drafter("self-int4", narrow)
    assert err.value.field == "drafter"


def test_a_pool_serves_self_int4():
    pool = DrafterPool(tiny_target(1), kinds=("self-int4",))
    pool.prefill("r", "self-int4", [1, 2, 3, 4], SamplingParams())
    tree = pool.propose("r", 4, [5], max_tokens=3)
    assert tree is not None and len(tree) == 3
    assert pool.release("r")


def test_self_int4_drafts_what_the_float32_target_says(smollm2):
    target, tokenizer = smollm2
    params = SamplingParams(max_tokens=48)
    drafted = accepted = 0
    for _, prompt in dev_prompts(3):
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        result = generate(target, ids, params, make_drafter("self-int4", target), 5)
        assert result.token_ids == generate(target, ids, params).token_ids
        drafted += result.draft_tokens
        accepted += result.accepted_draft_tokens
    # int4 weights change few greedy choices: 98.7% of next tokens agree on dev prompts (docs/DRAFTERS.md)
    assert drafted and accepted / drafted >= 0.85, f"{accepted} of {drafted} draft tokens accepted"


SAMPLES = 3000


def test_sampling_with_the_int4_twin_keeps_the_float32_targets_distribution():
    """Seeded runs at temperature 1, the int4 twin drafting 2 tokens for a float32 tiny target:
    the second and third tokens (the first a draft covers) follow the target's own joint
    distribution (chi-square, as tests/test_sampling_distribution.py), though the twin's
    distribution differs from the target's."""
    target = tiny_model(0, 0.5)
    params = SamplingParams(temperature=1.0)
    counts, drafted, rejected = torch.zeros(TINY.vocab_size, TINY.vocab_size), 0, 0
    for seed in range(SAMPLES):
        p = SamplingParams(max_tokens=4, temperature=1.0, seed=seed)
        result = generate(target, PROMPT, p, make_drafter("self-int4", target), 2)
        counts[result.token_ids[1], result.token_ids[2]] += 1
        drafted += result.draft_tokens
        rejected += result.draft_tokens - result.accepted_draft_tokens
    assert drafted > SAMPLES and rejected > 0  # the twin drafted, and not always what the target drew
    assert chi_square_p(counts, exact_drafted_joint(target, params)) > 1e-3
