"""Several drafters as one: each round their proposals fused into one tree (speculative.fusion),
greedy proposals' confidences calibrated first (speculative.calibration). Here, below the
services, so that a drafter pool and a verifier's own Decode rounds fuse alike."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from .calibration import Calibration
from .decoding import DraftRequest
from .drafter_kinds import Abilities
from .fusion import fuse
from .tree import DraftTree


class FusedDrafter:
    """Several drafters' proposals fused into one tree per round
    (`speculative.fusion.fuse`), in one process: what the router does across
    pools, for the CLI, the benchmarks, a verifier's Decode rounds and the tests. Each member draws from
    its own random stream, seeded each round from the request's (fused
    sampling is exact only if members draw independently), and drafts up to
    `member_tokens` (default: the round's budget).

    Greedy, a member with a `Calibration` has its confidences mapped to the
    target's measured acceptance rates before fusion, and the calibration
    learns from each verdict, read off the next call's context."""

    def __init__(self, members: Sequence[tuple[object, float]], member_tokens: int | None = None,
                 calibrations: Sequence[Calibration | None] | None = None):
        self.members, self.member_tokens = list(members), member_tokens  # (drafter, reliability in [0, 1])
        self.calibrations = list(calibrations) if calibrations is not None else [None] * len(self.members)
        if len(self.calibrations) != len(self.members):
            raise ValueError("one calibration (or None) per member")
        self.name = "+".join(getattr(d, "name", "drafter") for d, _ in self.members)
        # last round's context (its length and last token) and proposals, to learn its verdict from
        self._last: tuple[int, int, list[DraftTree]] | None = None
        # the last round's member trees, in member order (what each proposed: its own credit)
        self.proposed: list[DraftTree] = []
        # only a fusion with a member that learns from the target's scores asks for them
        # (the decoding loop pays for the prompt's and each round's top candidates)
        self.abilities = Abilities()
        for drafter, _ in self.members:
            self.abilities = self.abilities.joined(drafter.abilities)
        self._learners = [d for d, _ in self.members if d.abilities.learns_from_target]
        # a member that drafts from the target's features (EAGLE) gets them in the request it is given
        self.feature_layers = next((d.feature_layers for d, _ in self.members
                                    if d.abilities.drafts_from_features), None)

    def propose(self, request: DraftRequest) -> DraftTree:
        context, greedy, nodes = request.context, request.params.deterministic, request.nodes
        member = replace(request, depth=min(request.depth, self.member_tokens or request.depth), max_nodes=nodes)
        if greedy:
            self._learn(request.known)
        proposals = []
        for drafter, reliability in self.members:
            own = None if greedy else torch.Generator().manual_seed(
                int(torch.randint(2**62, (), generator=request.generator)))
            proposals.append((drafter.propose(replace(member, generator=own)), reliability))
        self.proposed = [tree for tree, _ in proposals]
        if not greedy:
            return fuse(proposals, nodes, greedy=False)
        if len(request.known) == len(context):  # not a draft ahead of an unverified guess
            self._last = (len(context), context[-1], [tree for tree, _ in proposals])
        return fuse([(cal.calibrated(tree) if cal else tree, reliability)
                     for (tree, reliability), cal in zip(proposals, self.calibrations)], nodes, greedy=True)

    def _learn(self, known: Sequence[int]) -> None:
        """Teach the calibrations last round's verdict: what the target took after its context."""
        if self._last is None:
            return
        n, last, trees = self._last
        if len(known) > n and known[n - 1] == last:
            for tree, cal in zip(trees, self.calibrations):
                if cal is not None:
                    cal.learn(tree, known[n:])
        self._last = None

    def observe(self, tokens: Sequence[int], ids: torch.Tensor, probs: torch.Tensor) -> None:
        for drafter in self._learners:
            drafter.observe(tokens, ids, probs)
