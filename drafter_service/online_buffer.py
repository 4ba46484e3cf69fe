"""The online learner's bounded buffer of served text with the target's scores.

An item is one window of a request's verified tokens in `train-drafter`'s format
(drafter_service/training.py): `tokens` [T], and at each position the target's
likeliest next tokens `top_ids` [T, k] and their probabilities `top_probs` [T, k]
(all zero at positions the target's scores did not come back for, which the loss then
skips); positions before `answer_from` are the prompt's. Items are kept per domain, each
domain at most `max_tokens` tokens, oldest dropped first. A fixed share of the windows,
chosen by a hash of their tokens, is held aside: never trained on, it judges a
checkpoint before it is published.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections import deque

import torch


def window_item(tokens: list[int], ids: torch.Tensor, probs: torch.Tensor, answer_from: int) -> dict:
    return {"tokens": torch.tensor(tokens, dtype=torch.int32), "answer_from": answer_from,
            "top_ids": ids.to(torch.int32), "top_probs": probs.float()}


def held_aside_by_hash(item: dict, share: float) -> bool:
    """Whether a window goes to the held-aside slice: the same window always does."""
    digest = hashlib.sha256(item["tokens"].numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


class _Domain:
    def __init__(self) -> None:
        self.train: deque[dict] = deque()
        self.held: deque[dict] = deque()
        self.tokens = 0


class ReplayBuffer:
    """Per-domain windows, bounded in tokens per domain; thread-safe."""

    def __init__(self, max_tokens: int, held_aside: float):
        self.max_tokens, self.held_aside = max_tokens, held_aside
        self._domains: dict[str, _Domain] = {}
        self._lock = threading.Lock()

    def add(self, domain: str, item: dict, held_aside: bool | None = None) -> None:
        """Buffer a window (held aside by its hash unless `held_aside` says); a window longer
        than the whole buffer keeps its last `max_tokens` tokens."""
        n = len(item["tokens"])
        if n > self.max_tokens:
            cut = n - self.max_tokens
            item = {**{k: item[k][cut:] for k in ("tokens", "top_ids", "top_probs")},
                    "answer_from": max(item["answer_from"] - cut, 0)}
            n = self.max_tokens
        aside = held_aside_by_hash(item, self.held_aside) if held_aside is None else held_aside
        with self._lock:
            d = self._domains.setdefault(domain, _Domain())
            (d.held if aside else d.train).append(item)
            d.tokens += n
            while d.tokens > self.max_tokens:  # the oldest window of the part over its share goes
                over_held = d.held and (sum(len(i["tokens"]) for i in d.held) > self.held_aside * d.tokens
                                        or not d.train)
                d.tokens -= len((d.held if over_held else d.train).popleft()["tokens"])

    def tokens(self, domain: str) -> int:
        with self._lock:
            d = self._domains.get(domain)
            return d.tokens if d else 0

    def domains(self) -> list[str]:
        with self._lock:
            return sorted(self._domains)

    def sample(self, rng: random.Random, tokens: int) -> list[dict]:
        """Training windows of about `tokens` positions in all: a domain at random, then one of
        its windows at random, so a busy domain does not crowd out the others."""
        with self._lock:
            pools = [list(d.train) for d in self._domains.values() if d.train]
        picked, seen = [], 0
        while pools and seen < tokens:
            item = rng.choice(rng.choice(pools))
            picked.append(item)
            seen += len(item["tokens"])
        return picked

    def windows(self, domain: str) -> list[dict]:
        """Every window of `domain`, held aside or not."""
        with self._lock:
            d = self._domains.get(domain)
            return list(d.train) + list(d.held) if d else []

    def held_aside_items(self) -> dict[str, list[dict]]:
        with self._lock:
            return {name: list(d.held) for name, d in self._domains.items() if d.held}
