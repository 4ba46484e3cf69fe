"""Suffix-trie drafting (SuffixDecoding): continue the text the way it went on
after the same recent tokens, in any sequence seen before.

The index holds every suffix, up to `depth` tokens, of the sequences added
to it (prompts, earlier outputs), with counts. To draft, find the longest
recent part of the context that the index knows, then expand the most
frequent continuations best-first into a token tree. Model-free and cheap.
"""

from __future__ import annotations

import heapq
import threading
from itertools import count
from typing import Sequence

from .tree import DraftTree, one_hot


class _Node:
    __slots__ = ("children", "count")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixStream:
    """One growing sequence being fed into an index: the trie nodes its recent
    windows have reached, so each new token costs O(window), not a rebuild."""

    def __init__(self):
        self.open: list[tuple[_Node, int]] = []  # (node, depth) of windows still growing
        self.recent: list[int] = []  # last window's tokens, to re-feed after the index resets
        self.generation = -1


class SuffixFeed:
    """One request's verified text as fed into an index, fed only what is new since the last
    call; a text that does not continue the one fed (another request's, a resumed one) starts
    a new stream."""

    def __init__(self):
        self.stream = SuffixStream()
        self.fed, self.last = 0, -1  # tokens fed so far and the last of them: whether a text continues it

    def feed(self, index: "SuffixIndex", known: Sequence[int]) -> None:
        n = self.fed
        if len(known) < n or (n and known[n - 1] != self.last):
            self.stream, n = SuffixStream(), 0
        index.feed(self.stream, known[n:])
        self.fed, self.last = len(known), (known[-1] if known else -1)


class SuffixIndex:
    """Counts of every window of up to `depth` + `max_draft` tokens of the sequences
    fed to it: `depth` tokens to match the context on, `max_draft` to continue with.
    Shared by many requests, so it is locked; past `max_nodes` it starts afresh."""

    def __init__(self, depth: int = 16, max_draft: int = 16, max_nodes: int = 500_000):
        self.depth, self.max_draft, self.max_nodes = depth, max_draft, max_nodes
        self.window = depth + max_draft
        self.root = _Node()
        self.nodes = 0
        self.generation = 0
        self._lock = threading.Lock()

    def add(self, tokens: Sequence[int]) -> None:
        """Index a whole sequence."""
        self.feed(SuffixStream(), tokens)

    def feed(self, stream: SuffixStream, tokens: Sequence[int]) -> None:
        """Append `tokens` to the sequence `stream` stands for."""
        with self._lock:
            if self.nodes > self.max_nodes:
                self.root, self.nodes, self.generation = _Node(), 0, self.generation + 1
            if stream.generation != self.generation:  # new stream, or the index was reset
                old, stream.open, stream.recent, stream.generation = stream.recent, [], [], self.generation
                tokens = old + list(tokens)
            for tok in tokens:
                stream.open.append((self.root, 0))  # a window starts at every token
                still_open = []
                for node, depth in stream.open:
                    child = node.children.get(tok)
                    if child is None:
                        child = node.children[tok] = _Node()
                        self.nodes += 1
                    child.count += 1
                    if depth + 1 < self.window:
                        still_open.append((child, depth + 1))
                stream.open = still_open
            stream.recent = (stream.recent + list(tokens))[-self.window:]

    def _match(self, context: Sequence[int]) -> _Node | None:
        """The node after the longest suffix of `context` (up to depth) that the index holds."""
        for n in range(min(self.depth, len(context)), 0, -1):
            node = self.root
            for tok in context[len(context) - n:]:
                node = node.children.get(tok)
                if node is None:
                    break
            if node is not None and node.children:
                return node
        return None

    def propose(self, context: Sequence[int], max_tokens: int, min_probability: float = 0.1,
                max_depth: int | None = None) -> DraftTree:
        """A tree of at most `max_tokens` nodes and `max_depth` levels (default: the
        index's `max_draft`) continuing `context`, grown best-first by
        the empirical probability of each node's path (kept only while >= min_probability).
        A node's confidence is the empirical probability of its token after its parent."""
        tree = DraftTree()
        with self._lock:
            start = self._match(context)
            if start is None or max_tokens <= 0:
                return tree
            depth = self.max_draft if max_depth is None else min(max_depth, self.max_draft)
            self._expand(tree, start, max_tokens, min_probability, depth)
        return tree

    def _expand(self, tree: DraftTree, start: _Node, max_tokens: int, min_probability: float,
                max_depth: int) -> None:
        tie = count()  # equal probabilities: first seen first
        heap: list = []

        def offer_children(node: _Node, prob: float, parent: int, depth: int) -> None:
            if depth >= max_depth:
                return
            total = sum(c.count for c in node.children.values())
            for tok, child in node.children.items():
                p = prob * child.count / total
                if p >= min_probability:
                    heapq.heappush(heap, (-p, next(tie), tok, child.count / total, child, parent, depth + 1))

        offer_children(start, 1.0, -1, 0)
        while heap and len(tree) < max_tokens:
            neg_p, _, tok, step, child, parent, depth = heapq.heappop(heap)
            [node] = tree.add_chain([tok], under=parent, confidence=[step])
            offer_children(child, -neg_p, node, depth)


def suffix_draft(index: SuffixIndex, context: Sequence[int], nodes: int, depth: int, vocab_size: int,
                 deterministic: bool) -> DraftTree:
    """The suffix drafter's tree to verify: at most `nodes` nodes, `depth` levels; a sampled
    request's draws carry their q, one-hot, since the index's tree is deterministic (which
    multi-draft verification handles exactly)."""
    tree = index.propose(context, nodes, max_depth=depth)
    if not deterministic and len(tree):
        tree.draw_q = one_hot([tree.tokens[node] for node in tree.draw_nodes], vocab_size)
    return tree
