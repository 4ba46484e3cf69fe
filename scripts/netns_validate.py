"""`scripts/netns_cluster.py validate`: the cluster simulator against the network-namespace
cluster, its drafter links through the delay wire (tests/delay_proxy.py).

One cluster per verifier and pool count: a head (Ray head, Redis, `specserve serve`), V verifier
nodes, P drafter nodes, with scripts/validate_simulator.py's reduced configuration (one model
drafter, a 5-token chain a round, adaptive off, no confidence stop) and every round through
the pool (`verifier_drafting = false`). With the first cluster up the costs are measured
(in process, the call overhead through its server: plain decoding, which never crosses the
drafter link, so it holds at every delay). Then, at each one-way delay (the wire's delay set
in place, the cluster kept: a start costs minutes on two cores), `bench --load` at each client
count, and the same simulated with `pool_link_ms` = the delay.

Two comparisons are printed: with the costs measured in process (or as --costs / --fit-served
give them, as in validate_simulator), and with the costs fitted to what the served verifier and
pool showed at the first delay (validate_simulator's fitted_to_served on this run's own
first-delay levels: in sample there, a check of the link model at the others).
"""

from __future__ import annotations

import json
import sys
import tempfile
import tomllib
from pathlib import Path

from validate_simulator import (GOAL, compared_rows, finish_costs, fitted_to_served, measure_against, run_levels,
                                served_config, sim_config, to_markdown)


def add_arguments(parser) -> None:
    from validate_simulator import add_validation_args

    add_validation_args(parser)
    parser.add_argument("--delays", default="0,1,5", help="one-way delays of the drafter links, ms")
    parser.add_argument("--pools", type=int, nargs="+", default=[1], help="drafter nodes (a cluster each)")
    parser.add_argument("--verifiers", type=int, nargs="+", default=[1],
                        help="verifier nodes (a cluster for each with each pool count); with --cores and two "
                             "or more, the verifiers run on both cores, one thread each")
    parser.add_argument("--json", default="netns-validation.json",
                        help="the report (and .md, .costs.json, .load*.json beside it)")


def sections(pools: int, drafter: str, cores: list[int] | None, verifiers: int = 1) -> dict:
    """The loopback validation's served configuration, every round drafted on the pool."""
    tree = tomllib.loads(served_config(pools, drafter, cores, verifiers))
    tree["router"]["verifier_drafting"] = False  # as the link bench: every draft crosses the link
    return tree


def validate(args, build) -> int:
    """`build(workdir, verifiers, drafters, delay_ms, tls, **sections)` -> (cluster, served, redis, secret)."""
    from delay_proxy import measure_rtt

    delays = [float(d) for d in args.delays.split(",")]
    out = Path(args.json)
    costs_path = out.with_suffix(".costs.json")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="netns-validate-"))
    loads: dict[tuple[float, int], dict[int, dict]] = {}  # (delay, verifiers) -> pools -> levels
    rtts: dict[float, tuple[float, float]] = {}
    plain: list[dict] = []
    clusters = [(v, p) for v in args.verifiers for p in args.pools]
    for i, (verifiers, pools) in enumerate(clusters):
        c, served, _, _ = build(workdir / f"v{verifiers}p{pools}", verifiers, pools, delays[0],
                                args.tls, **sections(pools, args.drafter, args.cores, verifiers))
        try:  # build() removed what it made if it failed; from here close() does
            if i == 0:
                print("netns_cluster: measuring the costs", flush=True)
                plain = measure_against(args, served, costs_path)
            drafters = [h for name, h in c.hosts.items() if name.startswith("drafter")]
            for delay in delays:
                for host in drafters:
                    c.set_delay(host, delay)
                rtts[delay] = measure_rtt(drafters[0])
                print(f"netns_cluster: {verifiers} verifier(s), {pools} pool(s), {delay:g} ms one way (TCP round "
                      f"trip {rtts[delay][0]:.2f} ms): load levels {args.clients}", flush=True)
                stem = f".load{pools}-{delay:g}ms" if verifiers == 1 else f".load{verifiers}v{pools}-{delay:g}ms"
                loads.setdefault((delay, verifiers), {})[pools] = run_levels(args, served, seed=pools,
                                                                             out_stem=out.with_suffix(stem))
        finally:
            c.close()
    costs = finish_costs(args, costs_path, plain)
    command = "python scripts/netns_cluster.py validate " + " ".join(sys.argv[2:])
    report = {"command": command, "costs": str(costs_path), "goal": f"|error| <= {GOAL:.0%}",
              "placement": "network namespaces on one machine; " + (
                  "shared cores" if args.cores is None else
                  f"one verifier on core {args.cores[0]}, two or more on cores {sorted(set(args.cores))}; "
                  f"pools on core {args.cores[1]}"),
              "rows": rows_at_delays(args, costs, loads, rtts)}
    given = (f"fitted to the served sides in {args.fit_served} (--fit-served)" if args.fit_served else
             "measured in process" if args.costs is None else f"in {args.costs}")
    report["costs_are"] = given
    text = f"With the costs {given}:\n\n" + to_markdown(report)
    fitted = fitted_at_first_delay(args, costs_path, report["rows"], delays[0])
    if fitted is not None:
        fitted_path = out.with_suffix(".fitted.costs.json")
        fitted_path.write_text(json.dumps(fitted, indent=1))
        from bench.simulator import costs_from_dict

        report["fitted"] = {"costs": str(fitted_path), "fitted_at_delay_ms": delays[0],
                            "rows": rows_at_delays(args, costs_from_dict(fitted), loads, rtts)}
        text += (f"\nWith the costs fitted to the served sides at {delays[0]:g} ms (in sample there):\n\n"
                 + to_markdown({"command": command, "rows": report["fitted"]["rows"]}))
    out.write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


def rows_at_delays(args, costs, loads: dict, rtts: dict) -> list[dict]:
    rows = []
    for (delay, verifiers), by_pools in sorted(loads.items()):
        for r in compared_rows(args, costs, by_pools, pool_link_ms=delay, verifiers=verifiers):
            rows.append({"delay_ms": delay, "rtt_ms": round(rtts[delay][0], 2), **r})
    return rows


def fitted_at_first_delay(args, costs_path: Path, rows: list[dict], delay: float) -> dict | None:
    """The costs fitted (validate_simulator.fitted_to_served) to the served sides' counters at
    `delay` with the fewest verifiers (so more verifiers are out of sample at every delay); None
    where those levels cannot be fitted (fewer than two distinct rows a pass)."""
    fewest = min(r["verifiers"] for r in rows)
    first = [r for r in rows if r["delay_ms"] == delay and r["verifiers"] == fewest]
    try:
        fitted = fitted_to_served(json.loads(costs_path.read_text()),
                                  {"command": f"this run at {delay:g} ms", "rows": first}, args.drafter,
                                  lambda r: sim_config(args, r["pools"], r["clients"], delay, r["verifiers"]),
                                  args.sim_repeats)
    except SystemExit as e:
        print(f"netns_cluster: no fit at {delay:g} ms: {e}", flush=True)
        return None
    return fitted
