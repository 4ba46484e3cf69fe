"""What a verifier drafts with itself, round after round in a Decode call: prompt lookup
over the request's own text, or a suffix index of its requests' texts, one index per
memory namespace (speculative.namespaces), as a drafter pool keeps. The index learns the
text of each round it drafts and, at Release, the rest of a request's text (`learn`: a
request whose rounds were drafted in the pools). Only speed depends on the index:
verification alone decides the tokens.

An eagle drafter (the target's features, speculative.eagle) drafts here too, beside the
target (`[router] eagle_placement = "verifier"`): a request prefilled with one gets its own
`EagleDrafter` over the process's head (`shared_head` loads it once), fed the
features of the request's prompt and of every pass that verifies its rounds here, so no
feature crosses the network. Several drafters joined by "+" are fused as in process
(speculative.fused_drafter.FusedDrafter over speculative.fusion.fuse), the lookup members
drafting from this verifier's own indexes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import torch

from speculative.decoding import DraftRequest
from speculative.drafter_kinds import VERIFIER_DRAFTERS, Abilities, abilities, eagle_path
from runtime.eagle_head import shared_head
from speculative.calibration import Calibration
from speculative.eagle import EagleDrafter
from speculative.fused_drafter import FusedDrafter
from speculative.namespaces import Namespaces
from speculative.ngram import lookup_draft
from speculative.sampling import InvalidArgument, SamplingParams, make_generator
from speculative.suffix import SuffixFeed, SuffixIndex, suffix_draft
from speculative.tree import DraftTree

# requests whose feed into a suffix index a verifier keeps between rounds and calls; the
# least recently drafted one's is dropped past it (if that request drafts again, its text
# is fed again: counts grow, no tokens change)
MAX_FEEDS = 1024
# requests whose eagle drafter (its head's KV cache and fused features) a verifier keeps; past
# it the least recently used one's goes, and its next Decode answers state_lost (prefill again)
MAX_EAGLES = 256


def verifier_drafter(name: str) -> bool:
    """Whether a verifier drafts `name` itself: pld, suffix, none, an eagle head, or several
    of the drafting ones joined by '+'."""
    if "+" in name:
        return all(part not in ("", "none") and verifier_drafter(part) for part in name.split("+"))
    return name in VERIFIER_DRAFTERS or eagle_path(name) is not None


def uses_eagle(name: str) -> bool:
    return abilities(name).drafts_from_features


class _Lookup:
    """pld or suffix as a fusion member: this verifier's own drafts (`VerifierDrafting.tree`)."""

    def __init__(self, drafting: "VerifierDrafting", kind: str, request_id: str, namespace: str):
        self.drafting, self.name, self.request_id, self.namespace = drafting, kind, request_id, namespace
        self.abilities = Abilities()

    def propose(self, request: DraftRequest) -> DraftTree:
        return self.drafting.tree(self.name, self.request_id, self.namespace, request.context, request.depth,
                                  request.nodes, request.params.deterministic)


class _EagleState:
    """One request's eagle drafter here, its drafter stream, and its fusions."""

    def __init__(self, drafter: EagleDrafter, generator: torch.Generator):
        self.drafter, self.generator = drafter, generator
        self.fused: dict[str, FusedDrafter] = {}  # by drafter name ("eagle+pld+suffix")
        self.lock = threading.Lock()


class VerifierDrafting:
    """The drafts of a verifier's Decode rounds. Thread-safe: a call's first round is drafted
    on its gRPC thread, the others on the engine's worker as each pass ends."""

    def __init__(self, vocab_size: int, max_feeds: int = MAX_FEEDS, target=None, max_eagles: int = MAX_EAGLES):
        """`target`: the verifier's model, which eagle heads attach to (None: no eagle here)."""
        self.vocab_size, self.max_feeds, self.target, self.max_eagles = vocab_size, max_feeds, target, max_eagles
        self.indexes: Namespaces[SuffixIndex] = Namespaces(lambda _: SuffixIndex())
        self._feeds: OrderedDict[str, tuple[str, SuffixFeed]] = OrderedDict()  # request id: (namespace, feed)
        self._eagles: OrderedDict[str, _EagleState] = OrderedDict()  # request id: its eagle drafter
        self._calibrations: Namespaces[dict[str, Calibration]] = Namespaces(lambda _: {})
        self._lock = threading.Lock()

    # ---- eagle beside the target ---------------------------------------------------

    def _eagle(self, name: str) -> EagleDrafter:
        """A fresh drafter over eagle head `name`, attached to the target."""
        return EagleDrafter(shared_head(eagle_path(name), self.target))

    def _calibration(self, namespace: str, kind: str) -> Calibration:
        """The namespace's calibration of a fusion member's confidences here, kept across requests."""
        with self._lock:
            return self._calibrations.get(namespace).setdefault(kind, Calibration())

    def eagle_layers(self, name: str) -> tuple[int, ...]:
        """The target layers eagle head `name` drafts from (InvalidArgument naming
        `verifier_drafter` if it is none or cannot be loaded here)."""
        if self.target is None or eagle_path(name) is None:
            raise InvalidArgument("verifier_drafter", f"this verifier drafts with no {name!r}: an eagle head "
                                  "(eagle or a head directory) only")
        try:
            return tuple(self._eagle(name).feature_layers)  # the head loads once a process
        except (FileNotFoundError, ValueError) as exc:
            raise InvalidArgument("verifier_drafter", str(exc)) from exc

    def start_eagle(self, request_id: str, name: str, params: SamplingParams, resumed: int,
                    features: tuple[int, torch.Tensor]) -> None:
        """A request prefilled with eagle head `name` drafting here: a fresh drafter fed the
        prompt's features (its stream: the drafter's, stream 1, fresh when `resumed`)."""
        state = _EagleState(self._eagle(name),
                            make_generator(params.seed, self.target.device, stream=1, resumed=resumed))
        state.drafter.take_features(*features)
        with self._lock:
            self._eagles.pop(request_id, None)
            self._eagles[request_id] = state
            while len(self._eagles) > self.max_eagles:
                self._eagles.popitem(last=False)

    def eagle_capture(self, request_id: str) -> tuple[int, ...] | None:
        """The layers a pass verifying this request captures for its eagle drafter here (None: it has none)."""
        with self._lock:
            state = self._eagles.get(request_id)
        return None if state is None else tuple(state.drafter.feature_layers)

    def take_features(self, request_id: str, features: tuple[int, torch.Tensor] | None) -> None:
        """The features of the positions a pass verified, to the request's eagle drafter (if it has one)."""
        with self._lock:
            state = self._eagles.get(request_id)
        if state is not None and features is not None:
            with state.lock:
                state.drafter.take_features(*features)

    def drop_eagle(self, request_id: str) -> None:
        with self._lock:
            self._eagles.pop(request_id, None)

    def has_eagle(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._eagles

    def draft(self, drafter: str, request_id: str, namespace: str, tokens: Sequence[int], depth: int, nodes: int,
              params: SamplingParams | None) -> DraftTree:
        """The next round's tree of any drafter the verifier runs (`verifier_drafter`), fused
        when joined by '+'; `params` None (a request restored from a checkpoint, its
        sampling not known yet here): greedy lookup drafts alone."""
        return self.draft_members(drafter, request_id, namespace, tokens, depth, nodes, params)[0]

    def draft_members(self, drafter: str, request_id: str, namespace: str, tokens: Sequence[int], depth: int,
                      nodes: int, params: SamplingParams | None) -> tuple[DraftTree, list[DraftTree]]:
        """`draft`'s tree and, fused (joined by '+'), each member's own tree of the round in
        the drafter's order (for crediting each its share); [] when no fusion drafted."""
        deterministic = params is None or params.deterministic
        if "+" not in drafter and not uses_eagle(drafter):
            return self.tree(drafter, request_id, namespace, tokens, depth, nodes, deterministic), []
        with self._lock:
            state = self._eagles.get(request_id) if uses_eagle(drafter) else None
        if state is None and uses_eagle(drafter):
            return DraftTree(), []  # the servicer answers state_lost before it comes to this
        if params is None or depth <= 0:
            return DraftTree(), []
        if state is None:  # lookups fused, no eagle: a fusion of its own each call (nothing learned between)
            fused = self._fusion(drafter, None, request_id, namespace)
            tree = fused.propose(DraftRequest(list(tokens), depth, params, make_generator(params.seed),
                                              max_nodes=nodes or depth))
            return tree, list(fused.proposed)
        with state.lock:
            if "+" not in drafter:
                return state.drafter.propose(DraftRequest(list(tokens), depth, params, state.generator,
                                                          max_nodes=nodes or depth)), []
            fused = state.fused.get(drafter) or state.fused.setdefault(
                drafter, self._fusion(drafter, state.drafter, request_id, namespace))
            tree = fused.propose(DraftRequest(list(tokens), depth, params, state.generator, max_nodes=nodes or depth))
            return tree, list(fused.proposed)

    def _fusion(self, name: str, eagle: EagleDrafter | None, request_id: str, namespace: str) -> FusedDrafter:
        """`name`'s members fused as in process (every member trusted alike; greedy, their
        confidences calibrated in the namespace, as a pool's fusions are)."""
        parts = name.split("+")
        members = [(eagle if uses_eagle(part) else _Lookup(self, part, request_id, namespace), 1.0) for part in parts]
        if self.target is None:
            return FusedDrafter(members)
        return FusedDrafter(members, calibrations=[self._calibration(namespace, part) for part in parts])

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
        """Forget the request's feed (its text stays in the index) and its eagle drafter."""
        with self._lock:
            self._feeds.pop(request_id, None)
            self._eagles.pop(request_id, None)
