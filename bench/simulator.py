"""`specserve simulate`: a discrete-event model of the served cluster.

Routers, drafter pools and verifiers, with the costs measured on a real
machine (bench/costs.py writes them), projecting throughput, p50/p99 latency
and each side's idle fraction for N verifier and M drafter-pool nodes, with
rounds in sequence or pipelined.

What is modelled, after the real services:
- A client sends its requests one after another: on a Poisson schedule
  (`rate` per client, the arrival times fixed in advance as in `specserve
  bench --load`, latency counted from the scheduled arrival) or closed loop
  (`rate` None: the next request as soon as the last one is answered).
- A request is a measured question (domain, prompt tokens, output tokens).
  It takes a KV row on the verifier holding the fewest (waiting while all
  rows of every verifier are held), a drafter pool (the least busy, kept for
  the request), is prefilled, then goes round after round: draft on its pool,
  verify, until its output is complete. Each round's (drafted, accepted)
  pair is drawn from the rounds measured for that drafter and domain.
- A verifier is one worker (verifier_service.engine): a prefill alone, or a
  pass over every queued verify, one per request, at most `max_batch` rows and
  `max_batch_tokens` tokens, after waiting up to `batch_wait` for the rounds of
  the requests it holds. A pass costs base + row x rows + token x tokens.
- A drafter pool is `pool_workers` cores drafting first come first served;
  a round's draft costs its depth x the drafter's measured time per token.
- Every call from the router to a service adds `call` seconds of latency; a call
  to a drafter pool also crosses the router<->pool link twice (`pool_link_ms` one
  way: pools on nodes of their own, behind a slower network than the verifiers').
- Pipelined: while a round is verified the pool drafts the next one ahead;
  with the measured reuse rate the verdict keeps it and the next round goes
  to the verifier at once, else the round drafts again (after the ahead draft,
  which holds the request's drafter).

Not modelled: prefilling the drafters, adaptive draft lengths, fused drafters,
rounds the verifier runs itself (`Decode`: every round here goes through the
router), CPU shared between services on one machine, network beyond a fixed
call cost and a fixed pool-link delay (no bandwidth, no jitter).

Times are seconds throughout; the costs file gives milliseconds.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Generator, Iterable

import numpy as np

PERCENTILES = "numpy.percentile, linear interpolation, over every request"
NO_DRAFTER = "none"


# ---- costs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Question:
    domain: str
    prompt_tokens: int
    output_tokens: int  # what the target answers under greedy decoding (the same for every drafter)


@dataclass(frozen=True)
class DrafterProfile:
    """One drafter on one domain: its measured rounds and how often a pipelined round's ahead draft was kept."""

    rounds: tuple[tuple[int, int], ...]  # (drafted nodes, accepted tokens) per measured round
    reuse_rate: float = 0.0  # of pipelined rounds whose draft was wholly accepted: the ahead draft kept


@dataclass(frozen=True)
class Costs:
    pass_base_ms: float  # a verification pass: base + row x rows + token x tokens (roots included)
    pass_row_ms: float
    pass_token_ms: float
    prefill_base_ms: float  # a prefill of P prompt tokens: base + token x P
    prefill_token_ms: float
    call_ms: float  # latency one router -> service call adds
    draft_token_ms: dict[str, float]  # per drafter
    profiles: dict[str, dict[str, DrafterProfile]]  # drafter -> domain -> profile
    questions: tuple[Question, ...]
    batch_wait_ms: float = 2.0  # verifier_service.engine's batch_wait_s

    def pass_s(self, rows: int, tokens: int) -> float:
        return (self.pass_base_ms + self.pass_row_ms * rows + self.pass_token_ms * tokens) / 1000

    def prefill_s(self, prompt_tokens: int) -> float:
        return (self.prefill_base_ms + self.prefill_token_ms * prompt_tokens) / 1000

    def draft_s(self, drafter: str, depth: int) -> float:
        return self.draft_token_ms[drafter] * depth / 1000

    @property
    def drafters(self) -> list[str]:
        return sorted(self.profiles)


def fit_linear(samples: list[tuple[list[float], float]]) -> list[float]:
    """Least-squares coefficients of ms = c0 + c1 x1 + ...; samples: (x values, ms)."""
    x = np.array([[1.0, *xs] for xs, _ in samples])
    y = np.array([ms for _, ms in samples])
    return [float(c) for c in np.linalg.lstsq(x, y, rcond=None)[0]]


def costs_from_dict(data: dict) -> Costs:
    """The costs a costs file (bench/costs.py) holds; KeyError names a missing field."""
    try:
        v, p = data["verify_pass"], data["prefill"]
        profiles = {
            drafter: {domain: DrafterProfile(tuple(tuple(r) for r in d["rounds"]), d.get("reuse_rate", 0.0))
                      for domain, d in by_domain.items()}
            for drafter, by_domain in data["acceptance"].items()}
        return Costs(v["base_ms"], v["row_ms"], v["token_ms"], p["base_ms"], p["token_ms"], data["call_ms"],
                     {k: float(x) for k, x in data["draft_token_ms"].items()}, profiles,
                     tuple(Question(**q) for q in data["questions"]), data.get("batch_wait_ms", 2.0))
    except KeyError as e:
        raise ValueError(f"costs file: missing field {e.args[0]!r}") from None


def load_costs(path: str | Path) -> Costs:
    return costs_from_dict(json.loads(Path(path).read_text()))


# ---- a small event loop: processes are generators that yield seconds to wait or an Event ----


class Event:
    def __init__(self, sim: "Sim"):
        self.sim, self.done, self.value, self._waiters = sim, False, None, []

    def succeed(self, value=None) -> None:
        if self.done:
            return
        self.done, self.value = True, value
        for resume in self._waiters:
            self.sim.after(0.0, resume)
        self._waiters = []


class Sim:
    def __init__(self):
        self.now = 0.0
        self._heap: list = []
        self._order = itertools.count()  # ties run in the order they were scheduled: deterministic

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (self.now + delay, next(self._order), fn))

    def event(self) -> Event:
        return Event(self)

    def timeout(self, delay: float) -> Event:
        e = Event(self)
        self.after(delay, e.succeed)
        return e

    def process(self, gen: Generator) -> Event:
        """Run `gen` as a process; the Event it returns fires when it ends, with its return value."""
        finished = Event(self)

        def step(value=None) -> None:
            try:
                wait = gen.send(value)
            except StopIteration as stop:
                finished.succeed(stop.value)
                return
            if not isinstance(wait, Event):
                wait = self.timeout(wait)
            if wait.done:
                self.after(0.0, lambda: step(wait.value))
            else:
                wait._waiters.append(lambda: step(wait.value))

        self.after(0.0, step)
        return finished

    def run(self) -> None:
        while self._heap:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()


# ---- the services ---------------------------------------------------------------------------


class DrafterPool:
    """`workers` cores, each drafting one request's round at a time, first come first served."""

    def __init__(self, sim: Sim, workers: int):
        self.sim, self.free, self.busy_s = sim, workers, 0.0
        self._queue: deque[Event] = deque()
        self.requests = 0  # requests it drafts for (the router picks the least loaded)

    def draft(self, seconds: float) -> Generator:
        if self.free == 0:
            turn = self.sim.event()
            self._queue.append(turn)
            yield turn  # a finishing worker hands itself over
        else:
            self.free -= 1
        yield seconds
        self.busy_s += seconds
        if self._queue:
            self._queue.popleft().succeed()
        else:
            self.free += 1


@dataclass
class _Verify:
    tokens: int  # root + tree nodes
    done: Event


class Verifier:
    """One worker, as verifier_service.engine: a prefill alone, else one batched pass."""

    def __init__(self, sim: Sim, costs: Costs, max_batch: int, max_batch_tokens: int):
        self.sim, self.costs = sim, costs
        self.max_batch, self.max_batch_tokens = max_batch, max_batch_tokens
        self.rows_held = 0
        self.busy_s, self.passes, self.rows_verified = 0.0, 0, 0
        self.pass_s = 0.0  # of busy_s, in verification passes (the rest is prefills)
        self.row_seconds = 0.0  # integral of rows held over time: mean occupancy
        self._since = 0.0
        self._row_waiters: deque[Event] = deque()
        self._queue: deque = deque()  # _Verify, or (prompt tokens, Event) for a prefill
        self._wake: Event | None = None
        sim.process(self._worker())

    def _account(self) -> None:
        self.row_seconds += self.rows_held * (self.sim.now - self._since)
        self._since = self.sim.now

    def load(self) -> int:
        return self.rows_held + len(self._row_waiters)

    def take_row(self) -> Generator:
        if self.rows_held == self.max_batch:
            turn = self.sim.event()
            self._row_waiters.append(turn)
            yield turn  # a released row is handed over
        else:
            self._account()
            self.rows_held += 1

    def release_row(self) -> None:
        if self._row_waiters:
            self._row_waiters.popleft().succeed()
        else:
            self._account()
            self.rows_held -= 1

    def prefill(self, prompt_tokens: int) -> Event:
        done = self.sim.event()
        self._submit((prompt_tokens, done))
        return done

    def verify(self, tokens: int) -> Event:
        done = self.sim.event()
        self._submit(_Verify(tokens, done))
        return done

    def _submit(self, work) -> None:
        self._queue.append(work)
        if self._wake is not None:
            self._wake.succeed()

    def _sleep(self, seconds: float | None) -> Event:
        """Wake on new work, or after `seconds` (None: only on new work)."""
        self._wake = wake = self.sim.event()
        if seconds is not None:
            self.sim.after(seconds, wake.succeed)
        return wake

    def _batchable(self) -> list[_Verify]:
        batch, tokens = [], 0
        for work in itertools.takewhile(lambda w: isinstance(w, _Verify), self._queue):
            if len(batch) == self.max_batch:
                break
            if not batch or tokens + work.tokens <= self.max_batch_tokens:
                batch.append(work)
                tokens += work.tokens
        return batch

    def _worker(self) -> Generator:
        while True:
            if not self._queue:
                yield self._sleep(None)
                continue
            first = self._queue[0]
            if not isinstance(first, _Verify):
                self._queue.popleft()
                seconds = self.costs.prefill_s(first[0])
                yield seconds
                self.busy_s += seconds
                first[1].succeed()
                continue
            # wait a moment for the other held requests' rounds, as the engine does
            until = self.sim.now + self.costs.batch_wait_ms / 1000
            while len(self._batchable()) < min(self.max_batch, self.rows_held) and self.sim.now < until:
                yield self._sleep(until - self.sim.now)
            batch = self._batchable()
            for work in batch:
                self._queue.remove(work)
            seconds = self.costs.pass_s(len(batch), sum(w.tokens for w in batch))
            yield seconds
            self.busy_s += seconds
            self.pass_s += seconds
            self.passes += 1
            self.rows_verified += len(batch)
            for work in batch:
                work.done.succeed()


# ---- the cluster and its load ---------------------------------------------------------------


@dataclass(frozen=True)
class SimConfig:
    verifiers: int = 1
    pools: int = 1
    pool_workers: int = 1  # cores drafting at once in each pool
    max_batch: int = 8  # [verifiers] max_batch
    max_batch_tokens: int = 256
    drafter: str = NO_DRAFTER  # every request's drafter; none: plain decoding
    draft_length: int = 5  # the most tokens a round drafts (a round never drafts past the output)
    pipelined: bool = False
    clients: int = 1
    rate: float | None = None  # Poisson requests/s per client; None: closed loop
    requests: int = 16  # in all, shared out evenly over the clients
    max_tokens: int = 128
    seed: int = 0
    pool_link_ms: float = 0.0  # one-way delay of the router<->pool link: each draft call pays it twice

    def check(self, costs: Costs) -> None:
        """ValueError naming the setting that cannot be simulated."""
        for name in ("verifiers", "pools", "pool_workers", "max_batch", "max_batch_tokens", "clients", "requests",
                     "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if self.pool_link_ms < 0:
            raise ValueError(f"pool_link_ms must not be negative, got {self.pool_link_ms}")
        if self.drafter != NO_DRAFTER and self.drafter not in costs.profiles:
            raise ValueError(f"drafter {self.drafter!r} has no measured acceptance in the costs file "
                             f"(it has {', '.join(costs.drafters) or 'none'})")
        if self.drafter != NO_DRAFTER and self.drafter not in costs.draft_token_ms:
            raise ValueError(f"drafter {self.drafter!r} has no draft_token_ms in the costs file")
        if not costs.questions:
            raise ValueError("the costs file has no questions")


@dataclass
class SimResult:
    config: dict
    requests: int
    generated_tokens: int
    wall_s: float
    tokens_per_s: float
    requests_per_s: float
    p50_s: float
    p99_s: float
    mean_s: float
    verifier_idle: float  # share of the verifiers' time with no pass or prefill running
    drafter_idle: float  # share of the pools' cores' time not drafting (1.0 with no drafter)
    verifier_occupancy: float  # mean share of the verifiers' rows held (autoscaling's verifier signal)
    mean_batch_rows: float
    tokens_per_pass: float  # tokens a request gains per verification round
    passes: int  # verification passes (prefills not counted)
    pass_ms: float  # their mean time


def _arrivals(cfg: SimConfig, rng: random.Random) -> list[list[float]]:
    """Per client, its requests' arrival times (empty times: closed loop, filled as it goes)."""
    counts = [cfg.requests // cfg.clients + (c < cfg.requests % cfg.clients) for c in range(cfg.clients)]
    if cfg.rate is None:
        return [[None] * n for n in counts]
    return [list(itertools.accumulate(rng.expovariate(cfg.rate) for _ in range(n))) for n in counts]


class _Round:
    """Draws a request's rounds from the measured ones of its drafter and domain."""

    def __init__(self, costs: Costs, cfg: SimConfig, domain: str, rng: random.Random):
        # reuse draws from a stream of its own: a pipelined run draws the same rounds as a sequential one
        self.rng, self._reuse_rng = rng, random.Random(rng.random())
        by_domain = costs.profiles.get(cfg.drafter, {})
        # a domain the drafter was not measured on: all its measured rounds
        self.profile = by_domain.get(domain) or DrafterProfile(
            tuple(r for p in by_domain.values() for r in p.rounds),
            float(np.mean([p.reuse_rate for p in by_domain.values()])) if by_domain else 0.0)

    def draw(self, left: int, draft_length: int) -> tuple[int, int, int]:
        """(budget, drafted, accepted) of a round with `left` output tokens still to come: the
        most it may draft, the nodes it drafted (a drafter may find fewer), the tokens kept."""
        budget = min(draft_length, left - 1)  # the bonus token always comes
        drafted, accepted = self.rng.choice(self.profile.rounds) if self.profile.rounds else (0, 0)
        drafted = min(drafted, budget)
        return budget, drafted, min(accepted, drafted)

    def reused(self) -> bool:
        return self._reuse_rng.random() < self.profile.reuse_rate


def simulate(costs: Costs, cfg: SimConfig) -> SimResult:
    cfg.check(costs)
    rng = random.Random(cfg.seed)
    sim = Sim()
    verifiers = [Verifier(sim, costs, cfg.max_batch, cfg.max_batch_tokens) for _ in range(cfg.verifiers)]
    pools = [DrafterPool(sim, cfg.pool_workers) for _ in range(cfg.pools)]
    call = costs.call_ms / 1000
    pool_call = call + 2 * cfg.pool_link_ms / 1000  # there and back over the pool's link
    latencies: list[float] = []
    tokens_out = [0, 0]  # generated tokens, verification rounds
    drafting = cfg.drafter != NO_DRAFTER

    def draft_ahead(pool: DrafterPool, depth: int) -> Generator:
        yield pool_call
        yield from pool.draft(costs.draft_s(cfg.drafter, depth))

    def request(question: Question, rounds: _Round) -> Generator:
        verifier = min(verifiers, key=Verifier.load)
        yield from verifier.take_row()
        pool = min(pools, key=lambda p: p.requests)
        pool.requests += 1
        yield call
        yield verifier.prefill(question.prompt_tokens)
        out = min(question.output_tokens, cfg.max_tokens)
        made, drafted_ahead = 1, False  # the prefill gives the first token; a kept ahead draft
        while made < out:
            budget, drafted, accepted = rounds.draw(out - made, cfg.draft_length if drafting else 0)
            if budget > 0 and not drafted_ahead:  # the pool is asked even when it finds nothing to draft
                yield pool_call
                yield from pool.draft(costs.draft_s(cfg.drafter, drafted))
            ahead = None
            room = min(cfg.draft_length, out - made - drafted - 2)  # past a wholly accepted draft and its bonus
            if cfg.pipelined and drafted > 0 and room > 0:
                ahead = sim.process(draft_ahead(pool, room))
            yield call
            yield verifier.verify(1 + drafted)
            made += accepted + 1
            tokens_out[1] += 1
            drafted_ahead = False
            if ahead is not None:
                yield ahead  # the request's drafter is busy until it is done
                drafted_ahead = accepted == drafted and rounds.reused()
        verifier.release_row()
        pool.requests -= 1
        tokens_out[0] += out

    def client(times: list[float | None]) -> Generator:
        for at in times:
            if at is not None and sim.now < at:
                yield at - sim.now
            start = sim.now if at is None else at
            q = rng.choice(costs.questions)
            rounds = _Round(costs, cfg, q.domain, random.Random(rng.random()))
            yield sim.process(request(q, rounds))
            latencies.append(sim.now - start)

    for times in _arrivals(cfg, rng):
        sim.process(client(times))
    sim.run()
    wall = sim.now
    for v in verifiers:
        v._account()
    p50, p99 = np.percentile(latencies, [50, 99])
    passes = sum(v.passes for v in verifiers)
    return SimResult(
        config=asdict(cfg), requests=len(latencies), generated_tokens=tokens_out[0], wall_s=wall,
        tokens_per_s=tokens_out[0] / wall, requests_per_s=len(latencies) / wall,
        p50_s=float(p50), p99_s=float(p99), mean_s=float(np.mean(latencies)),
        verifier_idle=1 - sum(v.busy_s for v in verifiers) / (wall * len(verifiers)),
        drafter_idle=1 - sum(p.busy_s for p in pools) / (wall * len(pools) * cfg.pool_workers),
        verifier_occupancy=sum(v.row_seconds for v in verifiers) / (wall * len(verifiers) * cfg.max_batch),
        mean_batch_rows=sum(v.rows_verified for v in verifiers) / passes if passes else 0.0,
        tokens_per_pass=(tokens_out[0] - len(latencies)) / tokens_out[1] if tokens_out[1] else 0.0,
        passes=passes, pass_ms=sum(v.pass_s for v in verifiers) / passes * 1000 if passes else 0.0)


def replicate(costs: Costs, cfg: SimConfig, repeats: int) -> dict:
    """The mean of each measure over `repeats` runs with seeds cfg.seed, cfg.seed + 1, ...: a
    load test of a few requests is one draw of many; its expectation is what to compare."""
    runs = [simulate(costs, SimConfig(**{**asdict(cfg), "seed": cfg.seed + i})) for i in range(repeats)]
    measures = [k for k, v in asdict(runs[0]).items() if isinstance(v, (int, float))]
    return {"config": asdict(cfg), "repeats": repeats,
            **{k: float(np.mean([getattr(r, k) for r in runs])) for k in measures}}


# ---- the projection grid --------------------------------------------------------------------


def grid(costs: Costs, base: SimConfig, verifiers: Iterable[int], pools: Iterable[int],
         requests_per_client: int = 8) -> list[dict]:
    """Every (verifiers, pools) at saturation: closed loop, as many clients as the verifiers have
    rows, each sending `requests_per_client` requests."""
    rows = []
    for n in verifiers:
        for m in pools:
            clients = n * base.max_batch
            cfg = SimConfig(**{**asdict(base), "verifiers": n, "pools": m, "clients": clients, "rate": None,
                               "requests": clients * requests_per_client})
            r = simulate(costs, cfg)
            rows.append({"verifiers": n, "pools": m, "clients": clients, "tokens_per_s": r.tokens_per_s,
                         "requests_per_s": r.requests_per_s, "p50_s": r.p50_s, "p99_s": r.p99_s,
                         "verifier_idle": r.verifier_idle, "drafter_idle": r.drafter_idle,
                         "verifier_occupancy": r.verifier_occupancy, "mean_batch_rows": r.mean_batch_rows})
    return rows


def saturation_points(rows: list[dict], within: float = 0.05) -> list[dict]:
    """Per verifier count: the fewest pools whose throughput is within `within` of the most any
    pool count reached, and the pools' busy share there (what the autoscaler may aim at)."""
    out = []
    for n in sorted({r["verifiers"] for r in rows}):
        mine = sorted((r for r in rows if r["verifiers"] == n), key=lambda r: r["pools"])
        best = max(r["tokens_per_s"] for r in mine)
        knee = next(r for r in mine if r["tokens_per_s"] >= (1 - within) * best)
        out.append({"verifiers": n, "pools": knee["pools"], "pools_per_verifier": knee["pools"] / n,
                    "tokens_per_s": knee["tokens_per_s"], "best_tokens_per_s": best,
                    "drafter_busy": 1 - knee["drafter_idle"], "verifier_busy": 1 - knee["verifier_idle"],
                    "verifier_occupancy": knee["verifier_occupancy"]})
    return out


def grid_markdown(rows: list[dict], value: str = "tokens_per_s", fmt: str = ".1f") -> str:
    """One measure of the grid as a table: verifiers down, pools across."""
    ns = sorted({r["verifiers"] for r in rows})
    ms = sorted({r["pools"] for r in rows})
    by = {(r["verifiers"], r["pools"]): r for r in rows}
    lines = ["| verifiers \\ pools | " + " | ".join(map(str, ms)) + " |", "| ---: |" + " ---: |" * len(ms)]
    for n in ns:
        lines.append(f"| {n} | " + " | ".join(format(by[(n, m)][value], fmt) if (n, m) in by else ""
                                              for m in ms) + " |")
    return "\n".join(lines)


# ---- the command ----------------------------------------------------------------------------

LEVEL_COLUMNS = ("verifiers", "pools", "clients", "pipelined", "tokens/s", "requests/s", "p50 s", "p99 s",
                 "verifier idle", "drafter idle", "verifier occupancy", "rows/pass", "tokens/pass")


def _level_cells(r: dict) -> list[str]:
    c = r["config"]
    return [str(c["verifiers"]), str(c["pools"]), str(c["clients"]), "yes" if c["pipelined"] else "no",
            f"{r['tokens_per_s']:.1f}", f"{r['requests_per_s']:.3f}", f"{r['p50_s']:.2f}", f"{r['p99_s']:.2f}",
            f"{r['verifier_idle']:.0%}", f"{r['drafter_idle']:.0%}", f"{r['verifier_occupancy']:.0%}",
            f"{r['mean_batch_rows']:.2f}", f"{r['tokens_per_pass']:.2f}"]


def levels_markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(LEVEL_COLUMNS) + " |", "|" + " ---: |" * len(LEVEL_COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(_level_cells(r)) + " |" for r in rows])


def saturation_markdown(points: list[dict]) -> str:
    lines = ["| verifiers | pools at 95% of the best | pools per verifier | tokens/s there | best tokens/s | "
             "pools busy | verifiers busy | verifier occupancy |", "|" + " ---: |" * 8]
    for p in points:
        lines.append(f"| {p['verifiers']} | {p['pools']} | {p['pools_per_verifier']:.2f} | {p['tokens_per_s']:.0f} | "
                     f"{p['best_tokens_per_s']:.0f} | {p['drafter_busy']:.0%} | {p['verifier_busy']:.0%} | "
                     f"{p['verifier_occupancy']:.0%} |")
    return "\n".join(lines)


def run_simulation(args) -> dict:
    """`specserve simulate --costs FILE`: the load levels asked for, or with `grid` the projection."""
    costs = load_costs(args.costs)
    base = SimConfig(pool_workers=args.pool_workers, max_batch=args.max_batch, max_batch_tokens=args.max_batch_tokens,
                     drafter=args.drafter, draft_length=args.draft_length, pipelined=args.pipelined,
                     rate=args.rate, requests=args.requests, max_tokens=args.max_tokens, seed=args.seed,
                     pool_link_ms=getattr(args, "pool_link_ms", 0.0))
    report = {"command": "specserve " + " ".join(getattr(args, "argv", []) or []), "costs": str(args.costs),
              "percentiles": PERCENTILES}
    if args.grid:
        rows = grid(costs, base, args.verifiers, args.pools, args.requests_per_client)
        points = saturation_points(rows)
        report.update(grid=rows, saturation=points)
        text = ("Tokens/s (projection, closed loop, as many clients as verifier rows):\n\n"
                + grid_markdown(rows) + "\n\nVerifier idle:\n\n" + grid_markdown(rows, "verifier_idle", ".0%")
                + "\n\nDrafter idle:\n\n" + grid_markdown(rows, "drafter_idle", ".0%")
                + "\n\np50 latency, s:\n\n" + grid_markdown(rows, "p50_s", ".2f")
                + "\n\np99 latency, s:\n\n" + grid_markdown(rows, "p99_s", ".2f")
                + "\n\nWhere the verifiers saturate:\n\n" + saturation_markdown(points))
    else:
        rows = []
        for n in args.verifiers:
            for m in args.pools:
                for clients in args.clients:
                    cfg = SimConfig(**{**asdict(base), "verifiers": n, "pools": m, "clients": clients})
                    rows.append(replicate(costs, cfg, args.repeats))
        report["results"] = rows
        text = levels_markdown(rows)
    text = f"Command: `{report['command']}`\n\n{text}\n"
    report["markdown"] = text
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        Path(args.out).with_suffix(".md").write_text(text)
    print(text)
    return report
