"""Prompt lookup: continue the text the way it continued the last time its
most recent n tokens appeared (model-free drafting)."""

from __future__ import annotations

from typing import Sequence


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
