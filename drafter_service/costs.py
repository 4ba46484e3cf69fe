"""What each drafter kind costs a drafted token, as a share of one target pass, measured
once when a pool starts, on its own process and threads.

A router deciding whether a drafter pays (router.adaptive.DraftCostMemory) knew nothing
before requests had drafted with it, and assumed it did: a new server's first requests
paid for the finding out, a model drafter on cores the target shares costing more than
it gained. A pool publishes these with its registration; the router starts from them and
learns the real costs, hops included, from the rounds."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from runtime.model import Transformer, attention_mask, causal_ancestors
from speculative.decoding import DraftRequest
from speculative.sampling import SamplingParams

from .registry import make_drafter

CONTEXT_TOKENS = 64  # a short request's context (any tokens)
DRAFT_TOKENS = 6
REPEATS = 3


def draft_token_costs(target: Transformer, kinds: Sequence[str]) -> dict[str, float]:
    """Each kind's seconds per drafted token over the seconds of one one-token target pass
    (medians of REPEATS), both after the same context."""
    cfg = target.config
    n = min(CONTEXT_TOKENS, cfg.max_position_embeddings - DRAFT_TOKENS - 2)
    context = [(7 + 31 * i) % cfg.vocab_size for i in range(n)]
    unit = _one_token_pass_seconds(target, context)
    costs = {}
    for kind in kinds:
        drafter = make_drafter(kind, target, namespace="startup-costs")
        if drafter is None:
            continue
        request = DraftRequest(context, DRAFT_TOKENS, SamplingParams())
        with torch.inference_mode():
            drafter.propose(request)  # its caches filled: what is timed is drafting, not the prefill
            seconds = _median(lambda: drafter.propose(request))
        costs[kind] = seconds / DRAFT_TOKENS / unit
    return costs


def _one_token_pass_seconds(target: Transformer, context: list[int]) -> float:
    """A one-token target pass after the context's other tokens."""
    n = len(context)
    cache = target.new_cache(n + 1)
    with torch.inference_mode():
        target(torch.tensor([context[:-1]]), torch.arange(n - 1)[None], cache,
               attention_mask(0, causal_ancestors(n - 1)))

        def one() -> None:
            target(torch.tensor([context[-1:]]), torch.tensor([[n - 1]]), cache,
                   attention_mask(n - 1, causal_ancestors(1)))
            cache.rollback(n - 1)

        return _median(one)


def _median(work) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]
