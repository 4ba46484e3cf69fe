"""A specserve cluster of real hosts on this machine: network namespaces, each with its
own address on a private subnet, a Ray node in each (tests/netns.py, the code the tests
use). Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's `ip`.

    python scripts/netns_cluster.py up [--verifiers 1] [--drafters 1] [--delay-ms D] [--tls]
        the head (Ray head, Redis, `specserve serve`), verifier and drafter nodes; prints
        the addresses, serves until Ctrl-C, then removes everything
    python scripts/netns_cluster.py bench [--delays 0,1,5] [--prompts 6] [--max-tokens 64]
        the drafter link through a userspace delay wire: served speed, sequential against
        pipelined, at each one-way delay (a markdown table, and --json FILE)
    python scripts/netns_cluster.py validate [--delays 0,1,5] [--verifiers 1] [--pools 1] [--clients 1 2 4]
                                             [--requests 12] [--max-tokens 64] [--cores 0 1] [--json FILE]
        the cluster simulator against this cluster (scripts/netns_validate.py): measured
        against simulated throughput at each delay, the simulator's pool link set to it
    python scripts/netns_cluster.py cleanup
        remove namespaces and links a killed run left (every name starting with "ssn")
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from netns import PREFIX, NetnsCluster, cleanup, missing_rights, serve_config, toml  # noqa: E402


def build(workdir: Path, verifier_nodes: int, drafter_nodes: int, delay_ms: float | None, tls: bool,
          **sections) -> tuple[NetnsCluster, object, object, str]:
    """The cluster (started), `specserve serve` on its head, its Redis and the secret; `sections`
    (config tables, [verifiers] and [drafter_pools] among them) merged over serve_config's."""
    verifiers, drafters = verifier_nodes, drafter_nodes
    c = NetnsCluster(workdir)
    try:
        head = c.add_host("head")
        nodes = [(c.add_host(f"verifier{i}"), "verifier") for i in range(verifiers)]
        nodes += [(c.add_host(f"drafter{i}", delay_ms=delay_ms), "drafter") for i in range(drafters)]
        secret = secrets.token_urlsafe(24)
        security = {}
        if tls:
            from certs import ClusterCa

            security = ClusterCa().write(workdir, ips=tuple(h.ip for h in c.hosts.values()), names=())
        print(f"netns_cluster: {len(c.hosts)} hosts on {c.subnet}; starting Ray", flush=True)
        c.start_ray(head, head=True, num_cpus=1)
        redis = c.start_redis(head)
        c.start_nodes([(host, {kind: 1}) for host, kind in nodes])
        sections.setdefault("verifiers", {})["count"] = verifiers
        sections.setdefault("drafter_pools", {})["count"] = drafters
        sections["security"] = {**sections.get("security", {}), **security}
        print("netns_cluster: starting specserve serve on the head", flush=True)
        served = c.serve(head, toml(serve_config(head, secret, **sections)), redis.url)
        return c, served, redis, secret
    except BaseException:
        c.close()
        raise


def up(args) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="netns-cluster-"))
    c, served, redis, _ = build(workdir, args.verifiers, args.drafters, args.delay_ms, args.tls)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        for host in c.hosts.values():
            print(f"  {host.name:10} {host.ip:14} netns {host.netns}  (ip netns exec {host.netns} ...)")
        print(f"  gRPC {served.grpc}   HTTP {served.http}/v1   Redis {redis.url}\n"
              f"  Ray {c.ray_address} (token in {c.ray_token}); logs in {workdir}\n"
              "netns_cluster: serving; Ctrl-C stops and removes it", flush=True)
        stop.wait()
    finally:
        print("netns_cluster: removing the cluster", flush=True)
        c.close()
    return 0


def _generate(stub, pb, prompt: str, max_tokens: int, pipelined: bool):
    t0 = time.perf_counter()
    reply = stub.Generate(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=prompt)],
                                             sampling=pb.SamplingParams(max_tokens=max_tokens),
                                             pipelined=pipelined), timeout=600)
    return time.perf_counter() - t0, reply


def _router_counters(http: str) -> dict[str, float]:
    """The router's drafter-side seconds (its calls to the pools, the link included) and its
    target passes so far, from the ingress's /metrics."""
    import urllib.request

    with urllib.request.urlopen(f"{http}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    found = {"drafter_s": 0.0, "verifier_s": 0.0, "passes": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == "specserve_busy_seconds_total" and 'side="drafter"' in line:
            found["drafter_s"] += float(line.rsplit(" ", 1)[1])
        elif name == "specserve_busy_seconds_total" and 'side="verifier"' in line:
            found["verifier_s"] += float(line.rsplit(" ", 1)[1])
        elif name == "specserve_target_passes_total":
            found["passes"] += float(line.rsplit(" ", 1)[1])
    return found


def bench(args) -> int:
    import grpc

    from conftest import dev_prompts
    from delay_proxy import measure_rtt
    from protos import specserve_pb2 as pb
    from protos import specserve_pb2_grpc as pb_grpc

    delays = [float(d) for d in args.delays.split(",")]
    prompts = [p for _, p in dev_prompts(args.prompts)]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="netns-bench-"))
    router = {"default_drafter": args.drafter, "adaptive": not args.fixed_draft_length}
    c, served, _, _ = build(workdir, 1, 1, delays[0], args.tls, router=router,
                            drafter_pools={"kinds": args.kinds.split(",")})
    rows = []
    try:
        drafter = c.hosts["drafter0"]
        with grpc.insecure_channel(served.grpc) as channel:
            stub = pb_grpc.SpecserveStub(channel)
            for warm in prompts[:2]:  # first requests compile, learn costs, calibrate
                for pipelined in (False, True):
                    _generate(stub, pb, warm, args.max_tokens, pipelined)
            for delay in delays:
                c.set_delay(drafter, delay)
                rtt, rtt_min = measure_rtt(drafter)
                totals = {False: [0.0, 0, 0, 0], True: [0.0, 0, 0, 0]}  # seconds, tokens, passes, reused
                sides = {False: [0.0, 0.0], True: [0.0, 0.0]}  # the router's drafter and verifier seconds
                for r in range(args.repeats):
                    for k, prompt in enumerate(prompts):
                        order = (False, True) if (k + r) % 2 == 0 else (True, False)  # alternate: drift cancels
                        for pipelined in order:
                            before = _router_counters(served.http)
                            seconds, reply = _generate(stub, pb, prompt, args.max_tokens, pipelined)
                            after = _router_counters(served.http)
                            sides[pipelined][0] += after["drafter_s"] - before["drafter_s"]
                            sides[pipelined][1] += after["verifier_s"] - before["verifier_s"]
                            t = totals[pipelined]
                            t[0] += seconds
                            t[1] += reply.usage.completion_tokens
                            t[2] += reply.usage.target_forward_passes
                            t[3] += reply.usage.reused_drafts
                seq, pipe = totals[False], totals[True]
                row = {"delay_ms": delay, "rtt_ms": round(rtt, 2), "rtt_min_ms": round(rtt_min, 2),
                       "sequential_tok_s": round(seq[1] / seq[0], 2), "pipelined_tok_s": round(pipe[1] / pipe[0], 2),
                       "sequential_ms_per_round": round(1000 * seq[0] / seq[2], 1),
                       "pipelined_ms_per_round": round(1000 * pipe[0] / pipe[2], 1),
                       "tokens_per_round": round(seq[1] / seq[2], 2),
                       "pipelined_reused_share": round(pipe[3] / max(pipe[2], 1), 2),
                       "sequential_drafter_ms_per_round": round(1000 * sides[False][0] / seq[2], 1),
                       "sequential_verifier_ms_per_round": round(1000 * sides[False][1] / seq[2], 1),
                       "pipelined_drafter_ms_per_round": round(1000 * sides[True][0] / pipe[2], 1),
                       "speedup": round((pipe[1] / pipe[0]) / (seq[1] / seq[0]), 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        c.close()
    print("\n| one-way delay (ms) | measured RTT (ms) | sequential tok/s | pipelined tok/s | pipelined / sequential "
          "| ms a round, sequential (drafting / verifying) | ms a round, pipelined | rounds drafted ahead and used |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['delay_ms']:g} | {r['rtt_ms']} | {r['sequential_tok_s']} | {r['pipelined_tok_s']} | "
              f"{r['speedup']}x | {r['sequential_ms_per_round']} ({r['sequential_drafter_ms_per_round']} / "
              f"{r['sequential_verifier_ms_per_round']}) | {r['pipelined_ms_per_round']} | "
              f"{round(100 * r['pipelined_reused_share'])}% |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    u = sub.add_parser("up", help="start a cluster and serve until Ctrl-C")
    b = sub.add_parser("bench", help="sequential against pipelined across a delayed drafter link")
    v = sub.add_parser("validate", help="the cluster simulator against this cluster, at each drafter-link delay")
    for s in (u, b, v):
        s.add_argument("--workdir", help="logs, configs, certificates, Redis's files (default: a new temp dir)")
        s.add_argument("--tls", action="store_true", help="internal calls over mutual TLS (certificates made here)")
    u.add_argument("--verifiers", type=int, default=1)
    u.add_argument("--drafters", type=int, default=1)
    u.add_argument("--delay-ms", type=float, default=None, help="the drafter links through a delay wire")
    b.add_argument("--delays", default="0,1,5", help="one-way delays of the drafter link, ms")
    b.add_argument("--prompts", type=int, default=6, help="Spec-Bench dev questions (round-robin categories)")
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--drafter", default="pld", help="the drafter every request uses")
    b.add_argument("--kinds", default="pld,suffix", help="the drafters the pool hosts")
    b.add_argument("--fixed-draft-length", action="store_true", help="[router] adaptive = false")
    b.add_argument("--json", help="write the rows here")
    import netns_validate

    netns_validate.add_arguments(v)
    sub.add_parser("cleanup", help=f"remove leftover namespaces and links (names starting {PREFIX!r})")
    args = p.parse_args()
    if args.command == "cleanup":
        removed = cleanup()
        print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to remove")
        return 0
    missing = missing_rights()
    if missing:
        print(f"netns_cluster: cannot make the cluster: {missing}", file=sys.stderr)
        return 1
    if args.command == "validate":
        if args.cores is not None and args.cores[0] == args.cores[1]:
            p.error("--cores: two different cores")
        return netns_validate.validate(args, build)
    return up(args) if args.command == "up" else bench(args)


if __name__ == "__main__":
    sys.exit(main())
