"""Token Recycling: draft from the target's own earlier predictions.

Every verification pass scores each position of a draft tree against the
whole vocabulary and keeps one token per position; the runners-up are thrown
away. Token Recycling (Luo et al., 2024) keeps them: for each token, the
target's top-k next tokens the last time it scored a position holding that
token. Drafting follows that table from the last verified token, best-first
by the product of the recorded probabilities, into a token tree. No model,
no training; the table is shared by every request of a process, as the
paper inherits it across queries.
"""

from __future__ import annotations

import heapq
import threading
from itertools import count
from typing import Sequence

import torch

from .tree import DraftTree

CANDIDATES = 8  # next tokens kept per token (the paper's k)
# The prefill's last positions whose predictions seed the table: the head over them costs
# a little of the prefill, and the answer often goes on in the prompt's words.
PROMPT_SEED = 256


def top_candidates(scores: torch.Tensor, k: int = CANDIDATES) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest next tokens [N, k] (int32) and their probabilities [N, k] (the
    softmax of the raw scores) for each of N scored positions."""
    probs, ids = torch.softmax(scores.float(), dim=-1).topk(min(k, scores.shape[-1]), dim=-1)
    return ids.to(torch.int32).cpu(), probs.cpu()


class RecycledCandidates:
    """The table: row t holds the target's top-k next tokens after token t, the last
    time it scored one (-1: never), and their probabilities."""

    def __init__(self, vocab_size: int, k: int = CANDIDATES):
        self.vocab_size, self.k = vocab_size, k
        self.ids = torch.full((vocab_size, k), -1, dtype=torch.int32)
        self.probs = torch.zeros(vocab_size, k)
        self._lock = threading.Lock()

    def observe(self, tokens: Sequence[int], ids: torch.Tensor, probs: torch.Tensor) -> None:
        """The target scored positions holding `tokens`; `ids`/`probs` [N, m] are its
        likeliest next tokens there, likeliest first (`top_candidates`); the table keeps
        the first k. Newer replaces older."""
        if len(tokens) != ids.shape[0] or ids.shape != probs.shape or ids.dim() != 2:
            raise ValueError(f"{len(tokens)} tokens, candidates {tuple(ids.shape)} and {tuple(probs.shape)}")
        if not len(tokens):
            return
        ids, probs = ids[:, :self.k], probs[:, :self.k]
        rows = torch.tensor(list(tokens), dtype=torch.long)
        if int(rows.min()) < 0 or int(rows.max()) >= self.vocab_size:
            raise ValueError(f"a token outside the vocabulary of {self.vocab_size}")
        width = ids.shape[1]
        with self._lock:
            self.ids[rows] = -1
            self.ids[rows, :width] = ids.to(torch.int32)
            self.probs[rows] = 0.0
            self.probs[rows, :width] = probs.float()

    def propose(self, last_token: int, max_nodes: int, max_depth: int) -> DraftTree:
        """A tree of at most `max_nodes` nodes and `max_depth` levels after `last_token`,
        grown best-first by the product of recorded probabilities along each path. A
        node's confidence is its recorded probability after its parent."""
        tree = DraftTree()
        if max_nodes <= 0 or max_depth <= 0:
            return tree
        tie = count()
        heap: list = []
        rows: dict[int, tuple[list[int], list[float]]] = {}

        def offer(token: int, path_p: float, parent: int, depth: int) -> None:
            if depth >= max_depth:
                return
            if token not in rows:
                with self._lock:
                    rows[token] = (self.ids[token].tolist(), self.probs[token].tolist())
            for tok, p in zip(*rows[token]):
                if tok >= 0 and p > 0:
                    heapq.heappush(heap, (-path_p * p, next(tie), tok, p, parent, depth + 1))

        offer(last_token, 1.0, -1, 0)
        while heap and len(tree) < max_nodes:
            neg_p, _, tok, step, parent, depth = heapq.heappop(heap)
            [node] = tree.add_chain([tok], under=parent, confidence=[step])
            offer(tok, -neg_p, node, depth)
        return tree
