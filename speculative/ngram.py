"""Prompt lookup: continue the text the way it continued the last time its
most recent n tokens appeared (model-free drafting)."""

from __future__ import annotations

from typing import Sequence

from .tree import DraftTree, one_hot

# Served prompt lookup (the pools' and the verifier's own) matches 2- to 4-grams: single-token
# matches propose more than they win when a 5-token verify costs 1.5x a 1-token step (tuned on
# 12 dev prompts).
PLD_MAX_NGRAM, PLD_MIN_NGRAM = 4, 2


def lookup_continuation(tokens: Sequence[int], max_tokens: int, max_ngram: int = 3, min_ngram: int = 1
                        ) -> list[int]:
    """Up to `max_tokens` tokens that followed the latest earlier occurrence of the
    longest suffix of `tokens` (from `max_ngram` down to `min_ngram` tokens)."""
    tokens = list(tokens)
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        # latest match first: recent text predicts the next tokens best
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + max_tokens]
                if follow:
                    return follow
    return []


def lookup_draft(tokens: Sequence[int], depth: int, vocab_size: int, deterministic: bool,
                 max_ngram: int = PLD_MAX_NGRAM, min_ngram: int = PLD_MIN_NGRAM) -> DraftTree:
    """Prompt lookup's draft to verify: a chain of up to `depth` tokens; a sampled request's
    draws carry their q, one-hot, since the lookup is deterministic."""
    follow = lookup_continuation(tokens, depth, max_ngram, min_ngram)
    return DraftTree.chain(follow, None if deterministic else one_hot(follow, vocab_size))
