"""Confidence calibration: how often the target really takes a drafter's token
at the confidence the drafter gave it.

Drafters' confidences are on different scales. Prompt lookup gives none
(counted as 1.0), a suffix tree gives 1.0 to a continuation it saw once, a
small model's probabilities are its own, Token Recycling's are the target's
from another context. Fusion ranks greedy nodes by the product of
confidences along a path, so one overconfident drafter fills the budget
with its nodes. A `Calibration` per drafter learns, from every verdict, the
target's acceptance rate per confidence bucket, and maps a proposal's
confidences to those rates before fusion.

Every node of a proposal whose parent path the target took is labelled by
the verdict, whether or not fusion kept it in the verified tree: the target's
next token there is known (the accepted path, then the bonus token), so the
node was either that token or not. Greedy only: under sampling, fusion does
not rank by confidence (docs/DESIGN-NOTES.md, "Draw order, not value order").

    cal = Calibration()
    fused = fuse([(cal.calibrated(tree), 1.0), ...], budget, greedy=True)
    ...  # verify; the target continued with `accepted + [bonus]`
    cal.learn(tree, accepted + [bonus])
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import replace
from typing import Sequence

from .tree import DraftTree

# Upper edges of the confidence buckets; the last bucket is [0.9, 1.0].
EDGES = (0.1, 0.3, 0.5, 0.7, 0.9)
# What a bucket's rate starts from: its own confidences, as `PRIOR_WEIGHT` labels' worth.
MIDPOINTS = (0.05, 0.2, 0.4, 0.6, 0.8, 0.95)
PRIOR_WEIGHT = 8.0
DECAY = 0.999  # per label: old evidence fades, so a changing workload is followed


def _confidences(tree: DraftTree, default: float) -> list[float]:
    """The tree's node confidences; `default` for each node of a drafter that gives none."""
    return tree.confidence if tree.confidence is not None else [default] * len(tree)


class Calibration:
    """Acceptance rate per confidence bucket of one drafter, learned from verdicts.
    Thread-safe: one instance may be shared by every request a drafter serves."""

    def __init__(self, prior_weight: float = PRIOR_WEIGHT, decay: float = DECAY):
        self.prior_weight, self.decay = prior_weight, decay
        self.hits = [0.0] * len(MIDPOINTS)  # decayed accepted labels per bucket
        self.labels = [0.0] * len(MIDPOINTS)  # decayed labels per bucket
        self._lock = threading.Lock()

    @staticmethod
    def bucket(confidence: float) -> int:
        return bisect.bisect_right(EDGES, confidence)

    def _rate(self, b: int) -> float:
        return (self.hits[b] + self.prior_weight * MIDPOINTS[b]) / (self.labels[b] + self.prior_weight)

    def rate(self, confidence: float) -> float:
        """The target's acceptance rate of tokens given this confidence (conditional on the parent)."""
        with self._lock:
            return self._rate(self.bucket(confidence))

    def calibrated(self, tree: DraftTree, default_confidence: float = 1.0) -> DraftTree:
        """The same tree with each node's confidence replaced by its bucket's learned rate."""
        confidence = _confidences(tree, default_confidence)
        with self._lock:
            rates = [self._rate(b) for b in map(self.bucket, confidence)]
        return replace(tree, confidence=rates)

    def learn(self, tree: DraftTree, continuation: Sequence[int], default_confidence: float = 1.0) -> int:
        """Label the nodes of `tree` (as the drafter proposed it, with its own confidences)
        by `continuation`, the tokens the target produced after the tree's root. Returns
        how many nodes were labelled."""
        if not len(tree) or not continuation:
            return 0
        confidence = _confidences(tree, default_confidence)
        on_path = {-1: 0}  # node -> depth, for nodes whose path the target took (root: 0)
        labels: list[tuple[int, bool]] = []
        for node, (tok, parent) in enumerate(zip(tree.tokens, tree.parents)):  # parents come first
            depth = on_path.get(parent)
            if depth is None or depth >= len(continuation):
                continue
            hit = tok == continuation[depth]
            labels.append((self.bucket(confidence[node]), hit))
            if hit:
                on_path[node] = depth + 1
        fade = self.decay ** len(labels)
        with self._lock:
            self.hits = [h * fade for h in self.hits]
            self.labels = [n * fade for n in self.labels]
            for b, hit in labels:
                self.hits[b] += hit
                self.labels[b] += 1.0
        return len(labels)
