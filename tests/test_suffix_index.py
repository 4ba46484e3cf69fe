"""The suffix index (speculative.suffix) against a brute-force reading of its contract:
after the longest suffix of the context (up to `depth` tokens) that a fed sequence holds
with a token after it, the tree continues the way the text went on at those places,
grown best-first by each path's share of them (ties: the place fed first first)."""

from __future__ import annotations

import heapq
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from speculative.suffix import MAX_PLACES, SuffixFeed, SuffixIndex


def brute_force(sequences: list[list[int]], log: list[tuple[int, int]], context: list[int], max_tokens: int,
                depth: int, max_draft: int, min_probability: float = 0.1) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the tree the contract asks for, from every place by scanning.
    `log` is every fed token as (sequence, position after it), in the order fed."""
    for n in range(min(depth, len(context)), 0, -1):
        places = [(s, end) for s, end in log
                  if n <= end < len(sequences[s]) and sequences[s][end - n:end] == context[-n:]]
        if places:
            break
    else:
        return [], []
    paths: dict[tuple[int, ...], int] = {}  # every continuation prefix: how many places go on that way
    for s, end in places:
        for k in range(1, max_draft + 1):
            if end + k > len(sequences[s]):
                break
            prefix = tuple(sequences[s][end:end + k])
            paths[prefix] = paths.get(prefix, 0) + 1
    tokens, parents, node_of, heap, offered = [], [], {(): -1}, [], 0

    def offer(path: tuple[int, ...], p: float) -> None:  # its continuations, first seen first
        nonlocal offered
        children = [c for c in paths if len(c) == len(path) + 1 and c[:-1] == path]
        total = sum(paths[c] for c in children)
        for c in children:
            heapq.heappush(heap, (-p * paths[c] / total, offered, c))
            offered += 1

    offer((), 1.0)
    while heap and len(tokens) < max_tokens:
        neg_p, _, path = heapq.heappop(heap)
        if -neg_p < min_probability:
            continue
        node_of[path] = len(tokens)
        tokens.append(path[-1])
        parents.append(node_of[path[:-1]])
        offer(path, -neg_p)
    return tokens, parents


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.integers(2, 6), depth=st.integers(1, 6),
       max_draft=st.integers(1, 5), max_tokens=st.integers(1, 8))
def test_trees_follow_every_place_the_longest_match_ends(seed, vocab, depth, max_draft, max_tokens):
    """Sequences fed in chunks, several at once (as requests' texts are), then drafts after
    contexts taken from them and random ones. Fewer places than MAX_PLACES: all count."""
    rng = random.Random(seed)
    texts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 20))] for _ in range(rng.randint(1, 5))]
    index = SuffixIndex(depth=depth, max_draft=max_draft)
    feeds, fed = [SuffixFeed() for _ in texts], [0] * len(texts)
    sequences: list[list[int]] = [[] for _ in texts]
    log: list[tuple[int, int]] = []
    while any(n < len(t) for n, t in zip(fed, texts)):
        i = rng.choice([i for i, t in enumerate(texts) if fed[i] < len(t)])
        fed[i] = min(len(texts[i]), fed[i] + rng.randint(1, 4))
        feeds[i].feed(index, texts[i][:fed[i]])
        while len(sequences[i]) < fed[i]:
            sequences[i].append(texts[i][len(sequences[i])])
            log.append((i, len(sequences[i])))
    assert sum(map(len, texts)) < MAX_PLACES
    contexts = [t[:rng.randint(1, len(t))] for t in texts] + [[rng.randrange(vocab + 1) for _ in range(3)]]
    for context in contexts:
        tree = index.propose(context, max_tokens)
        assert (tree.tokens, tree.parents) == brute_force(sequences, log, context, max_tokens, depth, max_draft)


def test_a_common_gram_drafts_from_its_latest_places():
    """Past MAX_PLACES places of the matched suffix, the latest ones say how the text goes on."""
    index = SuffixIndex(depth=2, max_draft=1)
    for _ in range(MAX_PLACES):
        index.add([1, 2, 3])
    assert index.propose([1, 2], 1).tokens == [3]
    for _ in range(MAX_PLACES):
        index.add([1, 2, 4])
    assert index.propose([1, 2], 1).tokens == [4]


def test_feeding_a_text_again_in_other_chunks_counts_it_again():
    """Each feed is a place of its own: two requests with the same text count twice."""
    index = SuffixIndex(depth=2, max_draft=1)
    index.add([7, 8, 1])
    index.add([7, 8, 2])
    feed = SuffixFeed()
    feed.feed(index, [7, 8])
    feed.feed(index, [7, 8, 2])
    tree = index.propose([7, 8], 2)
    assert tree.tokens == [2, 1] and tree.confidence == [2 / 3, 1 / 3]
