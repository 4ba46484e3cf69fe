"""Token trees: draft proposals rooted at the last verified token.

Node i has a token and a parent (-1 is the root: the last verified token,
whose logits the target computes in the same pass). For sampling, a tree
also records its *draws* in the order they were made: each draw is a token
sampled from a draft distribution q, landing on a node. Several draws may
land on one node (two drafters, or two samples, proposing the same token);
multi-draft verification tests them one by one, in draw order.

A node may carry a *confidence*: the probability its drafter gave the
node's token after its parent's (for a node several chains merged into, the
highest). Confidence fusion (`speculative.fusion`) ranks greedy nodes by it;
verification never reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


def nodes_for_depth(depth: int, draft_length: int, tree_budget: int) -> int:
    """Most nodes of a tree `depth` deep when a `draft_length`-deep one may have
    `tree_budget`: the budget in proportion to the depth (a round cut short, or
    adaptive speculation, shortens both), and at least a chain's worth."""
    if depth <= 0 or draft_length <= 0:
        return max(depth, 0)
    return max(depth, -(-tree_budget * depth // draft_length))


def one_hot(tokens: Sequence[int], vocab_size: int) -> torch.Tensor:
    """The q of deterministic draws (model-free drafters): all of each draw's mass on its token."""
    q = torch.zeros(len(tokens), vocab_size)
    q[torch.arange(len(tokens)), torch.tensor(list(tokens), dtype=torch.long)] = 1.0
    return q


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    draw_nodes: list[int] = field(default_factory=list)  # node each draw landed on, in draw order
    draw_q: torch.Tensor | None = None  # [draws, V] distributions the draws came from; None if greedy
    confidence: list[float] | None = None  # per node, or None when the drafter gives none

    def __len__(self) -> int:
        return len(self.tokens)

    def path_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the first, follow a path of this tree down from its root."""
        child = {(parent, token): node for node, (token, parent) in enumerate(zip(self.tokens, self.parents))}
        node = -1
        for n, token in enumerate(tokens):
            node = child.get((node, token))
            if node is None:
                return n
        return len(tokens)

    @property
    def depths(self) -> list[int]:
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestors(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[1+N, 1+N] bool: row r may attend to column c (root is row 0, node i is row i+1)."""
        n = len(self.tokens)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            mask[i + 1] = mask[p + 1]
            mask[i + 1, i + 1] = True
        return mask.to(device)

    def add_chain(self, tokens: Sequence[int], q: torch.Tensor | None = None, under: int = -1,
                  confidence: Sequence[float] | None = None) -> list[int]:
        """Add a chain drawn below node `under`, merging with existing nodes that
        carry the same tokens. Each token is one draw (with q[i], if given), and
        has confidence[i], if given (a merged node keeps the highest).
        Returns the node of each token."""
        if len(tokens):
            if not len(self):
                self.confidence = None if confidence is None else []
            elif (confidence is None) != (self.confidence is None):
                raise ValueError("chains with and without confidence cannot share a tree")
        nodes = []
        parent = under
        new_q = []
        for i, tok in enumerate(tokens):
            node = next((c for c in self.children(parent) if self.tokens[c] == tok), None)
            if node is None:
                node = len(self.tokens)
                self.tokens.append(int(tok))
                self.parents.append(parent)
                if confidence is not None:
                    self.confidence.append(float(confidence[i]))
            elif confidence is not None:
                self.confidence[node] = max(self.confidence[node], float(confidence[i]))
            nodes.append(node)
            self.draw_nodes.append(node)
            if q is not None:
                new_q.append(q[i])
            parent = node
        if q is not None and len(tokens):
            stacked = torch.stack(new_q)
            self.draw_q = stacked if self.draw_q is None else torch.cat((self.draw_q, stacked))
        return nodes

    @classmethod
    def chain(cls, tokens: Sequence[int], q: torch.Tensor | None = None,
              confidence: Sequence[float] | None = None) -> "DraftTree":
        tree = cls()
        tree.add_chain(tokens, q, confidence=confidence)
        return tree

    def truncated(self, max_nodes: int) -> "DraftTree":
        """At most `max_nodes` nodes, cut in draw order.

        Whether a draw is kept depends only on the draws before it, never on
        the token it drew itself (keeping a draw because it happened to merge
        into an existing node would bias multi-draft sampling): the cut falls
        before the first draw made once the budget is full. So a tree of
        exactly `max_nodes` nodes may lose draws too: the ones after its last
        new node, which are kept in full only because they merged."""
        if len(self) < max_nodes:
            return self
        if not self.draw_nodes:  # a tree built without draws (greedy): nodes follow their parents
            return DraftTree(self.tokens[:max_nodes], self.parents[:max_nodes],
                             confidence=self._confidence(max_nodes))
        kept, n_nodes = len(self.draw_nodes), 0
        for d, node in enumerate(self.draw_nodes):
            if n_nodes >= max_nodes:
                kept = d
                break
            n_nodes = max(n_nodes, node + 1)
        q = None if self.draw_q is None else self.draw_q[:kept]
        return DraftTree(self.tokens[:n_nodes], self.parents[:n_nodes], self.draw_nodes[:kept], q,
                         self._confidence(n_nodes))

    def _confidence(self, n_nodes: int) -> list[float] | None:
        return None if self.confidence is None else self.confidence[:n_nodes]


def sample_tree(states: Sequence, depth: int, branches: int, draw: Callable[[object], tuple[torch.Tensor, torch.Tensor]],
                expand: Callable[[list[int], list[int], list[int], Sequence, list[int], int], Sequence],
                generator: torch.Generator, stop_below: float, token_of: Callable[[int], int] = int) -> DraftTree:
    """A sampled draft tree: `branches` chains drawn independently from a drafter, grown
    together level by level (one drafter pass a level scores every distinct node), shared
    prefixes merged. Each chain's draw at a node comes from q after that node's path, so the
    draws below a node are independent draws of one q, which multi-draft verification takes
    exactly. A chain stops after a draw under `stop_below`.

    `states`: the root's drafter state, as a one-row sequence; `draw(state)`: q over the
    drafter's vocabulary, and q spread over the target's (the draw's record); `token_of(d)`:
    the node token of draw index d; `expand(level_nodes, tokens, parents, states, frontier,
    level)`: the states of the next level's nodes, from the drafter's pass over them."""
    from .sampling import sample

    tokens: list[int] = []
    parents: list[int] = []
    confidence: list[float] = []
    draw_nodes: list[int] = []
    qs: list[torch.Tensor] = []
    child: dict[tuple[int, int], int] = {}
    frontier, chains = [-1], {-1: branches}  # live chains per node
    for level in range(depth):
        going: dict[int, int] = {}
        for node, state in zip(frontier, states):
            q, full = draw(state)
            for _ in range(chains[node]):
                d = sample(q, generator)
                p, tok = float(q[d]), token_of(d)
                c = child.get((node, tok))
                if c is None:
                    c = child[node, tok] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                    confidence.append(p)
                draw_nodes.append(c)
                qs.append(full)
                if p >= stop_below:
                    going[c] = going.get(c, 0) + 1
        level_nodes = [i for i in range(len(tokens)) if i in going]
        if level + 1 == depth or not level_nodes:
            break
        states = expand(level_nodes, tokens, parents, states, frontier, level)
        frontier, chains = level_nodes, going
    return DraftTree(tokens, parents, draw_nodes, torch.stack(qs), confidence)
