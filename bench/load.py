"""`specserve bench --load`: a running server under Poisson load, speculative vs plain decoding.

Plain decoding "served the same way" is the same server with the drafter
pinned to "none"; speculation is the server's own choice (mode "auto": the
request names no drafter). Each load level runs `clients` client threads,
each a Poisson process of `--rate` requests/s. The schedule is open loop: a
request's arrival time is fixed in advance, and its latency is its completion
time minus that arrival time, so time spent waiting behind the client's
previous request counts. Every mode of a level replays the same arrival
times and prompts, the modes back to back (their order alternating from
run to run) so drift on the machine hits them alike. With `--repeats R`
each level runs R times, each run with its own arrivals and prompts, and the
verdict is on the median of the runs' ratios: one run's p99 is nearly its
slowest request, and moves by several percent from run to run.

The server is reached over gRPC (`--server HOST:PORT`) or its OpenAI-compatible
HTTP API (`--http URL`, bench.http_client), or both: with both, every run
replays its arrivals and prompts through each API in turn (the order of APIs
alternating with the order of modes), each API and mode learning in a memory
namespace of its own, and ratios are against plain decoding over the same API.

A mode named twice runs twice in each run, the second time as `MODE#2`: `--load-modes
none auto none` puts plain decoding's ratio to itself (`none#2`) beside auto's, the
spread any verdict on one run's p99 has to be read against.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from bench.http_client import REQUEST_FAILED, HttpClient
from bench.questions import load_questions
from specserve.client import Client

BASELINE = "none"  # plain decoding; the ratios are against it
AUTO = "auto"  # the request names no drafter (""): the server chooses
PERCENTILES = "numpy.percentile, linear interpolation, over the requests that succeeded"
CLIENT_TIMEOUT_S = 600  # a request under load on a few CPU cores may take minutes; only a stuck one fails


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the level's start
    client: int
    index: int  # order of arrival over all clients; request i asks prompt i (round-robin)


@dataclass(frozen=True)
class Outcome:
    latency: float | None  # None: the request failed
    tokens: int = 0
    drafter: str = ""  # the drafter(s) the server reported using
    passes: int = 0  # target forward passes
    draft_tokens: int = 0  # draft tokens the verifier scored
    prompt_tokens: int = 0


def mode_labels(modes: Sequence[str]) -> list[str]:
    """Each mode's label in a run: a mode named again runs again, as MODE#2, MODE#3, ..."""
    seen: Counter[str] = Counter()
    labels = []
    for mode in modes:
        seen[mode] += 1
        labels.append(mode if seen[mode] == 1 else f"{mode}#{seen[mode]}")
    return labels


def drafter_of(label: str) -> str:
    """What a mode's requests name as their drafter ("": the server chooses)."""
    mode = label.split("#")[0]
    return "" if mode == AUTO else mode


def schedule(requests: int, clients: int, rate: float, rng: random.Random) -> list[Arrival]:
    """`requests` arrivals shared out evenly over `clients` independent Poisson
    processes of `rate` per second (exponential gaps), sorted by time."""
    counts = [requests // clients + (c < requests % clients) for c in range(clients)]
    times = [(t, c) for c, n in enumerate(counts)
             for t in itertools.accumulate(rng.expovariate(rate) for _ in range(n))]
    return [Arrival(t, c, i) for i, (t, c) in enumerate(sorted(times))]


def summarize(latencies: Sequence[float], tokens: int, wall_s: float, errors: int) -> dict:
    """One (level, mode): throughput over the level's wall time and latency percentiles."""
    p50, p99 = np.percentile(latencies, [50, 99]) if len(latencies) else (None, None)
    return {
        "requests": len(latencies) + errors, "errors": errors, "generated_tokens": tokens,
        "wall_s": round(wall_s, 3), "tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else 0.0,
        "p50_s": None if p50 is None else round(float(p50), 4),
        "p99_s": None if p99 is None else round(float(p99), 4),
        "mean_s": round(float(np.mean(latencies)), 4) if len(latencies) else None,
    }


def _speculation(done: Sequence[Outcome]) -> dict:
    """How much a mode speculated: tokens per target pass, draft tokens scored per token."""
    tokens, passes, drafted = (sum(getattr(o, f) for o in done) for f in ("tokens", "passes", "draft_tokens"))
    return {"tokens_per_pass": round(tokens / passes, 3) if passes else None,
            "draft_tokens_per_token": round(drafted / tokens, 3) if tokens else None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def run_level(client: Client | HttpClient, arrivals: list[Arrival], prompts: list[str], drafter: str,
              max_tokens: int, bar: tqdm, namespace: str = "") -> tuple[list[Outcome], float]:
    """Replay `arrivals` against the server, one thread per client, in memory `namespace`;
    (outcomes by index, wall seconds)."""
    outcomes: list[Outcome | None] = [None] * len(arrivals)
    lock = threading.Lock()
    start = time.perf_counter()

    def one_client(c: int) -> None:
        for a in (a for a in arrivals if a.client == c):
            time.sleep(max(0.0, start + a.at - time.perf_counter()))
            try:
                out = client.generate(messages=[{"role": "user", "content": prompts[a.index % len(prompts)]}],
                                      max_tokens=max_tokens, drafter=drafter, namespace=namespace)
                outcomes[a.index] = Outcome(time.perf_counter() - (start + a.at), len(out.token_ids),
                                            out.usage.drafter, out.usage.target_forward_passes,
                                            out.usage.draft_tokens, out.usage.prompt_tokens)
            except REQUEST_FAILED:
                outcomes[a.index] = Outcome(None)  # counted as an error, the run goes on
            with lock:
                bar.update()

    clients = max(a.client for a in arrivals) + 1
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(one_client, range(clients)))  # re-raises anything but a failed call
    return [o if o is not None else Outcome(None) for o in outcomes], time.perf_counter() - start


def per_request(arrivals: Sequence[Arrival], outcomes: Sequence[Outcome]) -> list[dict]:
    """Each request of a run, in order of arrival: which client sent it when, and what it took
    (latency None: it failed). The slowest ones are what a run's p99 is made of."""
    return [{"index": a.index, "client": a.client, "arrival_s": round(a.at, 3),
             "latency_s": None if o.latency is None else round(o.latency, 3), "prompt_tokens": o.prompt_tokens,
             "tokens": o.tokens, "passes": o.passes, "draft_tokens": o.draft_tokens, "drafter": o.drafter}
            for a, o in zip(arrivals, outcomes)]


def run_modes(client: Client | HttpClient, clients: int, arrivals: list[Arrival], prompts: list[str],
              modes: list[str], max_tokens: int, bar: tqdm, reverse: bool, run: int = 1,
              namespaces: dict[str, str] | None = None, api: str = "grpc") -> list[dict]:
    """One run of a load level over one API: every mode replays the same arrivals (in reverse
    order of modes if `reverse`), each in its memory namespace; rows in the order of `modes`,
    with ratios to plain decoding."""
    by_mode = {}
    for mode in modes[::-1] if reverse else modes:
        outcomes, wall = run_level(client, arrivals, prompts, drafter_of(mode), max_tokens, bar,
                                   (namespaces or {}).get(mode, ""))
        done = [o for o in outcomes if o.latency is not None]
        by_mode[mode] = {"api": api, "clients": clients, "run": run, "mode": mode,
                         **summarize([o.latency for o in done], sum(o.tokens for o in done), wall,
                                     len(outcomes) - len(done)),
                         **_speculation(done), "served_by": sorted({o.drafter for o in done}),
                         "per_request": per_request(arrivals, outcomes)}
    base = by_mode.get(BASELINE)
    for mode, row in by_mode.items():
        vs = base if mode != BASELINE else None
        row["p99_ratio"] = _ratio(row["p99_s"], vs and vs["p99_s"])
        row["throughput_ratio"] = _ratio(row["tokens_per_s"], vs and vs["tokens_per_s"])
    return [by_mode[m] for m in modes]


def medians(rows: list[dict]) -> list[dict]:
    """Per (API, level, mode other than plain decoding): the median, lowest and highest of the
    runs' p99 and throughput ratios."""
    def key(r: dict) -> tuple[str, int, str]:
        return r.get("api", "grpc"), r["clients"], r["mode"]

    out = []
    for k in dict.fromkeys(key(r) for r in rows if r["mode"] != BASELINE):
        runs = [r for r in rows if key(r) == k]
        entry = {"api": k[0], "clients": k[1], "mode": k[2], "runs": len(runs)}
        for name in ("p99_ratio", "throughput_ratio"):
            values = [r[name] for r in runs if r[name] is not None]
            entry[name] = round(float(np.median(values)), 3) if values else None
            entry[name + "_range"] = [min(values), max(values)] if values else None
        out.append(entry)
    return out


WARM_UP = "Say hello in one short sentence."


def run_load(args) -> dict:
    questions = load_questions(args.questions, args.limit_per_category)
    if not questions:
        raise ValueError(f"--questions: no questions in {args.questions}")
    prompts = [q["turns"][0] for q in questions]
    random.Random(args.seed or 0).shuffle(prompts)  # questions come by category: mix them over the levels
    rng = random.Random(args.seed or 0)
    rows, modes = [], mode_labels(args.load_modes)
    # each mode learns in a memory namespace of its own (speculative.namespaces): modes replay the
    # same prompts, and one must not draft another's answers from memory
    run_id = uuid.uuid4().hex[:8]
    http = getattr(args, "http", None)
    targets = [(api, flag, address) for api, flag, address in (("grpc", "--server", args.server),
                                                                ("http", "--http", http)) if address]
    # per API too: over HTTP a mode replays what it answered over gRPC
    namespaces = {(api, mode): f"load-{run_id}/{api}/{mode.replace('#', '.')}" for api, _, _ in targets
                  for mode in modes}
    with ExitStack() as stack:
        apis = []
        for api, flag, address in targets:
            client = stack.enter_context(Client(address, timeout=CLIENT_TIMEOUT_S) if api == "grpc"
                                         else HttpClient(address, timeout=CLIENT_TIMEOUT_S))
            apis.append((api, client))
            for mode in modes:  # untimed: the first request to a server pays for warming it up
                try:
                    # not a bench prompt: a suffix drafter would remember its answer
                    client.generate(messages=[{"role": "user", "content": WARM_UP}], max_tokens=args.max_tokens,
                                    drafter=drafter_of(mode), namespace=namespaces[(api, mode)])
                except REQUEST_FAILED as e:
                    raise ValueError(f"{flag} {address}: the warm-up request of mode {mode} failed: {e}") from e
        repeats = getattr(args, "repeats", 1) or 1
        total = len(args.clients) * repeats * len(apis) * len(modes) * args.requests
        with tqdm(total=total, desc="load", unit="req") as bar:
            for level, clients in enumerate(args.clients):
                for run in range(repeats):
                    arrivals = schedule(args.requests, clients, args.rate, rng)
                    # each run its own prompts (while the questions last): a server that learns from
                    # its traffic (the suffix drafter) must not have seen a run's answers before
                    first = (level * repeats + run) * args.requests
                    own = [prompts[(first + i) % len(prompts)] for i in range(args.requests)]
                    reverse = (level * repeats + run) % 2 == 1
                    by_api = {}
                    for api, client in apis[::-1] if reverse else apis:  # every API replays the run
                        by_api[api] = run_modes(client, clients, arrivals, own, modes,
                                                args.max_tokens, bar, reverse=reverse, run=run + 1, api=api,
                                                namespaces={m: namespaces[(api, m)] for m in modes})
                    rows += [row for api, _ in apis for row in by_api[api]]
    report = {
        "command": "specserve " + " ".join(getattr(args, "argv", []) or []),
        "api": "+".join(api for api, _, _ in targets),  # grpc, http, or grpc+http
        "server": args.server, "http": http, "max_tokens": args.max_tokens, "rate_per_client": args.rate,
        "requests_per_row": args.requests, "seed": args.seed or 0, "modes": modes,
        "runs_per_level": repeats,
        "distinct_prompts_per_level": len(prompts) >= len(args.clients) * repeats * args.requests,
        "percentiles": PERCENTILES, "results": rows, "medians": medians(rows),
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    Path(args.out).with_suffix(".md").write_text(to_markdown(report))
    print_table(report)
    return report


COLUMNS = ("api", "clients", "run", "mode", "requests", "errors", "tokens", "tokens/s", "p50 s", "p99 s", "mean s",
           "p99 vs none", "tokens/s vs none", "tokens/pass", "drafted/token", "served by")


def _cells(row: dict) -> list[str]:
    def num(v: float | None, fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    return [row.get("api", "grpc"), str(row["clients"]), str(row.get("run", 1)), row["mode"], str(row["requests"]),
            str(row["errors"]), str(row["generated_tokens"]),
            num(row["tokens_per_s"], ".1f"), num(row["p50_s"], ".3f"), num(row["p99_s"], ".3f"),
            num(row["mean_s"], ".3f"), num(row["p99_ratio"], ".2f"), num(row["throughput_ratio"], ".2f"),
            num(row.get("tokens_per_pass"), ".2f"), num(row.get("draft_tokens_per_token"), ".2f"),
            ", ".join(row["served_by"])]


def _notes(report: dict) -> list[str]:
    where = {"grpc": f"gRPC ({report.get('server')})", "http": f"OpenAI-compatible HTTP ({report.get('http')})"}
    notes = [f"API: {' and '.join(where[a] for a in report.get('api', 'grpc').split('+'))}; "
             f"{report['requests_per_row']} requests per row, Poisson arrivals at {report['rate_per_client']}/s "
             f"per client, max_tokens {report['max_tokens']}, greedy; latency = completion - scheduled arrival "
             f"(queueing included); percentiles: {report['percentiles']}."]
    if not report.get("distinct_prompts_per_level", True):
        notes.append("Runs share prompts (too few questions for distinct ones): a server that learns from its "
                     "traffic (the suffix drafter) has seen later runs' answers.")
    runs = report.get("runs_per_level", 1)
    summary = report.get("medians") or medians(report["results"])
    if runs > 1:
        for m in summary:
            notes.append(f"{m['clients']} clients, {m['mode']} over {m.get('api', 'grpc')}, median of {m['runs']} "
                         f"runs: p99 vs none {_fmt(m['p99_ratio'])} (runs {_span(m['p99_ratio_range'])}), "
                         f"tokens/s vs none "
                         f"{_fmt(m['throughput_ratio'])} (runs {_span(m['throughput_ratio_range'])}).")
    top = max((m["clients"] for m in summary), default=None)
    for m in summary:
        if m["clients"] == top and m["p99_ratio"] is not None:
            verdict = ("plain decoding against itself: how far one run's p99 strays"
                       if drafter_of(m["mode"]) == BASELINE else "not worse" if m["p99_ratio"] <= 1 else "worse")
            of = f", median of {runs} runs" if runs > 1 else ""
            notes.append(f"Highest load ({top} clients) over {m.get('api', 'grpc')}: p99 of {m['mode']} / "
                         f"p99 of none = {m['p99_ratio']:.2f}{of} ({verdict}).")
    return notes


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _span(r: list[float] | None) -> str:
    return "-" if not r else f"{r[0]:.2f}-{r[1]:.2f}"


def to_markdown(report: dict) -> str:
    lines = [f"Command: `{report['command']}`", "",
             "| " + " | ".join(COLUMNS) + " |",
             "| --- | ---: | ---: | --- |" + " ---: |" * (len(COLUMNS) - 5) + " --- |"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in report["results"]]
    return "\n".join(lines + [""] + _notes(report)) + "\n"


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"specserve bench --load (served over {report.get('api', 'grpc')}, greedy)")
    for i, name in enumerate(COLUMNS):
        table.add_column(name, justify="left" if i in (0, 3, len(COLUMNS) - 1) else "right")
    for r in report["results"]:
        table.add_row(*_cells(r))
    console = Console()
    console.print(table)
    for note in _notes(report):
        console.print(note)
