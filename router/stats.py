"""What one served request's rounds did, recorded as they happen.

The coordinator records into a `RoundStats` through its methods; the
servicer reads it for the client's usage figures and the expertise
router's acceptance and goodput, `router.metrics` for Prometheus, and the benchmarks
for the trace of every timed call (which shows how drafting and verifying
overlap, and each side's idle fraction).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

DRAFTER_WORK = ("draft", "ahead")  # spans in which a request's drafters work on it
VERIFIER_WORK = ("verify", "prefill")  # ... and its verifier


@dataclass
class DrafterStats:
    proposed: int = 0  # nodes of the drafter's own trees
    accepted: int = 0  # per round: how much of the accepted path its own tree held


@dataclass
class Span:
    """One timed call of a request: 'draft' (the round waits for it), 'ahead' (drafting
    the next round while this one is verified), 'verify' or 'prefill'."""
    what: str
    round: int
    start: float  # time.monotonic()
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class RoundStats:
    target_forward_passes: int = 0
    draft_tokens: int = 0  # nodes of the trees verified (fused ones, with several drafters)
    accepted_draft_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # per round that sent a draft: tokens accepted
    per_drafter: dict[str, DrafterStats] = field(default_factory=dict)  # by drafter kind
    batch_sizes: list[int] = field(default_factory=list)
    reused_drafts: int = 0  # rounds whose tree was drafted ahead, during the previous verification
    forced_tokens: int = 0  # tokens a grammar forced (jump-forward): drafted for free
    draft_lengths: list[int] = field(default_factory=list)  # chosen per round (adaptive speculation)
    # verdicts whose pass the verifier timed, and those passes' seconds as plain decoding's
    # (every row one token: router.goodput.plain_pass_seconds), for the route's goodput
    timed_passes: int = 0
    plain_pass_seconds: float = 0.0
    trace: list[Span] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None

    # -- recording (the coordinator) ------------------------------------------
    @contextmanager
    def span(self, what: str, rnd: int) -> Iterator[Span]:
        """Time the block into the trace; the span it yields has its end once the block is over."""
        span = Span(what, rnd, time.monotonic(), 0.0)
        try:
            yield span
        finally:
            span.end = time.monotonic()
            self.trace.append(span)

    def record_span(self, what: str, rnd: int, start: float, end: float) -> Span:
        """A call timed elsewhere (on another thread)."""
        span = Span(what, rnd, start, end)
        self.trace.append(span)
        return span

    def record_prefill(self) -> None:
        """A prefill answered: one target pass, no draft."""
        self.target_forward_passes += 1

    def record_draft_length(self, length: int) -> None:
        self.draft_lengths.append(length)

    def record_reuse(self) -> None:
        """A round takes the tree drafted ahead during the previous verification."""
        self.reused_drafts += 1

    def record_round(self, drafted: int, accepted: int, batch_size: int, forced: int = 0) -> None:
        """A verdict: `drafted` nodes verified, `accepted` of them kept, in a pass of `batch_size`
        requests, `forced` tokens of them forced by the request's grammar (jump-forward)."""
        self.target_forward_passes += 1
        self.forced_tokens += forced
        self.draft_tokens += drafted
        self.accepted_draft_tokens += accepted
        if drafted:
            self.accepted_lengths.append(accepted)
        self.batch_sizes.append(batch_size)

    def record_timed_pass(self, plain_seconds: float) -> None:
        """A verdict's pass, as long as plain decoding's pass at its batch size would be."""
        if plain_seconds > 0:
            self.timed_passes += 1
            self.plain_pass_seconds += plain_seconds

    def record_drafter(self, kind: str, proposed: int, accepted: int) -> None:
        """One drafter's own tree in a verdict: its nodes, and how much of the accepted path it held."""
        own = self.per_drafter.setdefault(kind, DrafterStats())
        own.proposed += proposed
        own.accepted += accepted

    def finish(self) -> None:
        self.finished = time.monotonic()

    # -- reading ----------------------------------------------------------------
    def wall_seconds(self) -> float:
        """The request's wall time so far (until it finished)."""
        return max((self.finished or time.monotonic()) - self.started, 0.0)

    def first_prefilled(self) -> float | None:
        """When the request's first prefill ended (its first token was known), if it did."""
        return min((s.end for s in self.trace if s.what == "prefill"), default=None)

    def busy_seconds(self, *whats: str) -> float:
        return sum(s.end - s.start for s in self.trace if s.what in whats)

    def busy_by_side(self) -> dict[str, float]:
        """Seconds each side worked on the request."""
        return {"drafter": self.busy_seconds(*DRAFTER_WORK), "verifier": self.busy_seconds(*VERIFIER_WORK)}
