"""Confidence-based token fusion: several drafters' proposals for one request
merged into one token tree, pruned to a verification budget.

    tree = fuse([(tree_a, 0.8), (tree_b, 0.6)], budget=8, greedy=params.greedy)

Each proposal comes with its drafter's reliability on the request's domain
(in [0, 1]: the rate at which the verifier accepts its tokens). Token paths
the proposals share become one node. A node's *score* is the product, along
its path, of confidence x reliability per token: the chance that the target
accepts every token up to it, if each drafter's confidence is calibrated and
its reliability scales it to the domain. Proposals that agree on a node are
independent evidence for it: its conditional chance is 1 - prod(1 - confidence
x reliability) over the proposals that give it (noisy-OR), at least the best
of them, so a token two drafters agree on ranks above one only one of them
gives at the same confidence. A proposal without confidence (prompt lookup) counts
each of its tokens at `default_confidence` (1.0: its reliability alone,
which already is the acceptance rate of its tokens). The fused tree carries
score(node) / score(parent) as each node's confidence, so the product along a
path gives its score back.

Greedy (the target takes its argmax, so any tree is lossless): the `budget`
best-scoring nodes are kept, best-first from the root, so every kept node's
parent is kept (a score never grows along a path, so these are the best
`budget` nodes of any parent-closed set). Nodes come out in that order,
which makes `truncated(k)` of the result the best k of them.

Sampling: scores are not used, because ranking draws by what they drew would
break multi-draft verification (docs/DESIGN-NOTES.md, "Draw order, not value
order"). Instead the drafters' draws are interleaved into one draw order and
cut to the budget by `DraftTree.truncated`:

- the interleaving is a merge of the proposals' own draw orders: each time,
  the next draw of the proposal whose next draw has the highest prior
  reliability ** depth (ties: smaller depth, then higher reliability, then
  the earlier proposal). The depth of a draw is where its drafter put it,
  known before it is drawn; its token and q are never looked at;
- `truncated` keeps a prefix of that order, cut before the first draw made
  once the budget is full: whether a draw is kept depends on earlier draws
  only (their merges), never on its own token or on later draws. A kept
  draw's ancestors are earlier draws of its own drafter, so they are kept.

Why verification stays exact. `verify_sampling` tests the draws below a node
in draw order, each against the residual the earlier ones left; the node
then yields exactly the target's distribution if every draw it tests is,
given all the verifier has seen so far, a fresh sample from its q.
(1) In the fused order each draw is a fresh sample from its q given all the
draws before it: its own drafter's earlier draws stay before it (the merge
keeps each drafter's order), the other drafters' draws are independent of it
(so each drafter must draw from its own random stream), and neither its
place in the order nor whether it is kept reads it or any later draw.
(2) All the verifier has seen when it tests a draw comes from draws before
it (and from its own uniforms): a token rejected below a node can never be
accepted there later (its residual probability is 0), so the walk enters a
node only through the first draw that landed on it, having tested only draws
before that one, and every draw below the node comes after it.
(1) and (2) at every node, by induction on depth, make the whole walk exact.
Any interleaving of independent drafters that keeps each one's order and is
decided from earlier draws would do; this one puts the draws likeliest to be
accepted first.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from typing import Sequence

import torch

from .tree import DraftTree

DEFAULT_CONFIDENCE = 1.0  # for proposals without confidence: their reliability alone


def fuse(proposals: Sequence[tuple[DraftTree, float]], budget: int, greedy: bool,
         default_confidence: float = DEFAULT_CONFIDENCE) -> DraftTree:
    """One tree of at most `budget` nodes from (proposal, drafter reliability) pairs.

    Greedy: the best-scoring nodes; the result has no draws. Sampling: every
    proposal needs its draws' q; the result's draws are the proposals' kept
    draws, with their q rows, in the fused draw order."""
    ranked = _ranked(proposals)
    union = _Union(ranked, default_confidence)
    if greedy:
        for p, (tree, _) in enumerate(ranked):
            for node in range(len(tree)):
                union.node_of(p, node)
        return union.best_first(budget)
    for tree, _ in ranked:
        _check_draws(tree)
    for p, d in draw_order(ranked):
        union.add_draw(p, d)
    return union.tree().truncated(budget)


def draw_order(ranked: Sequence[tuple[DraftTree, float]]) -> list[tuple[int, int]]:
    """(proposal, draw) pairs, every draw of every proposal, in the fused draw order;
    `ranked` is most reliable first, as `fuse` sorts it.

    A merge of the proposals' own orders by the prior reliability ** depth of
    each one's next draw; reads no token and no q."""
    depths = [tree.depths for tree, _ in ranked]
    nexts = [0] * len(ranked)
    order = []
    while True:
        heads = []
        for p, (tree, reliability) in enumerate(ranked):
            if nexts[p] < len(tree.draw_nodes):
                depth = depths[p][tree.draw_nodes[nexts[p]]]
                heads.append((-(reliability ** depth), depth, p))
        if not heads:
            return order
        p = min(heads)[2]
        order.append((p, nexts[p]))
        nexts[p] += 1


def _ranked(proposals: Sequence[tuple[DraftTree, float]]) -> list[tuple[DraftTree, float]]:
    """The proposals, most reliable drafter first (stable: ties keep the caller's order)."""
    for _, reliability in proposals:
        if not (math.isfinite(reliability) and 0.0 <= reliability <= 1.0):
            raise ValueError(f"reliability must be in [0, 1], got {reliability}")
    return sorted(proposals, key=lambda pr: -pr[1])


def _check_draws(tree: DraftTree) -> None:
    """A sampled proposal as the drafters build it: one q per draw, and each draw
    below a node that an earlier draw of the same proposal landed on."""
    if tree.draw_nodes and (tree.draw_q is None or len(tree.draw_q) != len(tree.draw_nodes)):
        raise ValueError("sampled fusion needs one q per draw in every proposal")
    landed = {-1}
    for node in tree.draw_nodes:
        if tree.parents[node] not in landed:
            raise ValueError("a draw lands below a node no earlier draw landed on")
        landed.add(node)


class _Union:
    """The proposals' trees merged, built up node by node: one node per
    distinct token path, scored by the noisy-OR of what the proposals giving it say."""

    def __init__(self, ranked: Sequence[tuple[DraftTree, float]], default_confidence: float):
        self.ranked = ranked
        self.confidence = [tree.confidence if tree.confidence is not None else [default_confidence] * len(tree)
                           for tree, _ in ranked]
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.miss: list[float] = []  # per node: prod(1 - confidence x reliability) over the proposals giving it
        self.index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        self.fused: list[dict[int, int]] = [{} for _ in ranked]  # per proposal: its node -> fused node
        self.draw_nodes: list[int] = []
        self.draw_q: list[torch.Tensor] = []

    def node_of(self, p: int, node: int) -> int:
        """The fused node of proposal p's `node`, made (with its ancestors) if new."""
        if node < 0:
            return -1
        if node not in self.fused[p]:
            tree, reliability = self.ranked[p]
            key = (self.node_of(p, tree.parents[node]), tree.tokens[node])
            if key not in self.index:
                self.index[key] = len(self.tokens)
                self.tokens.append(key[1])
                self.parents.append(key[0])
                self.miss.append(1.0)
            merged = self.fused[p][node] = self.index[key]
            self.miss[merged] *= 1.0 - min(self.confidence[p][node] * reliability, 1.0)
        return self.fused[p][node]

    def conditional(self, node: int) -> float:
        """score(node) / score(parent): the chance the target takes `node` after its parent."""
        return 1.0 - self.miss[node]

    def scores(self) -> list[float]:
        """Each node's score: the product of the conditionals along its path."""
        scores: list[float] = []
        for node, parent in enumerate(self.parents):  # parents come first
            scores.append((1.0 if parent < 0 else scores[parent]) * self.conditional(node))
        return scores

    def add_draw(self, p: int, d: int) -> None:
        tree, _ = self.ranked[p]
        self.draw_nodes.append(self.node_of(p, tree.draw_nodes[d]))
        self.draw_q.append(tree.draw_q[d])

    def tree(self) -> DraftTree:
        q = torch.stack(self.draw_q) if self.draw_q else None
        return DraftTree(list(self.tokens), list(self.parents), list(self.draw_nodes), q,
                         [self.conditional(n) for n in range(len(self.tokens))])

    def best_first(self, budget: int) -> DraftTree:
        """The `budget` best-scoring nodes, each with its parent, in the order taken."""
        scores = self.scores()
        children: dict[int, list[int]] = defaultdict(list)
        for node, parent in enumerate(self.parents):
            children[parent].append(node)
        frontier = [(-scores[c], c) for c in children[-1]]  # ties: the earlier node (better-ranked drafter)
        heapq.heapify(frontier)
        kept: list[int] = []
        while frontier and len(kept) < budget:
            _, node = heapq.heappop(frontier)
            kept.append(node)
            for c in children[node]:
                heapq.heappush(frontier, (-scores[c], c))
        new = {-1: -1, **{node: i for i, node in enumerate(kept)}}
        return DraftTree([self.tokens[n] for n in kept], [new[self.parents[n]] for n in kept],
                         confidence=[self.conditional(n) for n in kept])
