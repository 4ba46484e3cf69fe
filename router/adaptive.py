"""Adaptive speculation: how many tokens to draft next round, per request and load.

Each round the draft length k is the one with the best *goodput*: tokens
the verifier's batch gains per unit of time (SmartSpec). With a per-level
acceptance rate a, k levels of draft gain (1 - a^(k+1)) / (1 - a) tokens per
target pass. A tree drafter's k levels hold about `width` x k nodes,
`width` learned from its trees (`observe_tree`; 1 for chains). The verifier
scores the trees of all B requests of a batch in one pass
(`speculative.batching.verify_batch`): the linear layers and the head see
the real tokens only, B - 1 + 1 + width x k of them, but attention pads every
row to the widest tree, so this request's tree adds width x k slots to each
of the B rows. The pass costs 1 + `verify_row_cost` x (B - 1)
+ `verify_token_cost` x width x k + `verify_pad_cost` x B x width x k one-token
passes: another request's row costs more than another token in a row (its
own attention over its own context, its cache writes), measured apart by
`experiments/verify_cost_probe.py`, and learned online from the verifier's own
pass timings (`PassCostModel`) when a control is given one. The other B - 1 rows
gain one token each whatever this request drafts: under load a draft pays
only if it gains more than it slows every other request.
Each draft level also costs the drafter's time, `draft_token_cost` of a
pass, and asking the drafters at all costs `draft_round_cost` (the calls'
round trips, threads and trees on the wire: what a one-token draft pays
as much as a five-token one, and on shared cores what it takes from the
verifier), both measured as the request goes against a one-row, one-token
pass (`pass_units` turns the pass a verdict reports into those); pipelined,
only when the round could not use the draft made ahead during the last
verification (`reused`). Where a round with no draft runs on the verifier
itself (Decode, no hop at all), a drafted round's cost also holds its verify
call's hop: the round trip and the wait for the pass in flight, which under
load is most of a pass.

    control = SpeculationControl(max_length=5, prior=0.6)
    k = control.length(batch=3)          # before a round
    control.record(offered=k, accepted=2) # after it

The coordinator keeps one control per drafter of a request, so each of
several fused drafters drafts its own length. `a` is learned from the
drafter's rounds: how many levels deep into its own tree the accepted path
went, of how deep the tree was. A tree is a wider bet per level than a chain,
paid for by its width above and credited here: any of its branches may carry
the accepted path. It starts from `prior` (the drafter's reliability on the
domain) as `prior_rounds` rounds' worth of evidence.
When goodput says "do not speculate", every `probe_every`-th round still
drafts one token (counting every round a verifier's Decode call runs on one
choice: `plain_rounds`; a probe's call drafts only its first round,
`probing`), so a request whose text turns predictable gets drafts again,
unless the load is such that even a drafter that is always right would not
pay (with many requests each probing every 8th round, nearly every pass
would be padded for somebody's probe).

The confidence stop (SpecDec++) is the drafter's side of the same idea:
`stop_confidence` goes with every Propose, and a model drafter ends its draft
after a token it drew with less confidence than that.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

from .settings import RouterSettings

# the verify costs' defaults are the settings' (one place); a control is given the configured ones
_SETTINGS = RouterSettings()

# Weight of the newest measurement in the running means of a drafter's costs, tree width and
# draft reuse: about the last five rounds count, so a request's estimates follow its text
# as it changes without one slow round swinging them.
RUNNING_MEAN_WEIGHT = 0.2
SEEN_PASSES = 4096  # recent pass keys remembered: far more than a batch's requests report at once


def _running_mean(mean: float, value: float) -> float:
    return (1.0 - RUNNING_MEAN_WEIGHT) * mean + RUNNING_MEAN_WEIGHT * value


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a pass gains with a k-token chain whose tokens are each accepted with `acceptance`."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def pass_units(rows: int, tokens: int, width: int, costs: tuple[float, float, float]) -> float:
    """A verification pass of `rows` rows, `tokens` scored tokens in all and `width` in the
    widest row, in one-row, one-token passes, by `costs` (row, token, pad: shares of one)."""
    row_cost, token_cost, pad_cost = costs
    rows = max(rows, 1)
    tokens = max(tokens, rows)
    return 1.0 + row_cost * (rows - 1) + token_cost * (tokens - rows) + pad_cost * max(0, rows * max(width, 1) - tokens)


@dataclass
class SpeculationControl:
    max_length: int
    prior: float = 0.5  # acceptance rate before any round (the drafter's reliability)
    pipelined: bool = False  # drafting overlaps verification: it costs round time only when not reused
    # one more request's row (one token) in the pass, as a fraction of a one-row pass
    verify_row_cost: float = _SETTINGS.verify_row_cost
    verify_token_cost: float = _SETTINGS.verify_token_cost  # one more scored token in a row, likewise
    verify_pad_cost: float = _SETTINGS.verify_pad_cost  # attention of one more padded slot in one row, likewise
    draft_token_cost: float = 0.0  # one draft token, as a fraction of a pass (measured: `observe`)
    draft_round_cost: float = 0.0  # asking the drafters at all, likewise (measured: `observe_round`)
    width: float = 1.0  # nodes the drafter's trees hold per level of depth (learned: `observe_tree`)
    prior_rounds: float = 2.0
    decay: float = 0.9  # weight of older rounds' evidence
    probe_every: int = 8
    # learned verify costs, shared by every request of a router; None: the three settings above
    pass_costs: "PassCostModel | None" = None
    _accepted: float = field(init=False, default=0.0)  # decayed accepted tokens
    _rejections: float = field(init=False, default=0.0)  # decayed rounds that ended in a rejection
    _plain: int = field(init=False, default=0)  # rounds in a row with no draft
    probing: bool = field(init=False, default=False)  # the last `length` drafts only to probe
    rounds: int = field(init=False, default=0)  # drafted rounds recorded
    _reuse: float = field(init=False, default=0.0)  # running share of pipelined rounds that reused their draft

    def __post_init__(self):
        self._accepted = self.prior * self.prior_rounds
        self._rejections = (1.0 - self.prior) * self.prior_rounds

    @property
    def acceptance(self) -> float:
        """Per-token acceptance: accepted / (accepted + rejections), the geometric model's estimate."""
        total = self._accepted + self._rejections
        return self._accepted / total if total else self.prior

    def length(self, batch: int = 1, drafted_by_verifier: bool = False) -> int:
        """Draft tokens for the next round when `batch` requests share the verifier; drafted by
        the verifier itself (in a Decode call), a round asks nothing (no call, no hop): its
        drafting's own time still weighs (nearly nothing for prompt lookup, a share of a pass
        a level for an eagle head)."""
        a = self.acceptance
        batch, draft_cost, round_cost, width = max(batch, 1), self.draft_token_cost, self.draft_round_cost, self.width
        if drafted_by_verifier:
            round_cost = 0.0
        if self.pipelined:
            draft_cost *= 1.0 - self._reuse
            round_cost *= 1.0 - self._reuse
        row_cost, token_cost, pad_cost = self.verify_costs()

        def goodput(k: int, a: float) -> float:  # the batch's tokens per one-token pass of time (see above)
            nodes = width * k
            return ((batch - 1 + expected_tokens(a, k))
                    / (1.0 + row_cost * (batch - 1) + token_cost * nodes + pad_cost * batch * nodes
                       + draft_cost * k + (round_cost if k else 0.0)))

        lengths = range(self.max_length + 1)
        best = max(lengths, key=lambda k: (goodput(k, a), -k))
        self.probing = False
        if best == 0:
            self._plain += 1
            # probe, unless the load is such that even a drafter that is always right would not pay
            if self._plain >= self.probe_every and any(goodput(k, 1.0) > goodput(0, 1.0) for k in lengths[1:]):
                best, self.probing = 1, True
        if best:
            self._plain = 0
        return best

    def plain_rounds(self, rounds: int) -> None:
        """`rounds` more rounds ran with no draft on the one choice of 0 `length` made (a
        verifier's Decode call runs many): they count towards the next probe."""
        self._plain += max(rounds, 0)

    def record(self, offered: int, accepted: int) -> None:
        """A round's verdict: the accepted path went `accepted` levels into the drafter's
        `offered`-deep tree (for a chain: `accepted` of its `offered` tokens)."""
        if offered <= 0:
            return
        self.rounds += 1
        self._accepted = self._accepted * self.decay + accepted
        self._rejections = self._rejections * self.decay + (1.0 if accepted < offered else 0.0)

    def reused(self, hit: bool) -> None:
        """A pipelined round's verdict kept (or dropped) the draft made ahead of it."""
        self._reuse = _running_mean(self._reuse, float(hit))

    def observe_tree(self, nodes: int, depth: int) -> None:
        """Learn how wide the drafter's trees are (a running mean of nodes per level)."""
        if nodes > 0 and depth > 0:
            self.width = _running_mean(self.width, nodes / depth)

    def verify_costs(self) -> tuple[float, float, float]:
        """(row, token, pad) costs of a verification pass: the learned ones, else the settings'."""
        if self.pass_costs is not None:
            return self.pass_costs.costs()
        return self.verify_row_cost, self.verify_token_cost, self.verify_pad_cost

    def pass_units(self, rows: int, tokens: int, width: int) -> float:
        """A verification pass of `rows` rows, `tokens` scored tokens in all and `width` in the
        widest row, in one-row, one-token passes (the goodput model's unit of time)."""
        return pass_units(rows, tokens, width, self.verify_costs())

    def observe(self, draft_seconds_per_token: float, pass_seconds: float) -> None:
        """Learn the drafter's cost relative to a one-row, one-token target pass of
        `pass_seconds` (a running mean)."""
        if draft_seconds_per_token > 0 and pass_seconds > 0:
            ratio = draft_seconds_per_token / pass_seconds
            self.draft_token_cost = ratio if self.draft_token_cost == 0 else _running_mean(self.draft_token_cost, ratio)

    def observe_round(self, overhead_seconds: float, pass_seconds: float) -> None:
        """Learn what a drafted round costs beyond the drafting and the pass, relative to a
        one-row, one-token pass of `pass_seconds` (a running mean)."""
        if overhead_seconds >= 0 and pass_seconds > 0:
            ratio = overhead_seconds / pass_seconds
            self.draft_round_cost = _running_mean(self.draft_round_cost, ratio)


class DraftCostMemory:
    """What drafting has cost lately, per drafter kind and load (requests sharing the
    verifier), across the requests of a router: a new request's controls start from the
    latest a request measured at its load rather than from nothing. Under load a drafted
    round's verify hop is most of a pass; without the memory each request would pay it in its
    first rounds to learn what the last one already knew. Keyed by load, so costs learned
    in a burst do not stop drafting once the verifier is quiet. The router leaves out of a
    request's routing a drafter that would not draft at all by these costs (`pays`): costs
    older than `max_age_s` are forgotten there, so such a drafter is measured again now and
    then. Thread-safe.

    Before a kind has drafted here, its costs are guessed: its token cost as its pools
    measured it when they started (`prior_token_costs`, kind -> share of a target pass),
    its round cost as any other kind's latest at the load (asking a pool at all costs the
    same calls whatever it drafts), so that a new server's first requests do not pay to
    find out that a drafter does not pay."""

    def __init__(self, max_age_s: float = 120.0, clock: Callable[[], float] = time.monotonic,
                 prior_token_costs: Callable[[], dict[str, float]] = dict):
        self.max_age_s, self._clock, self.prior_token_costs = max_age_s, clock, prior_token_costs
        self._costs: dict[tuple[str, int], tuple[float, float, float]] = {}  # token, round costs; when
        # the acceptance a request's control had learned by its latest drafted round, per (kind,
        # domain): acceptance follows the text, not the load; when
        self._acceptance: dict[tuple[str, str | None], tuple[float, float]] = {}
        self._lock = threading.Lock()

    def start(self, control: SpeculationControl, kind: str, load: int) -> None:
        """Give a control that has measured nothing yet the latest costs of `kind` at `load`
        (or, if it has drafted at none here, the guess)."""
        with self._lock:
            costs = self._costs.get((kind, load))
        if costs is None:
            costs = self._guess(kind, load)
        if costs is not None and control.draft_token_cost == 0 and control.draft_round_cost == 0:
            control.draft_token_cost, control.draft_round_cost = costs[:2]

    def remember(self, control: SpeculationControl, kind: str, load: int, domain: str | None = None) -> None:
        """A control's costs after a round `kind` drafted at `load`, and its acceptance on `domain`."""
        with self._lock:
            now = self._clock()
            self._costs[(kind, load)] = (control.draft_token_cost, control.draft_round_cost, now)
            if control.rounds:
                self._acceptance[(kind, domain)] = (control.acceptance, now)

    def pays(self, control: SpeculationControl, kind: str, load: int, drafted_by_verifier: bool = False,
             domain: str | None = None) -> bool:
        """Whether `kind` would draft at all at `load` for a request on `domain` whose new control
        is `control` (its prior the drafter's reliability), by what `kind` last cost at the
        highest load up to `load` it drafted at within `max_age_s` (a drafted round's hop grows
        with the load: costs from a lighter one are a lower bound), else by the guess, and by
        the lower of the control's prior and the acceptance the latest request of `kind` on
        `domain` had learned from its rounds, if within `max_age_s`; True when there are no
        costs: only drafting measures them. `drafted_by_verifier`: its rounds would be the verifier's own (an eagle
        head there), which ask nothing, so only its tokens' cost weighs. Sets the control's costs."""
        costs = self._latest(kind, load) or self._guess(kind, load)
        if costs is None:
            return True
        with self._lock:
            acceptance, when = self._acceptance.get((kind, domain), (None, -math.inf))
        if acceptance is not None and when >= self._clock() - self.max_age_s:
            control = dataclasses.replace(control, prior=min(control.prior, acceptance))
        control.draft_token_cost, control.draft_round_cost = costs[:2]
        return control.length(load, drafted_by_verifier=drafted_by_verifier) > 0

    def _latest(self, kind: str | None, load: int) -> tuple[float, float, float] | None:
        """`kind`'s costs (None: any kind's) at the highest load up to `load`, within max_age_s."""
        recent = self._clock() - self.max_age_s
        with self._lock:
            known = [(key[1], when, key) for key, (_, _, when) in self._costs.items()
                     if kind in (None, key[0]) and key[1] <= load and when >= recent]
            return self._costs[max(known)[2]] if known else None

    def _guess(self, kind: str, load: int) -> tuple[float, float] | None:
        """The costs of a kind that has not drafted here: its pools' measured token cost and
        any kind's latest round cost; None when its pools measured nothing."""
        token = self.prior_token_costs().get(kind)
        if token is None:
            return None
        other = self._latest(None, load)
        return token, (other[1] if other else 0.0)


class PassCostModel:
    """The verifier's pass time, learned online from the passes it reports, as the three
    relative costs the goodput model uses (`SpeculationControl`).

    A verification pass of B rows holding N scored tokens in all, W in the widest row,
    takes about t = c0 + c_row (B - 1) + c_token (N - B) + c_pad (B W - N) seconds: c0
    is a one-row, one-token pass, and the costs are c_row / c0, c_token / c0 and
    c_pad / c0. Least squares over the reported passes, older ones forgotten at
    `1 - 1/window` a pass, each cost held towards its prior (the configured setting) by
    `prior_weight` passes' worth of evidence, so a shape the traffic never shows (a
    second row, at one client) keeps its prior. Until `min_passes` passes are in, the
    priors are the costs. Every request of a batch reports the same pass: `observe`
    counts each (verifier, pass id) once. The model is linear: on a CPU that pads a lone
    row's 2- to 3-token draft (runtime.cpu_tuning), it costs as much as a 4-token one,
    which the fit averages over what the traffic drafts. Thread-safe: one model serves
    every request of a router."""

    FEATURES = 4  # intercept, extra rows, extra tokens, padded slots

    def __init__(self, row_cost: float = _SETTINGS.verify_row_cost, token_cost: float = _SETTINGS.verify_token_cost,
                 pad_cost: float = _SETTINGS.verify_pad_cost,
                 window: float = 1000.0, prior_weight: float = 10.0, min_passes: int = 20):
        if window < 1 or prior_weight <= 0 or min_passes < 1:
            raise ValueError("window must be at least 1, prior_weight positive, min_passes at least 1")
        self.priors = (row_cost, token_cost, pad_cost)
        self.forget, self.min_passes = 1.0 - 1.0 / window, min_passes
        self._xtx = torch.zeros(self.FEATURES, self.FEATURES, dtype=torch.float64)
        self._xty = torch.zeros(self.FEATURES, dtype=torch.float64)
        # each prior as a penalty row, prior_weight x (c_j - prior_j x c0)^2, added at every solve
        self._prior_xtx = 1e-12 * torch.eye(self.FEATURES, dtype=torch.float64)
        for j, prior in enumerate(self.priors, start=1):
            r = torch.zeros(self.FEATURES, dtype=torch.float64)
            r[0], r[j] = -prior, 1.0
            self._prior_xtx += prior_weight * torch.outer(r, r)
        self._passes = 0
        self._seen: OrderedDict = OrderedDict()  # recent (verifier, pass id) keys
        self._costs: tuple[float, float, float] | None = None  # cached solution, None: stale
        self._lock = threading.Lock()

    @property
    def passes(self) -> int:
        """Passes observed (each counted once)."""
        return self._passes

    def observe(self, key, rows: int, tokens: int, width: int, seconds: float) -> None:
        """One verification pass: `rows` requests, `tokens` scored tokens in all (each row's
        last verified token and its tree), `width` tokens in the widest row. `key` names the
        pass (verifier address, pass id); a key seen lately is not counted again."""
        if rows < 1 or tokens < rows or width < 1 or rows * width < tokens or not seconds > 0:
            return
        with self._lock:
            if key in self._seen:
                return
            self._seen[key] = None
            if len(self._seen) > SEEN_PASSES:
                self._seen.popitem(last=False)
            x = torch.tensor([1.0, rows - 1, tokens - rows, rows * width - tokens], dtype=torch.float64)
            self._xtx.mul_(self.forget).add_(torch.outer(x, x))
            self._xty.mul_(self.forget).add_(x * seconds)
            self._passes += 1
            self._costs = None

    def costs(self) -> tuple[float, float, float]:
        """(row, token, pad) costs, each a share of a one-row, one-token pass."""
        with self._lock:
            if self._passes < self.min_passes:
                return self.priors
            if self._costs is None:
                self._costs = self._solve()
            return self._costs

    def _solve(self) -> tuple[float, float, float]:
        try:
            beta = torch.linalg.solve(self._xtx + self._prior_xtx, self._xty)
        except RuntimeError:  # singular: keep the priors
            return self.priors
        c0 = float(beta[0])
        if not c0 > 0:
            return self.priors
        return tuple(max(0.0, float(b) / c0) for b in beta[1:])
