"""Log-probabilities of the tokens a request emits, and of their likeliest alternatives,
taken from the scores of the pass that chose them (no extra pass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the likeliest tokens and their logprobs, best first


def token_logprobs(scores: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Each of `tokens` with its log-probability under the row of `scores` [K, V] it was
    chosen after (log-softmax of the row), and the row's `top` likeliest tokens."""
    if not len(tokens):
        return []
    logp = torch.log_softmax(scores.float(), dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(list(tokens), dtype=torch.long)].tolist()
    if top:
        values, ids = logp.topk(top, dim=-1)
        alternatives = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [()] * len(tokens)
    return [TokenLogprob(int(t), lp, alt) for t, lp, alt in zip(tokens, chosen, alternatives)]
