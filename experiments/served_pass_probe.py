"""Where a served round's time goes: the same prompts decoded plainly (no drafter)
through a running server and through a verifier engine in this process.

    export SPECSERVE_CLUSTER_SECRET=$(python -c 'import secrets; print(secrets.token_hex(16))')
    specserve serve --config bench/configs/served.toml &
    python experiments/served_pass_probe.py --server 127.0.0.1:50061

(the probe calls the verifier's Stats with the cluster secret, which it reads from
SPECSERVE_CLUSTER_SECRET as the server does).

Served, per target pass: the client's wall time, the verifier's own time in its
forward passes (its Stats RPC: busy seconds over passes), and the CPU time of the
verifier and router processes. In process, the same prompts go through a `VerifierEngine`
loaded as the verifier actor loads it (model on one torch thread, the engine's
worker on `--threads`), with no gRPC and no Ray; then through the router's
coordinator in this process, calling that engine behind its real gRPC server on
loopback (no Ray, one process). The served wall time minus the served busy time
is the wire and the router; the served busy time minus the local one is what the
forward loses to the other processes sharing the cores; the loopback line shows
what the gRPC call alone adds. Run with nothing else busy; the server must be idle.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Callable

import grpc
import psutil

from cluster.env import cluster_secret_from_env
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from protos.server import CLUSTER_SECRET_METADATA

QUESTIONS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "spec_bench" / "dev.jsonl"


def actor_process(name: str) -> psutil.Process:
    """The local Ray actor process `ray::<name>`."""
    proc = next((p for p in psutil.process_iter(["cmdline"]) if name in " ".join(p.info["cmdline"] or [])), None)
    if proc is None:
        raise SystemExit(f"no ray::{name} process on this machine: start `specserve serve` first")
    return proc


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def verifier_stats() -> tuple[psutil.Process, Callable[[], pb.VerifierStatsResponse]]:
    """The local verifier replica's process and its Stats call (with the cluster secret)."""
    secret = cluster_secret_from_env()
    if secret is None:
        raise SystemExit("set SPECSERVE_CLUSTER_SECRET, for the server and this probe alike")
    proc = actor_process("ServeReplica:specserve:Verifier")
    for port in sorted({c.laddr.port for c in proc.net_connections() if c.status == psutil.CONN_LISTEN}):
        stub = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        stats = partial(stub.Stats, pb.VerifierStatsRequest(), timeout=5,
                        metadata=[(CLUSTER_SECRET_METADATA, secret)])
        try:
            stats()
            return proc, stats
        except grpc.RpcError:
            continue  # Ray's own port, or the secret is not the server's
    raise SystemExit("the verifier answers no Stats call (is SPECSERVE_CLUSTER_SECRET the server's?)")


def served(server: str, prompts: list[str], max_tokens: int, drafter: str = "none",
           pipelined: bool | None = None) -> dict[str, float]:
    """`prompts` through a running server: ms a pass (round) of wall time, the verifier's busy
    ms a forward, the CPU ms of the verifier a forward and of the router and drafter pool a
    pass, tokens/s and tokens a pass."""
    from specserve.client import Client

    (proc, stats), router, pool = (verifier_stats(), actor_process("ServeReplica:specserve:Router"),
                                   actor_process("ServeReplica:specserve:DrafterPool"))
    with Client(server, timeout=300) as client:
        client.generate(messages=[{"role": "user", "content": "warm up"}], max_tokens=8, drafter=drafter,
                        pipelined=pipelined)
        before, started = stats(), time.monotonic()
        cpu0, router0, pool0 = cpu_seconds(proc), cpu_seconds(router), cpu_seconds(pool)
        passes = tokens = 0
        for prompt in prompts:
            out = client.generate(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                  drafter=drafter, pipelined=pipelined)
            passes += out.usage.target_forward_passes
            tokens += out.usage.completion_tokens
        wall, after = time.monotonic() - started, stats()
        cpu1, router1, pool1 = cpu_seconds(proc), cpu_seconds(router), cpu_seconds(pool)
    forwards = after.forward_passes - before.forward_passes  # prefills included, as in busy_seconds
    return {"wall_ms": 1000 * wall / passes,
            "busy_ms": 1000 * (after.busy_seconds - before.busy_seconds) / forwards,
            "verifier_cpu_ms": 1000 * (cpu1 - cpu0) / forwards, "router_cpu_ms": 1000 * (router1 - router0) / passes,
            "pool_cpu_ms": 1000 * (pool1 - pool0) / passes, "tokens_per_s": tokens / wall,
            "tokens_per_pass": tokens / passes}


def local(prompts: list[str], max_tokens: int, threads: int) -> tuple[dict[str, float], dict[str, float]]:
    """The engine called directly, then by the coordinator over loopback gRPC."""
    from cluster.actors import load_on_one_thread
    from cluster.config import ServeConfig
    from router.coordinator import Coordinator, Job
    from router.stats import RoundStats
    from speculative.sampling import SamplingParams
    from speculative.tree import DraftTree
    from verifier_service.engine import VerifierEngine
    from verifier_service.servicer import serve

    model, tokenizer = load_on_one_thread(ServeConfig())
    engine = VerifierEngine(model, threads=threads)
    server, port = serve(engine)
    coordinator = Coordinator(verifiers=lambda: [f"127.0.0.1:{port}"], drafters=lambda: [])
    direct, looped = {"wall": 0.0, "busy": 0.0, "passes": 0}, {"wall": 0.0, "busy": 0.0, "call": 0.0, "passes": 0}
    try:
        for i, prompt in enumerate(prompts):
            ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
            before, started = engine.stats(), time.monotonic()
            engine.prefill(f"p{i}", ids, SamplingParams(max_tokens=max_tokens))
            for _ in range(max_tokens - 1):
                engine.verify(f"p{i}", DraftTree())
            direct["wall"] += time.monotonic() - started
            engine.release(f"p{i}")
            after = engine.stats()
            direct["busy"] += after["busy_seconds"] - before["busy_seconds"]
            direct["passes"] += after["forward_passes"] - before["forward_passes"]

            job = Job(f"c{i}", ids, SamplingParams(max_tokens=max_tokens), (("none", 1.0),), 0, 0,
                      model.config.vocab_size, tokenizer.eos_token_ids)
            stats, before, started = RoundStats(), engine.stats(), time.monotonic()
            for _ in coordinator.run(job, stats):
                pass
            looped["wall"] += time.monotonic() - started
            looped["busy"] += engine.stats()["busy_seconds"] - before["busy_seconds"]
            looped["call"] += stats.busy_seconds("verify", "prefill")
            looped["passes"] += stats.target_forward_passes
    finally:
        coordinator.services.channels.close()
        server.stop(None)
        engine.close()
    return ({key: 1000 * value / direct["passes"] for key, value in direct.items() if key != "passes"},
            {key: 1000 * value / looped["passes"] for key, value in looped.items() if key != "passes"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, help="a running specserve server, HOST:PORT")
    ap.add_argument("--questions", default=str(QUESTIONS))
    ap.add_argument("--prompts", type=int, default=4, help="dev questions, spread over the file")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=psutil.cpu_count(), help="torch threads of the local engine")
    ap.add_argument("--repeats", type=int, default=2, help="served and local runs, alternating")
    args = ap.parse_args()
    questions = [json.loads(line) for line in Path(args.questions).read_text().splitlines() if line.strip()]
    step = max(1, len(questions) // args.prompts)
    prompts = [q["turns"][0] for q in questions[::step][:args.prompts]]
    for run in range(1, args.repeats + 1):
        s = served(args.server, prompts, args.max_tokens)
        print(f"run {run} served: wall {s['wall_ms']:.1f} ms a pass, verifier busy {s['busy_ms']:.1f} ms a forward, "
              f"verifier CPU {s['verifier_cpu_ms']:.1f} ms a forward, router CPU {s['router_cpu_ms']:.2f} ms a pass")
        alone, looped = local(prompts, args.max_tokens, args.threads)
        print(f"run {run} local:  wall {alone['wall']:.1f} ms a pass, engine busy {alone['busy']:.1f} ms a forward")
        print(f"run {run} loopback: wall {looped['wall']:.1f} ms a pass, verify call {looped['call']:.1f} ms, "
              f"engine busy {looped['busy']:.1f} ms a forward")


if __name__ == "__main__":
    main()
