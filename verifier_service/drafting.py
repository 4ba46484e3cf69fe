"""What a verifier drafts with itself, round after round in a Decode call: prompt lookup
over the request's own text, or a suffix index of its requests' texts, one index per
memory namespace (speculative.namespaces), as a drafter pool keeps. The index learns the
text of each round it drafts and, at Release, the rest of a request's text (`learn`: a
request whose rounds were drafted in the pools). Only speed depends on the index:
verification alone decides the tokens."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

from speculative.namespaces import Namespaces
from speculative.ngram import lookup_draft
from speculative.suffix import SuffixFeed, SuffixIndex, suffix_draft
from speculative.tree import DraftTree

# requests whose feed into a suffix index a verifier keeps between rounds and calls; the
# least recently drafted one's is dropped past it (if that request drafts again, its text
# is fed again: counts grow, no tokens change)
MAX_FEEDS = 1024


class VerifierDrafting:
    """The drafts of a verifier's Decode rounds. Thread-safe: a call's first round is drafted
    on its gRPC thread, the others on the engine's worker as each pass ends."""

    def __init__(self, vocab_size: int, max_feeds: int = MAX_FEEDS):
        self.vocab_size, self.max_feeds = vocab_size, max_feeds
        self.indexes: Namespaces[SuffixIndex] = Namespaces(lambda _: SuffixIndex())
        self._feeds: OrderedDict[str, tuple[str, SuffixFeed]] = OrderedDict()  # request id: (namespace, feed)
        self._lock = threading.Lock()

    def tree(self, drafter: str, request_id: str, namespace: str, tokens: Sequence[int], depth: int, nodes: int,
             deterministic: bool) -> DraftTree:
        """The next round's tree after `tokens` (the request's whole text): at most `depth`
        levels and, for a suffix tree, `nodes` nodes (0: a chain's worth). The suffix index
        learns the text first, however short the draft (0: none)."""
        if drafter == "pld":
            return lookup_draft(tokens, depth, self.vocab_size, deterministic)
        if drafter != "suffix":
            return DraftTree()
        index = self.indexes.get(namespace)
        self._feed(namespace, request_id).feed(index, tokens)
        return suffix_draft(index, tokens, nodes or depth, depth, self.vocab_size, deterministic)

    def _feed(self, namespace: str, request_id: str) -> SuffixFeed:
        """The request's feed into its namespace's index (a new one if it had none there)."""
        with self._lock:
            held, feed = self._feeds.pop(request_id, (namespace, None))
            if feed is None or held != namespace:
                feed = SuffixFeed()
            self._feeds[request_id] = (namespace, feed)
            while len(self._feeds) > self.max_feeds:
                self._feeds.popitem(last=False)
        return feed

    def learn(self, request_id: str, namespace: str, tokens: Sequence[int]) -> None:
        """The request's whole text into its namespace's index: what the request's rounds
        drafted here have not fed yet (all of it, if none was drafted here)."""
        self._feed(namespace, request_id).feed(self.indexes.get(namespace), tokens)

    def release(self, request_id: str) -> None:
        """Forget the request's feed (its text stays in the index)."""
        with self._lock:
            self._feeds.pop(request_id, None)
