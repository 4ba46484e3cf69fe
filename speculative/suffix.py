"""Suffix drafting (SuffixDecoding): continue the text the way it went on after
the same recent tokens, in any sequence seen before.

The index keeps the sequences added to it (prompts, earlier outputs) and, for
each of a few gram lengths, where every gram ended. To draft, find the longest
recent part of the context (up to `depth` tokens) that a sequence holds with a
token after it, count how the text went on after each place it did, and
expand the most frequent continuations best-first into a token tree. Feeding
a token costs a few dictionary appends, whatever the depths: the counts are
made when a draft asks for them, from the places found. Model-free and cheap.
"""

from __future__ import annotations

import heapq
import threading
from array import array
from itertools import count
from typing import Sequence

from .tree import DraftTree, one_hot

# Gram lengths whose ends are indexed, longest first: a draft looks its context's grams up
# from the longest, and the first one found holds every place the longest match can be
# (a match of 5 tokens ends with the 4-gram). More lengths find long matches among fewer
# places; each costs every fed token one more append.
GRAMS = (8, 4, 2, 1)
# Places of one gram a draft looks at, the latest ones: a common gram (", the") ends at
# thousands, and the latest few hundred say how the text goes on as well.
MAX_PLACES = 128
_POSITION_BITS = 32  # a place is (sequence << _POSITION_BITS) | position


class SuffixStream:
    """One growing sequence being fed into an index: its number among the index's sequences
    and its tokens (the index's own list of them), whose last ones are fed again after the
    index starts afresh."""

    def __init__(self):
        self.sequence = -1  # the index's number for it, in the index's current generation
        self.tokens: list[int] = []
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
    """The sequences fed to it and where each gram of `GRAMS` ended in them: `depth` tokens
    at most to match the context on, `max_draft` to continue with. Shared by many requests,
    so it is locked; past `max_tokens` tokens it starts afresh."""

    def __init__(self, depth: int = 16, max_draft: int = 16, max_tokens: int = 500_000):
        if depth < 1 or max_draft < 1:
            raise ValueError("depth and max_draft must be at least 1")
        self.depth, self.max_draft, self.max_tokens = depth, max_draft, max_tokens
        self.window = depth + max_draft
        self.grams = tuple(n for n in GRAMS if n <= depth)
        self.tokens = 0  # fed since the index last started afresh
        self.generation = 0
        self._sequences: list[list[int]] = []
        self._ends: dict[int, int | array] = {}  # a gram's hash: the place right after it, or places, oldest first
        self._lock = threading.Lock()

    def add(self, tokens: Sequence[int]) -> None:
        """Index a whole sequence."""
        self.feed(SuffixStream(), tokens)

    def feed(self, stream: SuffixStream, tokens: Sequence[int]) -> None:
        """Append `tokens` to the sequence `stream` stands for."""
        with self._lock:
            if self.tokens > self.max_tokens:
                self._sequences, self._ends, self.tokens = [], {}, 0
                self.generation += 1
            if stream.generation != self.generation:  # new stream, or the index was reset
                tokens = stream.tokens[-self.window:] + list(tokens)
                stream.sequence, stream.tokens, stream.generation = len(self._sequences), [], self.generation
                self._sequences.append(stream.tokens)
            seq, ends, grams = stream.tokens, self._ends, self.grams
            base = stream.sequence << _POSITION_BITS
            for tok in tokens:
                seq.append(tok)
                end = len(seq)
                place = base | end
                for n in grams:
                    if n <= end:
                        key = hash(tuple(seq[end - n:]))
                        found = ends.get(key)
                        if found is None:  # most grams end once: a plain int until they end again
                            ends[key] = place
                        elif type(found) is int:
                            ends[key] = array("q", (found, place))
                        else:
                            found.append(place)
            self.tokens += len(tokens)

    def _places(self, context: Sequence[int]) -> list[tuple[list[int], int]]:
        """Where the longest suffix of `context` (up to depth) that the index holds with a token
        after it ends: (sequence, position of that token), among its latest MAX_PLACES."""
        longest = min(self.depth, len(context))
        for n in self.grams:
            if n > longest:
                continue
            found = self._ends.get(hash(tuple(context[len(context) - n:])))
            if found is None:
                continue
            matches = []
            for place in (found,) if type(found) is int else found[-MAX_PLACES:]:
                seq = self._sequences[place >> _POSITION_BITS]
                end = place & ((1 << _POSITION_BITS) - 1)
                if end >= len(seq):  # nothing after it yet
                    continue
                m = 0  # how far back the sequence matches the context (a hash collision: not n)
                while m < min(longest, end) and seq[end - 1 - m] == context[len(context) - 1 - m]:
                    m += 1
                if m >= n:
                    matches.append((m, seq, end))
            if matches:
                best = max(m for m, _, _ in matches)
                return [(seq, end) for m, seq, end in matches if m == best]
        return []

    def propose(self, context: Sequence[int], max_tokens: int, min_probability: float = 0.1,
                max_depth: int | None = None) -> DraftTree:
        """A tree of at most `max_tokens` nodes and `max_depth` levels (default: the
        index's `max_draft`) continuing `context`, grown best-first by
        the empirical probability of each node's path (kept only while >= min_probability).
        A node's confidence is the empirical probability of its token after its parent."""
        tree = DraftTree()
        if max_tokens <= 0:
            return tree
        depth = self.max_draft if max_depth is None else min(max_depth, self.max_draft)
        with self._lock:
            places = self._places(context)
            # how the text went on after each place: token -> [count, what followed it]
            after: dict[int, list] = {}
            for seq, end in places:
                level = after
                for tok in seq[end:end + depth]:
                    entry = level.get(tok)
                    if entry is None:
                        entry = level[tok] = [0, {}]
                    entry[0] += 1
                    level = entry[1]
        _expand(tree, after, max_tokens, min_probability, depth)
        return tree


def _expand(tree: DraftTree, after: dict[int, list], max_tokens: int, min_probability: float,
            max_depth: int) -> None:
    tie = count()  # equal probabilities: first seen first
    heap: list = []

    def offer_children(children: dict[int, list], prob: float, parent: int, depth: int) -> None:
        if depth >= max_depth or not children:
            return
        total = sum(n for n, _ in children.values())
        for tok, (n, grandchildren) in children.items():
            p = prob * n / total
            if p >= min_probability:
                heapq.heappush(heap, (-p, next(tie), tok, n / total, grandchildren, parent, depth + 1))

    offer_children(after, 1.0, -1, 0)
    while heap and len(tree) < max_tokens:
        neg_p, _, tok, step, children, parent, depth = heapq.heappop(heap)
        [node] = tree.add_chain([tok], under=parent, confidence=[step])
        offer_children(children, -neg_p, node, depth)


def suffix_draft(index: SuffixIndex, context: Sequence[int], nodes: int, depth: int, vocab_size: int,
                 deterministic: bool) -> DraftTree:
    """The suffix drafter's tree to verify: at most `nodes` nodes, `depth` levels; a sampled
    request's draws carry their q, one-hot, since the index's tree is deterministic (which
    multi-draft verification handles exactly)."""
    tree = index.propose(context, nodes, max_depth=depth)
    if not deterministic and len(tree):
        tree.draw_q = one_hot([tree.tokens[node] for node in tree.draw_nodes], vocab_size)
    return tree
