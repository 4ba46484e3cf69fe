"""A request as the coordinator runs it (`Job`), and the ways a request fails as a whole."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

from speculative.drafter_kinds import VERIFIER_DRAFTERS, abilities, eagle_feature_layers
from speculative.logprobs import TokenLogprob
from speculative.namespaces import DEFAULT_NAMESPACE
from speculative.sampling import SamplingParams
from speculative.tree import nodes_for_depth

from ..adaptive import SpeculationControl


class Emitted(list):
    """A round's newly verified tokens (a list of them), with their logprobs when the
    request asks for them (one each; None otherwise)."""

    def __init__(self, tokens=(), logprobs: list[TokenLogprob] | None = None):
        super().__init__(tokens)
        self.logprobs = logprobs

    def cut(self, tokens: list[int]) -> "Emitted":
        """The first len(tokens) of these (as clipped), their logprobs with them."""
        return Emitted(tokens, None if self.logprobs is None else self.logprobs[:len(tokens)])


class DeadlineExceeded(Exception):
    pass


class Cancelled(Exception):
    pass


class NoService(Exception):
    """No live service of a kind is left to try."""


@dataclass
class Job:
    request_id: str  # the client's (or a new) id, echoed in the answer
    prompt_ids: list[int]
    params: SamplingParams
    # (kind, reliability on the request's domain in [0, 1]) of each drafter, best first;
    # (("none", 1.0),) for plain decoding. Reliability weighs a drafter's nodes in fusion.
    drafters: tuple[tuple[str, float], ...]
    draft_length: int  # most tokens a drafter drafts per round
    tree_budget: int  # most nodes of a round's tree (fused, or one tree drafter's) at full draft length
    vocab_size: int  # the target's: fusion reads the drafters' trees back from the wire
    eos_token_ids: Sequence[int]
    deadline: float | None = None  # time.monotonic() value
    domain: str | None = None  # the request's domain, when the router knows it
    is_cancelled: Callable[[], bool] = lambda: False
    pipelined: bool = False  # draft each next round while this one is verified
    speculation: SpeculationControl | None = None  # adaptive draft length; None: always draft_length
    stop_confidence: float = 0.0  # model drafters stop after a token drafted with less confidence
    namespace: str = DEFAULT_NAMESPACE  # the memory its drafters learn in (speculative.namespaces)
    # rounds only drafters the verifier runs draft (prompt lookup, suffix, none): the verifier
    # may run them itself (Decode)
    verifier_drafting: bool = False
    # prefill the drafters' pools while the verifier prefills (pools with hardware of their own)
    prefill_pools_ahead: bool = False
    # where its eagle drafter runs, if it has one: "verifier" (beside the target, Decode rounds) or
    # "pool" (the verifier sends each round's features, the router hands them on)
    eagle_placement: str = "verifier"
    # the verifier's suffix index learns the request's text when it ends even if the suffix
    # drafter drafted none of it: a routed ("auto") request's next one may be routed to it
    teaches_suffix: bool = False
    # the request's key at the verifiers, pools and checkpoints: unique, whatever id clients send
    service_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def eagle(self) -> str | None:
        """The request's drafter that drafts from the target's features (eagle), if any."""
        return next((kind for kind, _ in self.drafters if abilities(kind).drafts_from_features), None)

    @property
    def verifier_kinds(self) -> tuple[str, ...]:
        """The request's drafter kinds a verifier can draft itself (Decode)."""
        eagle = self.eagle if self.eagle_placement == "verifier" else None
        return VERIFIER_DRAFTERS + ((eagle,) if eagle else ())

    @property
    def pool_feature_layers(self) -> tuple[int, ...]:
        """The layers the verifier captures for the request's eagle drafter in a pool (none: ())."""
        eagle = self.eagle
        return eagle_feature_layers(eagle) if eagle and self.eagle_placement == "pool" else ()

    @property
    def verifier_eagle(self) -> str:
        """The eagle drafter the verifier runs for this request ("": none)."""
        return self.eagle if self.eagle and self.eagle_placement == "verifier" else ""

    @property
    def max_tree_nodes(self) -> int:
        """The most nodes a round's tree can have."""
        return max(self.tree_budget, self.draft_length)

    def tree_nodes(self, length: int) -> int:
        """Most nodes of a drafter's tree `length` deep: the tree budget in proportion to the
        length (adaptive speculation shortens both), and at least a chain's worth."""
        return nodes_for_depth(length, self.draft_length, self.tree_budget)

    def timeout(self) -> float | None:
        """Seconds left before the deadline, for the next downstream call."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded()
        return left
