"""Goodput: what a served route earned, as a speedup over plain decoding, and its posterior.

"auto" routing (`router.expertise.ExpertiseRouter.route`) chooses among *routes*: plain
decoding ("none"), each routed drafter alone, and fused sets of `fused_drafters` of them
(`candidate_routes`). A route is named by its drafters sorted and joined by "+" (`route_name`),
with "/pipelined" after it for a pipelined request, whose every round asks the pools.

The reward of one request (`speedup`): an estimate of how much faster it decoded than plain
decoding would have, at the load it ran at, on the machine it ran on,

    speedup = (tokens after the first) x (mean plain-pass seconds) / (seconds after the first),

where the request's time is measured from the end of its first prefill to its last token (the
prefill and its token are the same whatever drafts), and a plain pass is each verdict's
verification pass as the verifier reported it (`pass_seconds`), rescaled by the verify cost
model (`router.adaptive.PassCostModel`: c_row, c_token, c_pad as shares of a one-row,
one-token pass) to the same rows holding one token each (`plain_pass_seconds`). Plain decoding
at that load makes one such pass a token, so the estimate is the request's own tokens/s over
plain decoding's, both at the batch sizes the request actually met: the load's slowdown and
the machine's speed cancel, while everything the route costs beyond the passes (a pool's
drafting, the hop to the pool and back, the router's own work a round) stays in the
denominator. A plainly decoded request scores a little under 1 (its overhead beyond the
passes). A request that ended early (cancelled, failed), had fewer than `MIN_TOKENS`
tokens after its first, or whose verifier reported no pass timings, earns no reward.

Its limits: the rescaling is only as good as the linear cost model (learned from the
verifier's passes, its priors until then); "plain decoding at that load" takes every row of
a pass to one token, the other requests' trees included, which is what the batch would cost
if all decoded plainly; the time is wall time at the router, so a streaming client that reads
slowly, or a verifier slowed by something else, slows every route alike but adds noise; and a
last round clipped by `max_tokens` or a stop string costs a drafting route more than a plain
one. Each of these moves every route's rewards by much the same factor, which the ranking
(a comparison) mostly cancels.

The posterior (`Evidence`, `posterior`, `draw`): the log speedups of a (route, domain) are
taken as normal with unknown mean and variance, under the conjugate Normal-inverse-gamma
prior: mean `prior_mean` worth `prior_requests` requests, variance around `prior_spread`
squared worth 2 `prior_alpha` requests. Thompson sampling draws a variance and then a mean
from the posterior, and routes by the largest mean drawn. Evidence is a window of at most
`window` requests (older ones scaled away as new ones arrive), so that a route that improves
is seen to. The prior's mean is set per route by the router (`ExpertiseRouter`): a route the
verifier runs itself (no hop) starts higher than one that asks a pool, a specialist drafter
higher on its domains, and the route's evidence on the other domains moves it too.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from typing import NamedTuple

import numpy as np

from .adaptive import pass_units

NONE = "none"
PIPELINED = "/pipelined"
MIN_TOKENS = 4  # tokens after the first a request needs for its speedup to count


def route_name(drafters: Sequence[str], pipelined: bool = False) -> str:
    """The arm's name: the drafters sorted, joined by '+' (a fusion is one set whatever its
    order), with PIPELINED after it when the request was pipelined."""
    if not drafters or any(not d or "+" in d or PIPELINED in d for d in drafters):
        raise ValueError(f"a route is one or more drafter kinds without '+', got {list(drafters)!r}")
    return "+".join(sorted(set(drafters))) + (PIPELINED if pipelined else "")


def candidate_routes(drafters: Sequence[str], k: int = 1,
                     same_as_alone: Collection[str] = ()) -> list[tuple[str, ...]]:
    """The routes "auto" chooses among: plain decoding, each drafter alone, and, with k > 1,
    each set of k of them (in the order given). A set whose drafters are all in `same_as_alone`
    is left out: those the verifier runs in its own rounds, where it drafts with the first of
    them alone (router.coordinator.rounds), so the set would be that drafter again."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    drafters = [d for d in dict.fromkeys(drafters) if d != NONE]
    routes = [(NONE,)] + [(d,) for d in drafters]
    if k > 1:
        routes += [c for c in itertools.combinations(drafters, k) if not set(c) <= set(same_as_alone)]
    return routes


def plain_pass_seconds(pass_seconds: float, rows: int, tokens: int, width: int,
                       costs: tuple[float, float, float]) -> float:
    """The seconds of a verification pass of `rows` rows, `tokens` scored tokens in all and
    `width` in the widest row, rescaled to the same rows holding one token each: what a pass of
    plain decoding would cost at that batch size. `costs`: (row, token, pad) as shares of a
    one-row, one-token pass."""
    return pass_seconds * pass_units(rows, rows, 1, costs) / pass_units(rows, tokens, width, costs)


def speedup(tokens: int, seconds: float, plain_seconds: float, passes: int) -> float | None:
    """The estimated speedup over plain decoding of `tokens` tokens decoded in `seconds`, the
    request's `passes` timed passes being `plain_seconds` in all as plain passes; None when there
    is too little to tell (fewer than MIN_TOKENS tokens, no timed pass, no time)."""
    if tokens < MIN_TOKENS or passes < 1 or not seconds > 0 or not plain_seconds > 0:
        return None
    return tokens * (plain_seconds / passes) / seconds


class Evidence(NamedTuple):
    """Windowed sufficient statistics of a (route, domain)'s log speedups."""
    requests: float = 0.0
    log_sum: float = 0.0
    log_squares: float = 0.0

    def add(self, requests: float, log_sum: float, log_squares: float, window: float) -> Evidence:
        n, s, q = self.requests + requests, self.log_sum + log_sum, self.log_squares + log_squares
        if n > window:  # forget old requests in proportion, keeping the mean and spread
            f = window / n
            n, s, q = window, s * f, q * f
        return Evidence(n, s, q)


class Posterior(NamedTuple):
    """Normal-inverse-gamma: mean | variance ~ N(mean, variance / strength), variance ~ IG(alpha, beta)."""
    mean: float
    strength: float
    alpha: float
    beta: float


def posterior(evidence: Evidence, prior_mean: float, prior_requests: float, prior_alpha: float,
              prior_spread: float) -> Posterior:
    """The posterior of the mean log speedup after `evidence`, from a prior of mean `prior_mean`
    worth `prior_requests` requests and a variance whose prior mean is `prior_spread` squared."""
    beta0 = prior_spread ** 2 * max(prior_alpha - 1.0, 1e-3)
    n, s, q = evidence
    if n <= 0:
        return Posterior(prior_mean, prior_requests, prior_alpha, beta0)
    mean = s / n
    spread = max(q - n * mean * mean, 0.0)  # sum of squared deviations from the mean
    strength = prior_requests + n
    return Posterior((prior_requests * prior_mean + s) / strength, strength, prior_alpha + n / 2,
                     beta0 + spread / 2 + prior_requests * n * (mean - prior_mean) ** 2 / (2 * strength))


def draw(rng: np.random.Generator, p: Posterior) -> float:
    """One Thompson draw of the mean log speedup."""
    variance = p.beta / rng.gamma(p.alpha)  # inverse gamma
    return float(rng.normal(p.mean, math.sqrt(variance / p.strength)))


class GoodputPrior(NamedTuple):
    """What "auto" believes of a route before its evidence (ExpertiseRouter's `goodput_prior`).

    Prior mean speedups over plain decoding: `no_hop`, a route whose drafters the verifier runs
    in its own rounds (prompt lookup, the suffix drafter, an eagle head placed there); `hop`, a
    route that asks a drafter pool (each drafted round pays the pool's drafting and a hop);
    `plain`, plain decoding (which pays the router's rounds and nothing else); a route with a
    drafter trained for the request's domain (its `specialties`) starts `specialty` times
    higher. `requests`: how many requests' worth the prior mean is; `spread`: the prior guess
    of the spread (standard deviation) of one request's log speedup, worth 2 `alpha` requests;
    `elsewhere`: what one request of the route on another domain counts for, as evidence
    moving the prior mean on this one (0: domains learn apart)."""
    no_hop: float = 1.3
    hop: float = 1.0
    plain: float = 0.95
    specialty: float = 1.25
    requests: float = 6.0
    spread: float = 0.3
    alpha: float = 2.0
    elsewhere: float = 0.5

    def check(self) -> GoodputPrior:
        if not (min(self.no_hop, self.hop, self.plain, self.specialty, self.requests, self.spread) > 0
                and self.alpha > 1 and 0 <= self.elsewhere <= 1
                and all(math.isfinite(v) for v in self)):
            raise ValueError(f"bad goodput prior {self}: speedups, requests and spread positive, alpha above 1, "
                             "elsewhere in [0, 1]")
        return self
