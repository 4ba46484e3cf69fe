"""The fuzzing campaign of issue 21: hypothesis over every gRPC request message of
every service, and schemathesis over the HTTP API's OpenAPI document.

    specserve serve --http-port 8092 --port 50092 &     # wait for "serving on"
    python scripts/fuzz.py --grpc-examples 3000 --grpc-router 127.0.0.1:50092 --router-examples 150 \
        --http http://127.0.0.1:8092 --http-examples 1000

gRPC: programs of calls (tests/fuzzing.py) to a router, a verifier and a drafter
pool served in this process on loopback around the tiny target, the internal two
with a cluster secret (the servicers and validation `specserve serve` runs; the
tiny target keeps each call cheap), split evenly over the three services; after
each program every request id it prefilled is released and no service may hold
anything. With --grpc-router, programs of Generate / GenerateStream calls also go
to that running router (its real model). One gRPC request in six goes as bytes no
message serialises to (a lone surrogate, nesting, a wrong wire type, a message over
4 MiB) and one has a NaN or infinite float. HTTP: schemathesis cases of every
operation of the server's /openapi.json, valid by the document and not, three in
four steered to reach the model, and one case in three a hostile body (a lone
surrogate, a non-finite float, a wrong JSON type, deep nesting, a body over
--http-max-body-bytes) that must get the error naming its field; afterwards the
ingress's /metrics must show every verifier's `specserve_verifier_rows_held` and
every pool's `specserve_drafter_requests_held` at 0, and a plain request must
succeed.

Counts per RPC / operation and status, the crashes (INTERNAL / UNKNOWN / 5xx /
no answer) with the first failing inputs, and the leak checks: printed as a
markdown table and written to OUT.json and OUT.md (default docs/fuzz/fuzz.*).
Exit status 1 when anything broke the properties.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the services, and the fuzz helpers beside the tests

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from tqdm import tqdm  # noqa: E402

from cluster.config import HttpSettings  # noqa: E402
from drafter_service.settings import DrafterPoolSettings  # noqa: E402
from fuzzing import (SERVICES, TINY_KINDS, HttpFuzz, Strategies, Tally, Target, describe,  # noqa: E402
                     still_serving, tiny_services)

CAMPAIGN = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.generate])  # no shrinking: every failure is recorded, not raised


def fuzz_grpc(target: Target, strategies: Strategies, services: list[str], examples: int, tally: Tally,
              leaks: list[dict], random_seed: int, bar: tqdm) -> None:
    """`examples` programs split evenly over `services`; a program after which a service
    still holds something is recorded in `leaks`."""
    for i, service in enumerate(services):
        share = examples // len(services) + (i < examples % len(services))
        if not share:
            continue

        @seed(random_seed + i)
        @settings(max_examples=share, **CAMPAIGN)
        @given(strategies.program(service))
        def run(program):
            target.run(program, tally)
            bar.update(len(program))
            held = target.leaks(wait_s=2.0)
            if held and len(leaks) < 20:
                leaks.append({"service": service, "held": held,
                              "program": [f"{rpc.name} {describe(req)}" for rpc, req in program]})
                for name in held:  # start the next program from nothing
                    release_all(target, name, strategies.request_ids)

        bar.set_description(f"gRPC {service}")
        run()


def release_all(target: Target, service: str, request_ids: tuple[str, ...]) -> None:
    from fuzzing import call, rpcs

    from protos import specserve_pb2 as pb

    release = next(r for r in rpcs(service) if r.method == "Release")
    for request_id in request_ids:
        call(target.channel(service), release, pb.ReleaseRequest(request_id=request_id), 10.0, target.secret)


def fuzz_http(fuzz: HttpFuzz, examples: int, random_seed: int, bar: tqdm) -> None:
    @seed(random_seed)
    @settings(max_examples=examples, **CAMPAIGN)
    @given(fuzz.strategy())
    def run(case_and_aim):
        fuzz.run(*case_and_aim)
        bar.update(1)

    bar.set_description("HTTP")
    run()


def table(report: dict) -> str:
    lines = [f"# Fuzzing campaign ({report['date']})", "", f"`{report['command']}`", "",
             "| target | RPC / operation | calls | outcomes | crashes |", "|---|---|---:|---|---:|"]
    for row in report["rows"]:
        outcomes = ", ".join(f"{status} {n}" for status, n in row["statuses"].items())
        lines.append(f"| {row['target']} | {row['name']} | {row['calls']} | {outcomes} | {row['crashes']} |")
    t = report["totals"]
    lines += ["", f"**{t['inputs']} generated inputs** ({t['grpc_calls']} gRPC calls in {t['grpc_programs']} "
              f"programs, {t['http_requests']} HTTP requests) in {t['seconds']:.0f} s: "
              f"**{t['crashes']} crashes** (INTERNAL / UNKNOWN / 5xx / no answer), "
              f"{t['property_failures']} property failures in all.", ""]
    for check in report["checks"]:
        lines.append(f"- {check['check']}: **{'ok' if check['ok'] else 'FAILED'}** {check.get('detail', '')}")
    if report["failures"]:
        lines += ["", "First failing inputs:", ""]
        for f in report["failures"]:
            lines.append(f"- `{f['name']}` -> {f['status']} {f['details'][:200]!r}: `{f['input'][:400]}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--grpc-examples", type=int, default=3000,
                    help="hypothesis programs (1-6 calls each) over the in-process services (default 3000)")
    ap.add_argument("--grpc-router", metavar="HOST:PORT", help="also fuzz this running router's Specserve service")
    ap.add_argument("--router-examples", type=int, default=200, help="programs for --grpc-router (default 200)")
    ap.add_argument("--router-kinds", nargs="+", default=DrafterPoolSettings().kinds,
                    help="the drafters that router's pools serve (the likely drafter names; default: the "
                         "served default)")
    ap.add_argument("--http", metavar="URL", help="a running `specserve serve`'s HTTP API, e.g. http://127.0.0.1:8092")
    ap.add_argument("--http-examples", type=int, default=1000, help="schemathesis cases (default 1000)")
    ap.add_argument("--http-max-body-bytes", type=int, default=HttpSettings().max_body_bytes,
                    help="that server's [http] max_body_bytes (default: the setting's default)")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "fuzz" / "fuzz",
                    help="write OUT.json and OUT.md (default docs/fuzz/fuzz)")
    args = ap.parse_args(argv)

    started = time.monotonic()
    tally, leaks, checks = Tally(keep=10), [], []
    rows, failures = [], []
    programs = 0
    from tiny import TINY

    with tqdm(unit="input", dynamic_ncols=True) as bar:
        if args.grpc_examples:
            with tiny_services() as target:
                strategies = Strategies(TINY.vocab_size, TINY_KINDS)
                fuzz_grpc(target, strategies, list(SERVICES), args.grpc_examples, tally, leaks, args.seed, bar)
                programs += args.grpc_examples
                problems = still_serving(target)
                checks.append({"check": "in-process services: valid calls of every stateful RPC succeed afterwards",
                               "ok": not problems, "detail": "; ".join(problems)})
                held = target.leaks()
                checks.append({"check": "in-process services: no request held after each program and at the end "
                                        "(verifier rows, drafter pool requests)",
                               "ok": not leaks and not held,
                               "detail": f"{len(leaks)} leaking programs; held at the end: {held or 'none'}"})
            rows += grpc_rows(tally, "in-process (tiny target)")
        if args.grpc_router:
            router_tally = Tally(keep=10)
            remote = Target({"Specserve": args.grpc_router}, timeout_s=120.0)
            strategies = Strategies(TINY.vocab_size, tuple(args.router_kinds))  # GenerateRequest has no token ids
            fuzz_grpc(remote, strategies, ["Specserve"], args.router_examples, router_tally, [], args.seed, bar)
            programs += args.router_examples
            problems = still_serving(remote)
            checks.append({"check": f"router {args.grpc_router}: a valid Generate succeeds afterwards",
                           "ok": not problems, "detail": "; ".join(problems)})
            remote.close()
            rows += grpc_rows(router_tally, f"router {args.grpc_router}")
            tally.failures += router_tally.failures
            tally.failure_count += router_tally.failure_count
            tally.counts.update(router_tally.counts)
        http = None
        if args.http:
            import requests

            model = requests.get(f"{args.http.rstrip('/')}/v1/models", timeout=30).json()["data"][0]["id"]
            http = HttpFuzz(args.http, model, max_body_bytes=args.http_max_body_bytes)
            fuzz_http(http, args.http_examples, args.seed, bar)
            ok, detail = http.still_serving()
            checks.append({"check": "HTTP: a plain chat request succeeds afterwards", "ok": ok, "detail": detail})
            leaked = http.leaks()
            checks.append({"check": "HTTP: /metrics shows every verifier's rows and every pool's requests at 0",
                           "ok": not leaked, "detail": json.dumps(leaked) if leaked else str(sorted(http.held()))})
            rows += http_rows(http)

    for o in tally.failures:
        failures.append({"name": o.rpc, "status": o.status, "details": o.details, "input": describe(o.request)})
    for o in (http.failures if http else []):
        failures.append({"name": o.operation, "status": str(o.status), "details": o.problem,
                         "input": json.dumps(o.body, default=repr, ensure_ascii=False)})
    for leak in leaks:
        failures.append({"name": f"{leak['service']} (leak)", "status": "HELD", "details": json.dumps(leak["held"]),
                         "input": " ; ".join(leak["program"])})
    grpc_calls = sum(tally.counts.values())
    http_requests = sum(http.counts.values()) if http else 0
    report = {
        "command": "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0])), *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(),
        "rows": rows,
        "totals": {"inputs": grpc_calls + http_requests, "grpc_programs": programs, "grpc_calls": grpc_calls,
                   "http_requests": http_requests, "seconds": time.monotonic() - started,
                   "crashes": sum(r["crashes"] for r in rows),
                   "property_failures": tally.failure_count + (http.failure_count if http else 0) + len(leaks)},
        "checks": checks,
        "failures": failures[:20],
    }
    text = table(report)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    args.out.with_suffix(".md").write_text(text)
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")
    broken = report["totals"]["property_failures"] or not all(c["ok"] for c in checks)
    return 1 if broken else 0


def grpc_rows(tally: Tally, where: str) -> list[dict]:
    rows = []
    for name in sorted({rpc for rpc, _ in tally.counts}):
        statuses = Counter({s: n for (rpc, s), n in tally.counts.items() if rpc == name})
        rows.append({"target": where, "name": name, "calls": sum(statuses.values()),
                     "statuses": dict(statuses.most_common()),
                     "crashes": statuses["INTERNAL"] + statuses["UNKNOWN"] + statuses["UNHANDLED"]})
    return rows


def http_rows(fuzz: HttpFuzz) -> list[dict]:
    rows = []
    for name in sorted({op for op, _ in fuzz.counts}):
        statuses = Counter({str(s): n for (op, s), n in fuzz.counts.items() if op == name})
        rows.append({"target": f"HTTP {fuzz.base}", "name": name, "calls": sum(statuses.values()),
                     "statuses": dict(statuses.most_common()),
                     "crashes": sum(n for s, n in statuses.items() if int(s) == 0 or int(s) >= 500)})
    return rows


if __name__ == "__main__":
    sys.exit(main())
