"""Drafting from the target's own features (EAGLE-3's head, EAGLE-2's dynamic tree).

The head (`runtime.eagle_head`) keeps one cache entry per verified position i:
the target's fused features at i and the token at i+1. The decoding loop hands
the drafter the target's features of each newly verified position
(`DraftRequest.features`: the verify pass that checked the tree captured them,
`Transformer.forward(capture=...)`), so entry i exists once position i is
verified. The output of the last entry predicts the first draft token; each
draft token's entry takes its parent's output in place of the target's feature.

Greedy (or keyed) requests get an EAGLE-2 tree: level by level, each level's
candidates are the top children of the level above, the `width` likeliest by
path probability under the head become nodes and are scored together (one head
pass with tree attention); the best `max_nodes` by path probability are kept.
Sampled requests get chains drawn from the head's q, several grown together
when the budget allows (their draws below a node are independent draws of one
q, as multi-draft verification needs). q is over the draft vocabulary; spread
back over the target's (zeros elsewhere) it is exactly what each draw came from.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from runtime.eagle_head import EagleHead, HeadCache
from .drafter_kinds import abilities as kind_abilities
from .sampling import SamplingParams, choice_scores, probabilities
from .tree import DraftTree, sample_tree

FIRST_SLOTS = 256  # the head cache's first size; it doubles as a request grows
# A chain ends after a draft token the head gave less than this probability (SpecDec++'s
# stop): past such a token the rest is seldom accepted, and each costs a head step and a row
# of the verify pass (docs/BENCHMARKS.md, eagle). A pool sets its router's stop_confidence.
STOP_BELOW = 0.4


def _top_k_renormalised(q: torch.Tensor, k: int) -> torch.Tensor:
    top = torch.topk(q, min(k, q.shape[-1]))
    out = torch.zeros_like(q)
    out[top.indices] = top.values / top.values.sum()
    return out


class EagleDrafter:
    """One request's drafter over a shared, trained `EagleHead` (attached to the target)."""

    name = "eagle"
    abilities = kind_abilities("eagle")

    def __init__(self, head: EagleHead, draft_top_k: int | None = None, max_len: int = 8192):
        self.head, self.draft_top_k, self.max_len = head, draft_top_k, max_len
        self.feature_layers = tuple(head.config.layers)  # what the verify pass captures for it
        self.target_vocab_size = head.config.target_vocab_size
        self.stop_below = STOP_BELOW  # SpecDec++-style stop, as the model drafters'
        self.g: torch.Tensor | None = None  # fused target features of positions 0..len-1 [N, H]
        self.cache: HeadCache | None = None
        self.tokens: list[int] = []  # entry i's token (context[i + 1])
        self.hidden: list[torch.Tensor] = []  # entry i's output [H]
        self.exact = 0  # entries made from the target's features (the rest from the head's own)

    # ---- state -------------------------------------------------------------

    @torch.inference_mode()
    def take_features(self, start: int, features: torch.Tensor) -> None:
        """The target's features [m, 3H] at positions start..start+m-1."""
        fused = self.head.fused(features.to(self.head.fuse.weight.device)).detach()
        have = 0 if self.g is None else len(self.g)
        if start > have:  # a gap: what came before is lost, so none of it is usable
            self.g, self.exact = None, 0
            return
        self.g = fused if self.g is None or start == 0 else torch.cat((self.g[:start], fused))
        self.exact = min(self.exact, start)  # entries past `start` may have been fed other features

    def _sync(self, context: Sequence[int]) -> torch.Tensor | None:
        """Entries 0..len(context)-2, real features where known and the head's own after;
        the last one's output (None: no feature of this request yet)."""
        n = len(context) - 1  # entries wanted
        real = min(0 if self.g is None else len(self.g), n)
        if real == 0 or n <= 0:
            return None
        if self.cache is None:
            self.cache = HeadCache(self.head.config, min(max(FIRST_SLOTS, n + 64), self.max_len),
                                   self.head.fuse.weight.device, self.head.fuse.weight.dtype)
        common = 0
        limit = min(self.exact, real, len(self.tokens))
        while common < limit and self.tokens[common] == context[common + 1]:
            common += 1
        self._rollback(common)
        self._room(n + 64)
        if common < real:
            h = self.head.extend(self.cache, self.g[common:real], list(context[common + 1:real + 1]),
                                 list(range(common, real)))
            self.tokens.extend(context[common + 1:real + 1])
            self.hidden.extend(h)
        self.exact = real
        for i in range(real, n):  # guessed tokens (drafting ahead): the head's own features
            h = self.head.extend(self.cache, self.hidden[-1][None], [context[i + 1]], [i])
            self.tokens.append(context[i + 1])
            self.hidden.append(h[0])
        return self.hidden[-1]

    def _rollback(self, n: int) -> None:
        self.cache.length = n
        del self.tokens[n:], self.hidden[n:]

    def _room(self, need: int) -> None:
        if need > self.cache.max_len:
            self.cache = self.cache.grown(min(max(need, 2 * self.cache.max_len), self.max_len))

    # ---- proposing -------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, request) -> DraftTree:
        if request.features is not None:
            self.take_features(*request.features)
        context, params = request.context, request.params
        depth = min(request.depth, self.max_len - len(context) - 1)
        nodes = depth if request.max_nodes is None else request.max_nodes
        if depth <= 0:
            return DraftTree()
        h = self._sync(context)
        if h is None:
            return DraftTree()
        base = self.cache.length  # entries of the context; the draft's are dropped afterwards
        try:
            if params.deterministic:
                if nodes > depth:
                    return self._tree(h, len(context), depth, nodes, params)
                return self._greedy_chain(h, len(context), depth, params)
            branches = nodes // depth if nodes >= 2 * depth else 1
            return self._sampled(h, len(context), depth, branches, params, request.generator)
        finally:
            self.cache.length = base

    def _choice(self, logits: torch.Tensor, params: SamplingParams, position: int) -> torch.Tensor:
        """Choice scores [N, Vd] guessing the target's token at `position` (keyed like the verifier's)."""
        if params.greedy:
            return logits
        ids = self.head.vocab_ids
        full = logits.new_full((len(logits), self.target_vocab_size), float("-inf"))
        full[:, ids] = logits
        return choice_scores(full, params, [position] * len(logits))[:, ids]

    def _greedy_chain(self, h: torch.Tensor, n: int, depth: int, params: SamplingParams) -> DraftTree:
        tokens, confidence = [], []
        for i in range(depth):
            scores = self._choice(self.head.logits(h[None]), params, n + i)[0]
            d = int(scores.argmax())
            tok = int(self.head.vocab_ids[d])
            tokens.append(tok)
            confidence.append(float(torch.softmax(scores.float(), -1)[d]))
            if confidence[-1] < self.stop_below or i + 1 == depth:
                break
            h = self.head.extend(self.cache, h[None], [tok], [n - 1 + i])[0]
        return DraftTree.chain(tokens, confidence=confidence)

    def _tree(self, h: torch.Tensor, n: int, depth: int, max_nodes: int, params: SamplingParams) -> DraftTree:
        """EAGLE-2's dynamic tree (deterministic requests): best-first by path probability."""
        width = -(-max_nodes // depth)
        base = self.cache.length
        self._room(base + depth * width + 1)
        tokens: list[int] = []  # target ids
        parents: list[int] = []
        local: list[float] = []
        path_logp: list[float] = []
        slot: dict[int, int] = {}  # node -> its head cache slot
        frontier, frontier_h = [-1], h[None]
        for level in range(depth):
            scores = self._choice(self.head.logits(frontier_h), params, n + level)
            top = torch.topk(torch.softmax(scores.float(), -1), min(width, scores.shape[-1]))
            candidates = []
            for node, probs, ids in zip(frontier, top.values.tolist(), top.indices.tolist()):
                logp = path_logp[node] if node >= 0 else 0.0
                candidates.extend((logp + math.log(p), node, d, p) for p, d in zip(probs, ids) if p > 0)
            candidates.sort(key=lambda c: -c[0])
            level_nodes = []
            for logp, parent, d, p in candidates[:width]:
                level_nodes.append(len(tokens))
                tokens.append(int(self.head.vocab_ids[d]))
                parents.append(parent)
                local.append(p)
                path_logp.append(logp)
            if level + 1 == depth or not level_nodes:
                break
            frontier_h = self._level(level_nodes, tokens, parents, slot, frontier_h, frontier, base, n - 1 + level)
            frontier = level_nodes
        order = sorted(range(len(tokens)), key=lambda i: (-path_logp[i], i))[:max_nodes]
        kept = set(order)
        order = [i for i in order if parents[i] < 0 or parents[i] in kept]  # closed under parents
        index = {old: new for new, old in enumerate(order)}
        return DraftTree([tokens[i] for i in order], [index.get(parents[i], -1) for i in order],
                         confidence=[local[i] for i in order])

    def _level(self, level_nodes: list[int], tokens: list[int], parents: list[int], slot: dict[int, int],
               frontier_h: torch.Tensor, frontier: list[int], base: int, position: int) -> torch.Tensor:
        """One head pass over a level's nodes: each node's entry takes its parent's output and
        its token, and sees the context's entries and its ancestors'. Their outputs [T, H]."""
        start = self.cache.length
        t = len(level_nodes)
        row_of = {node: r for r, node in enumerate(frontier)}
        g = torch.stack([frontier_h[row_of[parents[node]]] for node in level_nodes])
        mask = torch.zeros(t, start + t, dtype=torch.bool)
        mask[:, :base] = True
        for r, node in enumerate(level_nodes):
            mask[r, start + r] = True
            up = parents[node]
            while up >= 0:
                mask[r, slot[up]] = True
                up = parents[up]
            slot[node] = start + r
        return self._extend_masked(g, [tokens[node] for node in level_nodes], position, mask)

    def _extend_masked(self, g: torch.Tensor, tokens: list[int], position: int, mask: torch.Tensor) -> torch.Tensor:
        """`EagleHead.extend` with a full mask [T, S + T] over the cache's entries and the new ones."""
        head, cache = self.head, self.cache
        t, start = len(tokens), cache.length
        device = g.device
        h, k, v = head.layer(g[None].to(cache.k.dtype), torch.tensor([tokens], device=device),
                             torch.tensor([[position] * t], device=device), cache.k[None, :, :start],
                             cache.v[None, :, :start], mask[None].to(device))
        cache.k[:, start:start + t], cache.v[:, start:start + t] = k[0], v[0]
        cache.length = start + t
        return h[0]

    def _q(self, h: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        q = probabilities(self.head.logits(h[None])[0], params)
        return _top_k_renormalised(q, self.draft_top_k) if self.draft_top_k else q

    def _spread(self, q: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(self.target_vocab_size, dtype=q.dtype)
        full[self.head.vocab_ids.cpu()] = q.cpu()
        return full

    def _sampled(self, h: torch.Tensor, n: int, depth: int, branches: int, params: SamplingParams,
                 generator: torch.Generator) -> DraftTree:
        """`branches` chains drawn from the head, grown together level by level (one head pass
        a level scores every distinct node), shared prefixes merged. A chain stops after a
        draw under `stop_below`."""
        base = self.cache.length
        self._room(base + depth * branches + 1)
        slot: dict[int, int] = {}

        def draw(node_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q = self._q(node_h, params)
            return q, self._spread(q)

        def expand(level_nodes, tokens, parents, frontier_h, frontier, level):
            return self._level(level_nodes, tokens, parents, slot, frontier_h, frontier, base, n - 1 + level)

        return sample_tree(h[None], depth, branches, draw, expand, generator, self.stop_below,
                           lambda d: int(self.head.vocab_ids[d]))
