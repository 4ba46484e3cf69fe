"""One request's rounds, a step each: prefill (the first round, or to resume), the verifier's
own rounds (Decode), or plan, draft, verify and learn."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from protos import specserve_pb2 as pb
from protos.convert import logprobs_from_pb
from speculative.calibration import Calibration
from speculative.logprobs import TokenLogprob
from speculative.pipeline import likeliest_path
from speculative.recycling import CANDIDATES
from speculative.tree import DraftTree

from ..adaptive import DraftCostMemory, SpeculationControl
from ..goodput import plain_pass_seconds
from ..settings import RouterSettings
from ..stats import RoundStats
from .draft_side import Drafting
from .job import Emitted, Job
from .services import Services
from .verify_side import VerifySide


_DEFAULTS = RouterSettings()
_SETTINGS_COSTS = (_DEFAULTS.verify_row_cost, _DEFAULTS.verify_token_cost, _DEFAULTS.verify_pad_cost)


def _load(resp: pb.VerifyResponse) -> int:
    """Requests sharing the verifier, from a verdict: those of its pass and queued, and those it
    holds between rounds (drafting, on the wire), which the next passes will carry too."""
    return max(1, resp.batch_size + resp.queued, resp.active_requests)


@dataclass
class _Draft:
    """One round's draft, as the steps after drafting need it."""
    room: int  # draft tokens the request has room for before this round's bonus token
    lengths: list[int]  # each drafter's draft length this round
    budgets: list[int]  # ... cut to the room
    proposals: list[DraftTree] = field(default_factory=list)  # each drafter's own tree; none when none drafts
    tree: DraftTree = field(default_factory=DraftTree)  # what the verifier checks
    costs: list[float] | None = None  # each drafter's seconds per token of depth, when drafted this round
    round_cost: float | None = None  # what the drafting call cost beyond the drafters' own time
    verify_seconds: float = 0.0  # the verify call's, once answered


class Request:
    """One request's rounds, a method per step (prefill, draft, verify, learn), and what
    they carry from one round to the next."""

    def __init__(self, services: Services, job: Job, stats: RoundStats, draft_costs: DraftCostMemory,
                 calibration: Callable[[str, str], Calibration] | None):
        """`draft_costs`: what drafting cost lately at each load, shared by the coordinator's
        requests; `calibration(kind, namespace)`: a drafter kind's confidence calibration there (None: fusion
        uncalibrated)."""
        self.job, self.stats, self.draft_costs, self.services = job, stats, draft_costs, services
        self.verified: list[int] = []  # generated tokens; the last one is pending at the verifier
        self.verifier, self.drafting = VerifySide(services, job), Drafting(services, job, calibration)
        # adaptive speculation: one control per drafter, each learning its own acceptance
        self.controls = None if job.speculation is None else [
            dataclasses.replace(job.speculation, prior=reliability) if len(job.drafters) > 1 else job.speculation
            for _, reliability in job.drafters]
        self.ready: list[DraftTree] | None = None  # each drafter's tree for this round, drafted ahead
        self.candidates = CANDIDATES if any(services.learns_from_target(kind) for kind, _ in job.drafters) else 0
        self.rnd, self.load = 0, 1  # round; requests sharing the verifier
        # rounds the verifier runs itself (Decode): those that ask no drafter only a pool runs
        # (the load makes none pay, or the request's own draft is one the verifier makes; plain
        # ones bring back the target's candidates for the drafters that learn from them), and
        # every one when each of the request's drafters is one the verifier runs
        self.plain_on_verifier = job.verifier_drafting and not job.pipelined
        on_verifier = job.verifier_kinds
        self.own_rounds = (self.plain_on_verifier and not self.candidates
                           and all(kind in on_verifier for kind, _ in job.drafters))
        # what those rounds draft with: the request's best drafter that the verifier runs; with an
        # eagle drafter there, every one of them, fused there as in process
        kinds = [kind for kind, _ in job.drafters if kind in on_verifier and kind != "none"]
        self.verifier_drafter = ("+".join(kinds) if job.verifier_eagle and kinds
                                 else next(iter(kinds), "none"))

    def rounds(self, context: list[int]) -> Iterator[list[int]]:
        """The next round's new tokens, or the verifier's own rounds' one by one; none when the
        verifier lost the request (the next round prefills it again)."""
        if not self.verified or self.verifier.stub is None:
            yield self.prefill(context)  # the first round, or the verifier lost the request
        elif self.own_rounds:
            yield from self.decode(context)
        else:
            draft = self.plan()
            if self.plain_on_verifier and not self.asks_pools(draft):
                # no pool drafter's draft pays now: rounds on the verifier, drafted there (no
                # pool, no hop) by the request's drafter it runs, if any, else plain
                yield from self.decode(context)
                return
            self.draft(context, draft)
            verdict = self.verify(context, draft)
            if verdict is not None:
                yield self.learn(context, draft, verdict)

    def prefill(self, context: list[int]) -> list[int]:
        """Prefill every verified token; the answer is the next token, exactly as a round
        would give it."""
        if not self.verified and self.job.prefill_pools_ahead and not self.own_rounds:
            self.drafting.prefill_ahead(context)
        with self.stats.span("prefill", self.rnd):
            prefilled = self.verifier.prefill(context, self.candidates)
        self.drafting.take_features(prefilled)  # every verified position's, for a pool's eagle
        self.ready, self.load = None, max(1, self.verifier.active_requests)
        if not self.verified and self.plain_on_verifier:
            # what drafting costs at this load, where a drafted round pays a hop plain rounds do not
            for c, (kind, _) in zip(self.controls or (), self.job.drafters):
                self.draft_costs.start(c, kind, self.load)
        seeded = len(prefilled.candidate_ids) // self.candidates if self.candidates else 0
        if seeded:  # the target's predictions after the prompt's last tokens
            self.drafting.observe(context[len(context) - seeded:], prefilled)
        self.stats.record_prefill()
        return Emitted([prefilled.next_token], _logprobs(prefilled, self.job))

    def decode(self, context: list[int]) -> Iterator[list[int]]:
        """Rounds the verifier runs on its own (Decode), up to DECODE_ROUNDS, each round's new
        tokens as it ends, drafted by the request's drafter it runs at the length that
        drafter's control chooses at the start (plain if that is 0). Plain rounds bring back
        the target's candidates at each round's token, for the drafters that learn from them.
        Stops early when the verifier loses the request: the next round prefills it again."""
        job = self.job
        kind = self.verifier_drafter
        control, length = None, 0
        if kind != "none":  # a fusion's length: its first (best) member's control chooses it
            i = [k for k, _ in job.drafters].index(kind.split("+")[0])
            control = self.controls[i] if self.controls else None
            length = job.draft_length if control is None else control.length(self.load, drafted_by_verifier=True)
        # a probe drafts the call's first round only: its verdict teaches the control before
        # more are drafted (else a probe would draft a whole call's rounds at a poor acceptance)
        probe = control is not None and length > 0 and control.probing
        # a verifier drafter's control that chose no draft, or a probe: each of the call's rounds
        # after the first, which it leaves plain, counts towards its next probe (one pays no hop here)
        undrafted = control if length == 0 or probe else None
        if length == 0:
            kind, control = "none", None
        candidates = self.candidates if kind == "none" else 0  # the caller knows no drafted round's tree
        started, root = time.monotonic(), context[-1]
        nodes = job.tree_nodes(length) if kind != "pld" else 0  # trees: suffix, eagle, a fusion
        for n, resp in enumerate(self.verifier.decode(context, kind, length, nodes,
                                                      job.params.max_tokens - len(self.verified), candidates,
                                                      drafted_rounds=1 if probe else 0)):
            self.stats.record_span("verify", self.rnd, started, started := time.monotonic())
            self.drafting.take_features(resp)  # a pool's eagle misses no position drafted here
            if candidates:
                self.drafting.observe([root], resp)
                root = resp.bonus
            self.stats.record_draft_length(length if not probe or n == 0 else 0)
            self.stats.record_round(resp.drafted, len(resp.accepted), resp.batch_size, resp.forced)
            self._time_pass(resp)
            members = kind.split("+")
            if len(members) > 1 and len(resp.member_drafted) == len(members):  # a fusion: each its own share
                for member, drafted, accepted in zip(members, resp.member_drafted, resp.member_accepted):
                    self.stats.record_drafter(member, drafted, accepted)
            elif kind != "none":  # one drafter (or a fusion's round that drafted nothing): the first's
                self.stats.record_drafter(members[0], resp.drafted, len(resp.accepted))
            if control is not None:
                control.record(resp.drafted_depth, len(resp.accepted))
                control.observe_tree(resp.drafted, resp.drafted_depth)
                self._observe_verifier_drafting(control, kind, resp)
            self.load = _load(resp)
            self.rnd += 1
            if undrafted is not None and n:  # rounds after the first
                undrafted.plain_rounds(1)
            yield Emitted([*resp.accepted, resp.bonus], _logprobs(resp, job))

    def plan(self) -> _Draft:
        """This round's draft lengths, as the controls choose them for the load, cut to the room."""
        job = self.job
        room = job.params.max_tokens - len(self.verified) - 1
        lengths = ([job.draft_length] * len(job.drafters) if self.controls is None
                   else [c.length(self.load) for c in self.controls])
        return _Draft(room, lengths, [max(0, min(n, room)) for n in lengths])

    def asks_pools(self, draft: _Draft) -> bool:
        """Whether the planned round asks a drafter that only a pool runs: prompt lookup and the
        suffix drafter are drafted as well by the verifier, without the pool's call and the
        verify call's hop."""
        on_verifier = self.job.verifier_kinds
        return any(n and kind not in on_verifier for (kind, _), n in zip(self.job.drafters, draft.budgets))

    def draft(self, context: list[int], draft: _Draft) -> None:
        """Each drafter's tree for the planned round (those drafted ahead, if the last verdict
        kept them), and the tree to verify."""
        self.stats.record_draft_length(max(draft.budgets))
        if not any(draft.budgets):
            # nothing to draft: the round verifies the bonus token alone, and a tree drafted
            # ahead for this round's context would be one token behind the next round's
            self.ready = None
        elif self.ready is not None:
            draft.proposals, self.ready = self.ready, None
            self.stats.record_reuse()
        else:
            with self.stats.span("draft", self.rnd) as span:
                draft.proposals = self.drafting.propose(context, draft.budgets)
            draft.costs = self.drafting.seconds_per_token(draft.proposals)
            draft.round_cost = self.drafting.overhead(span.seconds, draft.budgets)
        draft.tree = self.drafting.merge(draft.proposals, draft.budgets)

    def verify(self, context: list[int], draft: _Draft) -> pb.VerifyResponse | None:
        """The verdict on the round's tree, or None when the request must be prefilled again.
        Pipelined, the drafters draft the next round meanwhile."""
        guess = [draft.tree.tokens[n] for n in likeliest_path(draft.tree)] if self.job.pipelined else []
        ahead = draft.room - len(guess) - 1  # room left past a whole accepted guess and its bonus
        if self.job.pipelined and len(draft.tree) and ahead > 0:
            resp = self._verify_drafting_ahead(context, draft, guess, ahead)
        else:
            with self.stats.span("verify", self.rnd) as span:
                resp = self.verifier.verify(draft.tree, len(context), self.candidates)
            draft.verify_seconds = span.seconds
        if resp is None:
            self.ready = None
        return resp

    def _verify_drafting_ahead(self, context: list[int], draft: _Draft, guess: list[int],
                               ahead: int) -> pb.VerifyResponse | None:
        """Verify from another thread while the drafters draft the next round past `guess`
        (the tree's likeliest path); keep that draft if the verdict allows."""
        call = self.verifier.verify_async(draft.tree, len(context), self.candidates)
        with self.stats.span("ahead", self.rnd):
            drafted_ahead = self.drafting.propose(context, [min(n, ahead) for n in draft.lengths], speculative=guess)
        resp = self.verifier.result(call)
        draft.verify_seconds = self.stats.record_span("verify", self.rnd, call.started, call.ended).seconds
        if resp is not None:
            self.ready = self.drafting.reuse(drafted_ahead, guess, list(resp.accepted), resp.bonus)
            for c in self.controls or ():
                c.reused(self.ready is not None)
        return resp

    def learn(self, context: list[int], draft: _Draft, resp: pb.VerifyResponse) -> list[int]:
        """Teach the verdict to all that learn from it (drafters that learn from the target's
        scores, the fusion's calibrations, the stats, the adaptive controls); returns the
        round's new tokens."""
        if self.candidates:
            self.drafting.observe([context[-1]] + draft.tree.tokens, resp)
        self.drafting.take_features(resp)
        new = Emitted(list(resp.accepted) + [resp.bonus], _logprobs(resp, self.job))
        self.drafting.learn(draft.proposals, new)
        self.stats.record_round(len(draft.tree), len(resp.accepted), resp.batch_size, resp.forced)
        self._time_pass(resp)
        self.drafting.count(draft.proposals, resp.accepted, self.stats)
        self._adapt(draft, resp)
        self.load = _load(resp)
        return new

    def _observe_verifier_drafting(self, control: SpeculationControl, kind: str, resp: pb.VerifyResponse) -> None:
        """A Decode round's drafting time, as the verifier measured it, teaches the control what
        a draft level costs there (an eagle head's is a share of a pass, and it delays the
        batch's next pass: the verifier drafts between passes), remembered for the load."""
        if resp.drafted_depth and resp.draft_seconds > 0 and resp.pass_seconds > 0:
            unit = resp.pass_seconds / control.pass_units(resp.batch_size, resp.pass_tokens, resp.pass_width)
            control.observe(resp.draft_seconds / resp.drafted_depth, unit)
            if self.plain_on_verifier:
                self.draft_costs.remember(control, kind.split("+")[0], self.load, self.job.domain)

    def _time_pass(self, resp: pb.VerifyResponse) -> None:
        """Count the verdict's pass, if the verifier timed it, as a pass of plain decoding at its
        batch size (the goodput routing's yardstick, router.goodput)."""
        if resp.pass_seconds > 0:
            pass_costs = self.services.pass_costs
            costs = (pass_costs.costs() if pass_costs is not None
                     else self.job.speculation.verify_costs() if self.job.speculation is not None else _SETTINGS_COSTS)
            self.stats.record_timed_pass(plain_pass_seconds(resp.pass_seconds, resp.batch_size, resp.pass_tokens,
                                                            resp.pass_width, costs))

    def _adapt(self, draft: _Draft, resp: pb.VerifyResponse) -> None:
        """Each drafter's control learns its acceptance and what drafting and verifying cost,
        against a one-row, one-token pass (from the pass the verdict reports). When a round
        with no draft would run on the verifier (Decode), a drafted round also pays its verify
        call's hop: the round trip and the wait for the pass in flight."""
        if not self.controls:
            return
        hop = max(0.0, draft.verify_seconds - resp.pass_seconds) if self.plain_on_verifier else 0.0
        # a one-row, one-token pass's seconds (every control has the same verify costs)
        unit = (resp.pass_seconds / self.controls[0].pass_units(resp.batch_size, resp.pass_tokens, resp.pass_width)
                if resp.pass_seconds > 0 else draft.verify_seconds)
        for i, (c, own) in enumerate(zip(self.controls, draft.proposals)):
            if len(own):  # how deep the accepted path went in the drafter's own tree
                depth = max(own.depths)
                c.record(depth, own.path_prefix(resp.accepted))
                c.observe_tree(len(own), depth)
            if draft.costs and draft.costs[i]:
                c.observe(draft.costs[i], unit)
            if draft.round_cost is not None and draft.budgets[i] > 0:
                c.observe_round(draft.round_cost + hop, unit)
                if self.plain_on_verifier:  # at the load its length was chosen for
                    self.draft_costs.remember(c, self.job.drafters[i][0], self.load, self.job.domain)

    def release(self) -> None:
        self.drafting.release()
        # the verifier's suffix index learns every suffix request's text, however its rounds
        # were drafted (through the pools, pipelined), as the pools' index does (give_output),
        # and a routed request's that may be routed to the suffix drafter next time
        learns = self.job.teaches_suffix or any(kind == "suffix" for kind, _ in self.job.drafters)
        self.verifier.release(self.job.prompt_ids + self.verified if learns else ())


def _logprobs(resp: pb.VerifyResponse | pb.VerifierPrefillResponse, job: Job) -> list[TokenLogprob] | None:
    """A verdict's logprobs, when the request asks for them."""
    return logprobs_from_pb(resp.logprobs) if job.params.logprobs is not None else None
