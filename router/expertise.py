"""Expertise routing: which route serves a request, and how far to trust each drafter.

    router = ExpertiseRouter(store)               # store: a cluster.state.StateStore
    route = router.route(prompt, candidates=["pld", "suffix", "recycle"], k=2, hint=req.domain_hint or None,
                         no_hop={"pld", "suffix", "none"}, same_as_alone={"pld", "suffix"})
    route.domain, route.drafters, route.reliability   # drafters best first; reliability in [0, 1]
    ...
    router.record("recycle", route.domain, proposed=40, accepted=31)   # once per request and drafter
    router.record_goodput(route.drafters, route.domain, speedup=1.6)  # once per request

Domain: the client's hint if any, else the prompt classifier's guess
(`router.classifier`). Drafters are named by kind (e.g. "small-general"), not by
replica, so every replica of a drafter adds to one record.

Routes, ranked by goodput (`route`, `rank`): the candidates are plain decoding
("none"), each drafter alone and each set of k (`router.goodput.candidate_routes`).
Each (route, domain) keeps its requests' measured speedups over plain decoding
(`router.goodput`: the reward, and why it is load- and machine-normalised), and
Thompson sampling ranks the routes by one draw each from the posterior of their
mean log speedup: the fastest route wins most requests, while one whose speed is
still uncertain (a new one) is tried in proportion to its chance of being the
fastest. A drafter's acceptance rate is not its speed: one that drafts rarely but
well, one whose every round pays a hop to its pool, a fusion that makes the
verifier's own rounds (no hop) impossible, all rank by what they actually
delivered. Evidence is a window (`goodput_window` requests per pair), so a route
that gets faster is seen to; with probability `epsilon` a request ranks the routes
at random, so even a route far behind gets requests to be judged by. Cold start
(`router.goodput.GoodputPrior`): a route the verifier runs in its own rounds
(`no_hop`, which the caller knows) starts higher than one that asks a pool; plain
decoding a little below 1; a route with a drafter trained for the domain (its
`specialties`) higher there; and the route's evidence on other domains moves its
prior mean. A route's drafters come back best first by reliability.

Reliability (`reliability`, `choose`): for each (drafter, domain) the acceptance
rate of drafted tokens has a Beta(prior + accepted, prior + rejected) posterior;
`reliability` is its mean, the weight confidence fusion gives the drafter's tokens
and the adaptive control's first guess of its acceptance. `choose` ranks drafters
by one Thompson draw from each (acceptance alone). Its evidence is a window too
(at most `window` proposed tokens per pair, older tokens scaled away as new ones
arrive). A drafter trained for a domain starts there from `specialty_prior`, a
Beta worth a few tokens with mean 2/3, against `prior` (mean 1/2) everywhere
else.

Sharing: the counters and sums live in the state store, shared by all router
replicas. A router keeps a cache and talks to the store at most once every
`refresh_s` seconds (from inside whichever call finds the cache stale): it
writes the outcomes it recorded since the last time, then reads everyone's
totals and adds what is new to its windows. Its own outcomes count in its
cache at once. Outcomes not yet written are lost if the process dies (at most
`refresh_s` worth, an acceptable loss for statistics); `close()` writes them.

Namespaces: a router learns within one memory namespace
(`speculative.namespaces`); `in_namespace(ns)` is a router with the same
settings that learns within another, so one tenant's traffic (or one benchmark
mode's) never moves another's rankings.

The store is duck-typed (`record_acceptance(drafter, domain, proposed,
accepted, namespace)`, `acceptance_stats(domain, namespace) -> {(drafter, domain):
(proposed, accepted)}`, `record_goodput(route, domain, requests, log_sum,
log_squares, namespace)`, `goodput_stats(domain, namespace) -> {(route, domain):
(requests, log_sum, log_squares)}`), because `router/` does not import
`cluster/`. Its errors reach the caller; a failed refresh keeps the cache and
what is unwritten, and is retried only after `refresh_s`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from .classifier import DomainClassifier
from .domains import DOMAINS
from .goodput import NONE, Evidence, GoodputPrior, candidate_routes, draw, posterior, route_name

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (drafter, domain), or (route, domain) for goodput


class AcceptanceStore(Protocol):
    def record_acceptance(self, drafter: str, domain: str, proposed: int, accepted: int,
                          namespace: str = "") -> None: ...

    def acceptance_stats(self, domain: str | None = None, namespace: str = "") -> dict[Key, tuple[int, int]]: ...

    def record_goodput(self, route: str, domain: str, requests: int, log_sum: float, log_squares: float,
                       namespace: str = "") -> None: ...

    def goodput_stats(self, domain: str | None = None, namespace: str = ""
                      ) -> dict[Key, tuple[int, float, float]]: ...


class Route(NamedTuple):
    domain: str
    drafters: tuple[str, ...]  # best first (by reliability); ("none",) for plain decoding
    reliability: dict[str, float]  # of each chosen drafter on the domain ("none": 1.0)


class ExpertiseRouter:
    def __init__(self, store: AcceptanceStore, classifier: DomainClassifier | None = None, *,
                 refresh_s: float = 5.0, prior: tuple[float, float] = (1.0, 1.0), window: float = 4000.0,
                 epsilon: float = 0.02, rng: np.random.Generator | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 specialties: Mapping[str, Collection[str]] | None = None,
                 specialty_prior: tuple[float, float] = (4.0, 2.0), namespace: str = "",
                 goodput_prior: GoodputPrior = GoodputPrior(), goodput_window: float = 50.0):
        """prior: Beta (alpha, beta) of a pair with no evidence, as pseudo-counts of
        accepted and rejected tokens; specialty_prior: the same for a drafter on a domain
        of its `specialties` ({drafter: domains}). goodput_prior: what a route's speedup is
        believed to be before evidence (router.goodput.GoodputPrior); goodput_window: the most
        requests of evidence a (route, domain) keeps. rng and clock are injectable for tests."""
        if not (min(prior + specialty_prior) > 0 and window > 0 and 0 <= epsilon <= 1 and refresh_s >= 0
                and goodput_window > 0):
            raise ValueError(f"bad routing parameters: {prior=} {specialty_prior=} {window=} {epsilon=} "
                             f"{refresh_s=} {goodput_window=}")
        self.goodput_prior, self.goodput_window = GoodputPrior(*goodput_prior).check(), goodput_window
        unknown = {d for domains in (specialties or {}).values() for d in domains} - set(DOMAINS)
        if unknown:
            raise ValueError(f"unknown specialty domain(s) {', '.join(sorted(unknown))}; known: {', '.join(DOMAINS)}")
        self.specialties = {drafter: frozenset(domains) for drafter, domains in (specialties or {}).items()}
        self.specialty_prior, self.namespace = specialty_prior, namespace
        self.store, self.refresh_s, self.prior, self.window, self.epsilon = store, refresh_s, prior, window, epsilon
        self.classifier = DomainClassifier.load() if classifier is None else classifier
        self._rng = rng or np.random.default_rng()
        self._clock = clock
        self._lock = threading.Lock()  # guards everything below and the rng
        self._refreshing = threading.Lock()  # one refresh at a time
        self._evidence: dict[Key, tuple[float, float]] = {}  # windowed (proposed, accepted)
        self._seen: dict[Key, tuple[int, int]] = {}  # store totals already in the evidence
        self._unwritten: dict[Key, tuple[int, int]] = {}  # own outcomes not yet in the store
        # the same three for the routes' log speedups: windowed (requests, sum, squares), store
        # totals already in, own requests not yet written
        self._goodput: dict[Key, Evidence] = {}
        self._goodput_seen: dict[Key, tuple[int, float, float]] = {}
        self._goodput_unwritten: dict[Key, tuple[int, float, float]] = {}
        self._next_refresh = -float("inf")

    def in_namespace(self, namespace: str) -> "ExpertiseRouter":
        """A router with these settings and classifier that learns within `namespace`."""
        with self._lock:
            seed = int(self._rng.integers(2**63))
        return ExpertiseRouter(self.store, self.classifier, refresh_s=self.refresh_s, prior=self.prior,
                               window=self.window, epsilon=self.epsilon, clock=self._clock,
                               rng=np.random.default_rng(seed),
                               specialties=self.specialties, specialty_prior=self.specialty_prior,
                               namespace=namespace, goodput_prior=self.goodput_prior,
                               goodput_window=self.goodput_window)

    # -- per request ------------------------------------------------------------
    def domain(self, prompt: str, hint: str | None = None) -> str:
        """The client's hint when given, else the classifier's guess."""
        if hint:
            if hint not in DOMAINS:
                raise ValueError(f"unknown domain {hint!r}; known: {', '.join(DOMAINS)}")
            return hint
        return self.classifier.predict(prompt)

    def choose(self, domain: str, candidates: Sequence[str], k: int = 1) -> list[str]:
        """Up to k distinct candidates, best first by one Thompson draw each."""
        candidates = list(dict.fromkeys(candidates))
        self._maybe_refresh()
        with self._lock:
            if self._rng.random() < self.epsilon:
                order = self._rng.permutation(len(candidates))
            else:
                draws = [self._rng.beta(*self._posterior((c, domain))) for c in candidates]
                order = np.argsort(draws, kind="stable")[::-1]
        return [candidates[i] for i in order[:k]]

    def reliability(self, drafter: str, domain: str) -> float:
        """Posterior mean acceptance rate of the drafter's tokens on the domain."""
        self._maybe_refresh()
        with self._lock:
            a, b = self._posterior((drafter, domain))
        return a / (a + b)

    def route(self, prompt: str, candidates: Sequence[str], k: int = 1, hint: str | None = None,
              usable: Callable[[str, str], bool] | None = None, no_hop: Collection[str] = (),
              same_as_alone: Collection[str] = (), pipelined: bool = False) -> Route:
        """The request's domain and the route to serve it by, ranked by goodput (`rank`) among
        `router.goodput.candidate_routes(candidates, k, same_as_alone)`: plain decoding, each
        candidate alone, each set of k. `usable(drafter, domain)`: routes with a drafter for
        which it is False are left out, unless that leaves none but plain decoding. `no_hop`:
        the drafters the verifier runs in its own rounds (their routes' prior is higher)."""
        domain = self.domain(prompt, hint)
        routes = candidate_routes(candidates, k, same_as_alone)
        if usable is not None:
            kept = [r for r in routes if r == (NONE,) or all(usable(d, domain) for d in r)]
            routes = kept if len(kept) > 1 or len(routes) == 1 else routes
        best = self.rank(domain, routes, no_hop, pipelined)[0]
        if best == (NONE,):
            return Route(domain, best, {NONE: 1.0})
        reliability = {d: self.reliability(d, domain) for d in best}
        # best first: what the coordinator's first drafter decides (a fusion's length, the
        # verifier's own rounds) is the one trusted most
        drafters = tuple(sorted(best, key=lambda d: -reliability[d]))
        return Route(domain, drafters, reliability)

    def rank(self, domain: str, routes: Sequence[Sequence[str]], no_hop: Collection[str] = (),
             pipelined: bool = False) -> list[tuple[str, ...]]:
        """The routes, best first by one Thompson draw each from the posterior of their
        speedup on the domain; with probability `epsilon`, in random order."""
        routes = [tuple(r) for r in dict.fromkeys(tuple(r) for r in routes)]
        names = [route_name(r, pipelined) for r in routes]  # checks them
        self._maybe_refresh()
        with self._lock:
            if self._rng.random() < self.epsilon:
                order = self._rng.permutation(len(routes))
            else:
                draws = [draw(self._rng, self._goodput_posterior(name, r, domain, no_hop, pipelined))
                         for name, r in zip(names, routes)]
                order = np.argsort(draws, kind="stable")[::-1]
        return [routes[i] for i in order]

    def goodput(self, route: Sequence[str], domain: str, no_hop: Collection[str] = (),
                pipelined: bool = False) -> float:
        """The route's speedup over plain decoding on the domain: exp of the posterior mean
        log speedup (a geometric mean, the prior's where there is no evidence)."""
        name = route_name(route, pipelined)
        self._maybe_refresh()
        with self._lock:
            return math.exp(self._goodput_posterior(name, tuple(route), domain, no_hop, pipelined).mean)

    def record_goodput(self, route: Sequence[str], domain: str, speedup: float, pipelined: bool = False) -> None:
        """Count one request served by `route` (its drafters, in any order; ("none",) for plain
        decoding) on the domain, at the estimated `speedup` over plain decoding
        (router.goodput.speedup)."""
        if not (isinstance(speedup, (int, float)) and math.isfinite(speedup) and speedup > 0):
            raise ValueError(f"a speedup is a positive finite number, got {speedup!r}")
        if domain not in DOMAINS:
            raise ValueError(f"unknown domain {domain!r}; known: {', '.join(DOMAINS)}")
        key, x = (route_name(route, pipelined), domain), math.log(speedup)
        with self._lock:
            self._goodput[key] = self._goodput.get(key, Evidence()).add(1, x, x * x, self.goodput_window)
            n, s, q = self._goodput_unwritten.get(key, (0, 0.0, 0.0))
            self._goodput_unwritten[key] = (n + 1, s + x, q + x * x)

    def record(self, drafter: str, domain: str, proposed: int, accepted: int) -> None:
        """Count a drafter's outcome: of `proposed` drafted tokens, `accepted` were accepted.

        Record a request's totals once rather than every round: same statistics, less work.
        """
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got {accepted=} {proposed=}")
        key = (drafter, domain)
        with self._lock:
            self._add(key, proposed, accepted)
            p, a = self._unwritten.get(key, (0, 0))
            self._unwritten[key] = (p + proposed, a + accepted)

    # -- sharing through the store --------------------------------------------
    def refresh(self) -> None:
        """Write own outcomes to the store and take in everyone's; normally automatic."""
        with self._refreshing:
            self._refresh()

    def close(self) -> None:
        """Write the outcomes not yet in the store."""
        self.refresh()

    def _maybe_refresh(self) -> None:
        with self._lock:
            due = self._clock() >= self._next_refresh
        # Non-blocking: a request never waits for another thread's refresh.
        if due and self._refreshing.acquire(blocking=False):
            try:
                self._refresh()
            except Exception as e:  # noqa: BLE001 - the store is down: route on what we know, retry later
                log.warning("sharing drafter statistics failed (%s); routing on the local ones", e)
            finally:
                self._refreshing.release()

    def _refresh(self) -> None:
        with self._lock:
            # Set first: a store that fails is tried again only after refresh_s.
            self._next_refresh = self._clock() + self.refresh_s
            unwritten = dict(self._unwritten)
        for key, (p, a) in unwritten.items():
            self.store.record_acceptance(*key, p, a, self.namespace)
            with self._lock:  # written: now in the totals, and already in the evidence
                left = self._unwritten[key]  # record() may have added since
                self._unwritten[key] = (left[0] - p, left[1] - a)
                if self._unwritten[key] == (0, 0):
                    del self._unwritten[key]
                seen = self._seen.get(key, (0, 0))
                self._seen[key] = (seen[0] + p, seen[1] + a)
        totals = self.store.acceptance_stats(None, self.namespace)
        with self._lock:
            for key, (p, a) in totals.items():
                seen = self._seen.get(key, (0, 0))
                if p >= seen[0] and a >= seen[1]:  # else the store was reset: start counting again
                    self._add(key, p - seen[0], a - seen[1])
                self._seen[key] = (p, a)
        self._refresh_goodput()

    def _refresh_goodput(self) -> None:
        with self._lock:
            unwritten = dict(self._goodput_unwritten)
        for key, (n, s, q) in unwritten.items():
            self.store.record_goodput(*key, n, s, q, self.namespace)
            with self._lock:
                left = self._goodput_unwritten[key]
                left = (left[0] - n, left[1] - s, left[2] - q)
                if left[0] == 0:
                    del self._goodput_unwritten[key]
                else:
                    self._goodput_unwritten[key] = left
                seen = self._goodput_seen.get(key, (0, 0.0, 0.0))
                self._goodput_seen[key] = (seen[0] + n, seen[1] + s, seen[2] + q)
        totals = self.store.goodput_stats(None, self.namespace)
        with self._lock:
            for key, (n, s, q) in totals.items():
                seen = self._goodput_seen.get(key, (0, 0.0, 0.0))
                if n > seen[0]:
                    self._goodput[key] = self._goodput.get(key, Evidence()).add(
                        n - seen[0], s - seen[1], max(q - seen[2], 0.0), self.goodput_window)
                elif n < seen[0]:  # the store was reset: count from its totals again
                    self._goodput[key] = self._goodput.get(key, Evidence()).add(n, s, q, self.goodput_window)
                self._goodput_seen[key] = (n, s, q)

    # -- statistics (callers hold self._lock) ---------------------------------
    def _add(self, key: Key, proposed: float, accepted: float) -> None:
        p, a = self._evidence.get(key, (0.0, 0.0))
        p, a = p + proposed, a + accepted
        if p > self.window:  # forget old tokens in proportion, keeping the rate
            a, p = a * self.window / p, self.window
        self._evidence[key] = (p, a)

    def _goodput_posterior(self, name: str, route: tuple[str, ...], domain: str, no_hop: Collection[str],
                           pipelined: bool):
        g = self.goodput_prior
        if route == (NONE,):
            speed = g.plain
        else:
            speed = g.no_hop if not pipelined and set(route) <= set(no_hop) else g.hop
            if any(domain in self.specialties.get(d, ()) for d in route):
                speed *= g.specialty
        mean = math.log(speed)
        if g.elsewhere > 0:  # the route's evidence on other domains moves the prior mean
            n = s = 0.0
            for (other, dom), e in self._goodput.items():
                if other == name and dom != domain:
                    n, s = n + e.requests, s + e.log_sum
            mean = (g.requests * mean + g.elsewhere * s) / (g.requests + g.elsewhere * n)
        return posterior(self._goodput.get((name, domain), Evidence()), mean, g.requests, g.alpha, g.spread)

    def _posterior(self, key: Key) -> tuple[float, float]:
        p, a = self._evidence.get(key, (0.0, 0.0))
        drafter, domain = key
        prior = self.specialty_prior if domain in self.specialties.get(drafter, ()) else self.prior
        return prior[0] + a, prior[1] + p - a
