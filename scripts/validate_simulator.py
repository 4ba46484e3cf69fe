"""Check the cluster simulator (bench/simulator.py) against the real local cluster.

For each drafter-pool count (1 verifier): start `specserve serve` (local Ray
cluster, embedded store, free ports) with the bench's served configuration
made predictable enough to simulate (one drafter per request, fixed draft
length, a chain a round, no adaptive lengths, no confidence stop); with the
first server up, measure the costs on this machine (bench/costs.py, the call
overhead through that server); run the real load test (`specserve bench
--load`, Poisson arrivals per client) at each client count; simulate the same
settings with the measured costs (the mean of `--sim-repeats` seeded runs);
print measured against simulated throughput and the error.

    python scripts/validate_simulator.py --clients 1 2 4 8 --pools 1 2 --requests 16 --out validation.json

The goal is the simulator's throughput within 15% of the measured.

The simulator gives each service cores of its own, as separate nodes have. On
one small machine `--cores V D` makes that true: the verifier computes on core
V and the drafter pool on core D, one torch thread each, and the costs are
measured on one thread on core D, which plain-decoding calls leave idle. With
more than one pool they all share core D (the simulator gives each its own, so
where the pools are busy the measured side falls short of it).

    python scripts/validate_simulator.py --cores 0 1 --pools 1 --clients 1 2 4 8 --requests 12 --max-tokens 64

With `--fit-served EARLIER.json` (this script's report of an earlier run) the
simulator takes the verification pass's and the drafting's costs as the served
services timed them in that run, not as timed in process: fit on one run,
checked against another.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from argparse import Namespace
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bench.simulator import SimConfig, load_costs, replicate  # noqa: E402
import serve_process  # noqa: E402  (tests/serve_process.py: `specserve serve` on free ports)
from serve_process import specserve_serve  # noqa: E402

DRAFT_LENGTH = 5
GOAL = 0.15


def served_config(pools: int, drafter: str, cores: list[int] | None = None, verifiers: int = 1) -> str:
    """bench/configs/served.toml with `verifiers` verifiers and `pools` drafter pools, and nothing the
    simulator does not model: one drafter, a chain of DRAFT_LENGTH a round, no adaptive lengths, no
    early stop. `cores` (verifier core, pool core): each side pinned to its own core, one torch thread
    each; two verifiers or more may run on both cores, one thread each (the kernel spreads them)."""
    verifier_cores = [cores[0]] if cores is None or verifiers == 1 else sorted(set(cores))
    verifier, pool = ("threads = 2", "threads = 1") if cores is None else (
        f"threads = 1\ncores = {verifier_cores}", f"threads = 1\ncores = [{cores[1]}]")
    return f"""
[router]
default_drafter = "{drafter}"
fused_drafters = 1
draft_length = {DRAFT_LENGTH}
tree_budget = {DRAFT_LENGTH}
pipelined = false
adaptive = false
stop_confidence = 0.0

[verifiers]
count = {verifiers}
{verifier}

[drafter_pools]
count = {pools}
kinds = ["{drafter}"]
{pool}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_validation_args(parser)
    parser.add_argument("--pools", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default="validation.json")
    parser.add_argument("--start-timeout", type=float, default=serve_process.START_TIMEOUT_S,
                        help="seconds a server may take to start (a busy machine starts Ray slowly)")
    args = parser.parse_args()
    if args.cores is not None and args.cores[0] == args.cores[1]:
        parser.error("--cores: two different cores")
    serve_process.START_TIMEOUT_S = args.start_timeout

    costs_path = Path(args.out).with_suffix(".costs.json")
    loads, served = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for i, pools in enumerate(args.pools):
            config = served_config(pools, args.drafter, args.cores)
            with specserve_serve(Path(tmp) / f"pools{pools}.toml", config) as server:
                if i == 0:
                    served = measure_against(args, server, costs_path)
                loads[pools] = run_levels(args, server, seed=pools,
                                          out_stem=Path(args.out).with_suffix(f".load{pools}"))
    costs = finish_costs(args, costs_path, served)
    rows = compared_rows(args, costs, loads)
    report = {"command": "python scripts/validate_simulator.py " + " ".join(sys.argv[1:]), "costs": str(costs_path),
              "placement": "shared cores" if args.cores is None else f"verifier on core {args.cores[0]}, "
                                                                      f"pools on core {args.cores[1]}",
              "goal": f"|error| <= {GOAL:.0%}", "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=2))
    text = to_markdown(report)
    Path(args.out).with_suffix(".md").write_text(text)
    print(text)


def add_validation_args(parser) -> None:
    """What a validation run takes, here and in scripts/netns_cluster.py validate."""
    parser.add_argument("--questions", default=str(ROOT.parent / "shared/data/spec_bench/dev.jsonl"))
    parser.add_argument("--limit-per-category", type=int, default=2)
    parser.add_argument("--drafter", default="small-general")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rate", type=float, default=0.5, help="Poisson requests/s per client")
    parser.add_argument("--requests", type=int, default=16, help="requests per load level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timing-repeats", type=int, default=7)
    parser.add_argument("--sim-repeats", type=int, default=50)
    parser.add_argument("--costs", default=None,
                        help="use this costs file (--measure-costs) instead of measuring one; only the call "
                             "overhead is measured, through the first server")
    parser.add_argument("--fit-served", default=None, metavar="EARLIER_JSON",
                        help="take the pass and draft costs from the served services' counters in an earlier "
                             "run's report (at least two load levels) instead of the in-process timings")
    parser.add_argument("--cores", type=int, nargs=2, metavar=("VERIFIER", "POOL"), default=None,
                        help="pin the verifier to one core and the drafter pools to the other (one torch thread each); "
                             "the costs are measured on one thread on the pool's core")


def measure_against(args, server, costs_path: Path) -> list[dict]:
    """With a server up (`.grpc`): the costs measured into `costs_path` (in process, the call
    overhead through that server); or, with `args.costs`, only the plain-decoding requests the
    call overhead comes from (returned, for finish_costs)."""
    if args.costs is not None:
        from bench.costs import served_plain_requests

        return served_plain_requests(server.grpc, first_prompts(args), args.max_tokens)
    from bench.costs import measure_costs

    with on_core(args.cores):
        measure_costs(Namespace(
            model=None, device="cpu", dtype="float32", questions=args.questions,
            limit_per_category=args.limit_per_category, drafters=[args.drafter], server=server.grpc,
            call_requests=4, timing_repeats=args.timing_repeats, max_tokens=args.max_tokens,
            draft_length=DRAFT_LENGTH, measure_costs=str(costs_path),
            argv=["simulate", "--measure-costs", str(costs_path), "--drafters", args.drafter,
                  "--server", server.grpc, "--limit-per-category", str(args.limit_per_category),
                  "--max-tokens", str(args.max_tokens)]))
    return []


def run_levels(args, server, seed: int, out_stem: Path) -> dict:
    """`bench --load` against `server` (`.grpc`, `.http`) at each of `args.clients`, one level at
    a time, the services' counters read around each: {"results": [...]}."""
    from bench.load import run_load

    results = []
    for clients in args.clients:
        before = served_counters(server.http)
        load = run_load(Namespace(
            questions=args.questions, limit_per_category=args.limit_per_category, seed=seed,
            server=server.grpc, http=None, clients=[clients], rate=args.rate, requests=args.requests,
            load_modes=[args.drafter], max_tokens=args.max_tokens, repeats=1,
            out=f"{out_stem}-{clients}.json", argv=[]))
        sides = served_sides(before, served_counters(server.http))
        results += [{**r, "served": sides} for r in load["results"]]
    return {"results": results}


def finish_costs(args, costs_path: Path, served: list[dict]):
    """The costs to simulate with: `args.costs` with the call overhead `served` implies (read only
    now: it may still have been measured while the servers ran), else what measure_against wrote;
    with `args.fit_served`, refitted to that earlier report."""
    if args.costs is not None:
        with_call_overhead(Path(args.costs), costs_path, served)
    if args.fit_served is not None:
        fitted = fitted_to_served(json.loads(costs_path.read_text()), json.loads(Path(args.fit_served).read_text()),
                                  args.drafter, lambda r: sim_config(args, r["pools"], r["clients"],
                                                                     verifiers=r.get("verifiers", 1)),
                                  args.sim_repeats)
        costs_path.write_text(json.dumps(fitted, indent=1))
    return load_costs(costs_path)


def compared_rows(args, costs, loads: dict, pool_link_ms: float = 0.0, verifiers: int = 1) -> list[dict]:
    """Each measured level (`loads`: pools -> run_levels' result) beside its simulation (the mean
    of `args.sim_repeats` seeded runs, `verifiers` verifiers, the pools' link `pool_link_ms` one way)."""
    rows = []
    for pools, load in loads.items():
        for measured in load["results"]:
            sim = replicate(costs, sim_config(args, pools, measured["clients"], pool_link_ms, verifiers),
                            args.sim_repeats)
            # a level whose requests all failed has no throughput to compare with
            error = sim["tokens_per_s"] / measured["tokens_per_s"] - 1 if measured["tokens_per_s"] else None
            rows.append({"verifiers": verifiers, "pools": pools, "clients": measured["clients"],
                         "measured_tokens_per_s": measured["tokens_per_s"],
                         "simulated_tokens_per_s": round(sim["tokens_per_s"], 3), "errors": measured["errors"],
                         "error": None if error is None else round(error, 4),
                         "measured_p50_s": measured["p50_s"], "simulated_p50_s": round(sim["p50_s"], 3),
                         "measured_p99_s": measured["p99_s"], "simulated_p99_s": round(sim["p99_s"], 3),
                         "measured_tokens_per_pass": measured["tokens_per_pass"],
                         "simulated_tokens_per_pass": round(sim["tokens_per_pass"], 3),
                         "simulated_verifier_idle": round(sim["verifier_idle"], 3),
                         "simulated_drafter_idle": round(sim["drafter_idle"], 3),
                         "measured_passes": measured["served"]["passes"],
                         "simulated_passes": round(sim["passes"], 1),
                         "measured_mean_batch_rows": measured["served"]["mean_batch_rows"],
                         "simulated_mean_batch_rows": round(sim["mean_batch_rows"], 2),
                         "measured_pass_ms": measured["served"]["pass_ms"],
                         "measured_row_tokens": measured["served"].get("row_tokens"),
                         "simulated_pass_ms": round(sim["pass_ms"], 1),
                         "measured_propose_ms": measured["served"]["propose_ms"]})
    return rows


def sim_config(args, pools: int, clients: int, pool_link_ms: float = 0.0, verifiers: int = 1) -> SimConfig:
    return SimConfig(verifiers=verifiers, pools=pools, drafter=args.drafter, draft_length=DRAFT_LENGTH, clients=clients,
                     rate=args.rate, requests=args.requests, max_tokens=args.max_tokens, pool_link_ms=pool_link_ms)


@contextmanager
def on_core(cores: list[int] | None):
    """With `cores`, this process on the pool's core with one torch thread, as each side computes
    (plain-decoding calls leave that core idle); as it was afterwards."""
    if cores is None:
        yield
        return
    import torch

    from cluster.local import pin_threads, pin_to_cores

    allowed, threads = os.sched_getaffinity(0), torch.get_num_threads()
    pin_to_cores([cores[1]], "--cores")
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        pin_threads(allowed)


COUNTERS = {"passes": ("specserve_verifier_pass_seconds", "count"),
            "pass_s": ("specserve_verifier_pass_seconds", "sum"),
            "rows": ("specserve_verifier_batch_size", "sum"),
            "tokens": ("specserve_verifier_pass_tokens", "total"),
            "proposals": ("specserve_drafter_propose_seconds", "count"),
            "propose_s": ("specserve_drafter_propose_seconds", "sum")}


def served_counters(http: str) -> dict[str, float]:
    """The verifier's and pools' pass and proposal counters, summed over instances (the ingress's
    /metrics gathers every service's)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    out = {}
    for key, (name, part) in COUNTERS.items():
        family = families.get(name)
        out[key] = sum(s.value for s in family.samples if s.name == f"{name}_{part}") if family else 0.0
    return out


def served_sides(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """What the served verifier and pools did during one load level: verification passes (prefills
    not counted), mean rows a pass, mean pass and proposal time."""
    d = {k: after[k] - before[k] for k in COUNTERS}
    return {"passes": int(d["passes"]),
            "mean_batch_rows": round(d["rows"] / d["passes"], 2) if d["passes"] else None,
            # tokens a row (its root and its draft): None from services too old to count them
            "row_tokens": round(d["tokens"] / d["rows"], 2) if d["rows"] and d["tokens"] else None,
            "pass_ms": round(d["pass_s"] / d["passes"] * 1000, 1) if d["passes"] else None,
            "propose_ms": round(d["propose_s"] / d["proposals"] * 1000, 2) if d["proposals"] else None}


def first_prompts(args, n: int = 2) -> list[str]:
    from bench.questions import load_questions

    return [q["turns"][0] for q in load_questions(args.questions, args.limit_per_category)][:n]


def with_call_overhead(given: Path, out: Path, served: list[dict]) -> None:
    """`given` costs (measured without a server) with the call overhead the `served` plain-decoding
    requests imply (bench.costs.call_ms), as `out`."""
    from bench.costs import call_ms

    costs = json.loads(given.read_text())
    costs.update(call_ms=round(call_ms(served, costs), 3), call_ms_measured=True, served_plain_requests=served)
    out.write_text(json.dumps(costs, indent=1))


# what a fit keeps of each level it was fitted to
LEVEL_KEYS = ("pools", "clients", "measured_tokens_per_s", "measured_mean_batch_rows", "measured_row_tokens",
              "measured_pass_ms", "measured_propose_ms")


def fitted_to_served(costs: dict, earlier: dict, drafter: str, config: Callable[[dict], SimConfig],
                     repeats: int) -> dict:
    """`costs` with the verification pass, the drafting and the call overhead as the served services
    showed them in an `earlier` run (this script's report, same settings). The pass: base and per-row
    cost fitted to each level's mean pass, the per-token cost kept and taken out at the tokens a row
    the verifier counted (a lookup drafter's rows are often its root alone; an older report, without
    the count, at a root and a chain of DRAFT_LENGTH, as a model drafter's rows are). A draft token: the least-loaded level's
    mean proposal over DRAFT_LENGTH (under load, proposals also wait for each other on the pool's
    core, which the simulator models). The call overhead: what makes the simulated least-loaded level
    as fast as it was measured (`config(level)` simulates a report's row), as everything else a round costs
    outside the two services' own timers (the network, the router, gRPC) is in it."""
    from bench.simulator import costs_from_dict, fit_linear

    levels = [r for r in earlier["rows"] if r.get("measured_pass_ms") and r.get("measured_mean_batch_rows")]
    if len({r["measured_mean_batch_rows"] for r in levels}) < 2:
        raise SystemExit("--fit-served: the earlier report needs two load levels with different rows a pass")
    v = costs["verify_pass"]
    base, row = fit_linear([([r["measured_mean_batch_rows"]],
                             r["measured_pass_ms"] - v["token_ms"] * (r.get("measured_row_tokens") or 1 + DRAFT_LENGTH)
                             * r["measured_mean_batch_rows"])
                            for r in levels])
    lone = min(levels, key=lambda r: (r["clients"], r.get("verifiers", 1), r["pools"]))
    fitted = {**costs, "verify_pass": {**v, "base_ms": round(base, 3), "row_ms": round(row, 3)},
              "draft_token_ms": {**costs["draft_token_ms"],
                                 drafter: round(lone["measured_propose_ms"] / DRAFT_LENGTH, 3)}}
    low, high = 0.0, 200.0  # call overhead in ms: the simulated throughput falls as it grows
    for _ in range(12):
        fitted["call_ms"] = (low + high) / 2
        simulated = replicate(costs_from_dict(fitted), config(lone), repeats)["tokens_per_s"]
        low, high = (fitted["call_ms"], high) if simulated > lone["measured_tokens_per_s"] else (low, fitted["call_ms"])
    fitted["call_ms"] = round((low + high) / 2, 3)
    fitted["fitted_to_served"] = {"report": earlier["command"], "call_ms_in_process": costs["call_ms"],
                                  "levels": [{"verifiers": r.get("verifiers", 1)} | {k: r.get(k) for k in LEVEL_KEYS}
                                             for r in levels]}
    return fitted


def to_markdown(report: dict) -> str:
    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    # rows measured across a delayed pool link (scripts/netns_cluster.py validate) lead with its delay
    delay = (lambda r: f"| {r['delay_ms']:g} ") if "delay_ms" in report["rows"][0] else (lambda r: "")
    head = ("| one-way pool link delay ms ", "| ---: ") if "delay_ms" in report["rows"][0] else ("", "")
    # and with their verifier count, where a report has more than one
    if len({r.get("verifiers", 1) for r in report["rows"]}) > 1:
        lead = delay
        delay = lambda r: lead(r) + f"| {r['verifiers']} "  # noqa: E731
        head = (head[0] + "| verifiers ", head[1] + "| ---: ")
    lines = [f"Command: `{report['command']}`", "",
             head[0] + "| pools | clients | failed requests | measured tokens/s | simulated tokens/s | error | "
             "measured p50 / p99 s | simulated p50 / p99 s | tokens/pass measured / simulated |",
             head[1] + "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["rows"]:
        lines.append(delay(r) + f"| {r['pools']} | {r['clients']} | {r['errors']} | {r['measured_tokens_per_s']:.2f} | "
                     f"{r['simulated_tokens_per_s']:.2f} | {num(r['error'], '+.1%')} | "
                     f"{num(r['measured_p50_s'], '.2f')} / {num(r['measured_p99_s'], '.2f')} | "
                     f"{r['simulated_p50_s']:.2f} / {r['simulated_p99_s']:.2f} | "
                     f"{num(r['measured_tokens_per_pass'], '.2f')} / {r['simulated_tokens_per_pass']:.2f} |")
    lines += ["", "What the verifier and the pool did, measured (their /metrics, a level's warm-up request "
              "included) and simulated:", "",
              head[0] + "| pools | clients | verification passes | rows a pass | ms a pass | ms a proposal (measured) |",
              head[1] + "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["rows"]:
        lines.append(delay(r) + f"| {r['pools']} | {r['clients']} | {r['measured_passes']} / {r['simulated_passes']:.0f} | "
                     f"{num(r['measured_mean_batch_rows'], '.2f')} / {r['simulated_mean_batch_rows']:.2f} | "
                     f"{num(r['measured_pass_ms'], '.1f')} / {r['simulated_pass_ms']:.1f} | "
                     f"{num(r['measured_propose_ms'], '.1f')} |")
    compared = [r for r in report["rows"] if r["error"] is not None]
    within = sum(abs(r["error"]) <= GOAL for r in compared)
    return "\n".join(lines + ["", f"Within {GOAL:.0%}: {within} of {len(compared)} rows compared."]) + "\n"


if __name__ == "__main__":
    main()
