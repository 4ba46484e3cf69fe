"""Drafter state: growth of a model drafter's cache, and recovery from lost state."""

from __future__ import annotations

import torch

from drafter_service.drafters import ModelDrafter
from speculative.sampling import SamplingParams
from tiny import tiny_model

GREEDY = SamplingParams()


def test_cache_grows_with_the_request_and_proposals_stay_the_same():
    model = tiny_model(0, max_positions=1024)
    context = [int(t) for t in torch.randint(0, 8, (700,), generator=torch.Generator().manual_seed(0))]
    long_lived = ModelDrafter(model)
    sizes = []
    for n in (5, 200, 300, 650):
        got = long_lived.propose(context[:n], 4, GREEDY, torch.Generator()).tokens
        fresh = ModelDrafter(model).propose(context[:n], 4, GREEDY, torch.Generator()).tokens
        assert got == fresh, f"context of {n} tokens"
        sizes.append(long_lived.cache.max_len)
    assert sizes == [256, 256, 512, 1024], sizes


def test_lost_state_recovers_by_reprefilling():
    model = tiny_model(1)
    ctx = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    a = ModelDrafter(model, max_len=64)
    a.propose(ctx[:4], 3, GREEDY, torch.Generator())
    # a new process knows nothing: it rebuilds from the verified context alone
    b = ModelDrafter(model, max_len=64)
    assert a.propose(ctx, 3, GREEDY, torch.Generator()).tokens == b.propose(ctx, 3, GREEDY, torch.Generator()).tokens
