"""Where a served round's time goes: the same prompts decoded plainly (no drafter)
through a running server and through a verifier engine in this process.

    specserve serve --config bench/configs/served.toml &
    python scripts/served_pass_probe.py --server 127.0.0.1:50061

Served, per target pass: the client's wall time, the verifier's own time in its
forward passes (its Stats RPC: busy seconds over passes), and the CPU time of the
verifier process. In process, the same prompts go through a `VerifierEngine`
loaded as the verifier actor loads it (model on one torch thread, the engine's
worker on `--threads`), with no gRPC and no Ray. The served wall time minus the
served busy time is the wire and the router; the served busy time minus the local
one is what the forward loses to the other processes sharing the cores. Run with
nothing else busy; the server must be idle.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import grpc
import psutil

from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc

QUESTIONS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "spec_bench" / "dev.jsonl"


def verifier_stub() -> tuple[psutil.Process, pb_grpc.VerifierStub]:
    """The local verifier actor's process and a stub on its gRPC port."""
    proc = next((p for p in psutil.process_iter(["cmdline"]) if "VerifierActor" in " ".join(p.info["cmdline"] or [])),
                None)
    if proc is None:
        raise SystemExit("no ray::VerifierActor process on this machine: start `specserve serve` first")
    for port in sorted({c.laddr.port for c in proc.net_connections() if c.status == psutil.CONN_LISTEN}):
        stub = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        try:
            stub.Stats(pb.VerifierStatsRequest(), timeout=2)
            return proc, stub
        except grpc.RpcError:
            continue  # Ray's own port
    raise SystemExit("the verifier actor answers no Stats call")


def served(server: str, prompts: list[str], max_tokens: int) -> dict[str, float]:
    from specserve.client import Client

    proc, stub = verifier_stub()
    with Client(server, timeout=300) as client:
        client.generate(messages=[{"role": "user", "content": "warm up"}], max_tokens=8, drafter="none")
        before, cpu0, started = stub.Stats(pb.VerifierStatsRequest()), proc.cpu_times(), time.monotonic()
        passes = 0
        for prompt in prompts:
            out = client.generate(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                  drafter="none")
            passes += out.usage.target_forward_passes
        wall, after, cpu1 = time.monotonic() - started, stub.Stats(pb.VerifierStatsRequest()), proc.cpu_times()
    forwards = after.forward_passes - before.forward_passes  # prefills included, as in busy_seconds
    return {"wall_ms": 1000 * wall / passes,
            "busy_ms": 1000 * (after.busy_seconds - before.busy_seconds) / forwards,
            "verifier_cpu_ms": 1000 * (sum(cpu1[:2]) - sum(cpu0[:2])) / forwards}


def local(prompts: list[str], max_tokens: int, threads: int) -> dict[str, float]:
    from cluster.actors import load_on_one_thread
    from cluster.config import ServeConfig
    from speculative.sampling import SamplingParams
    from speculative.tree import DraftTree
    from verifier_service.engine import VerifierEngine

    model, tokenizer = load_on_one_thread(ServeConfig())
    engine = VerifierEngine(model, threads=threads)
    try:
        wall = busy = 0.0
        forwards = 0
        for i, prompt in enumerate(prompts):
            ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
            before, started = engine.stats(), time.monotonic()
            engine.prefill(f"p{i}", ids, SamplingParams(max_tokens=max_tokens))
            for _ in range(max_tokens - 1):
                engine.verify(f"p{i}", DraftTree())
            wall += time.monotonic() - started
            after = engine.stats()
            busy += after["busy_seconds"] - before["busy_seconds"]
            forwards += after["forward_passes"] - before["forward_passes"]
            engine.release(f"p{i}")
    finally:
        engine.close()
    return {"wall_ms": 1000 * wall / forwards, "busy_ms": 1000 * busy / forwards}


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
              f"verifier CPU {s['verifier_cpu_ms']:.1f} ms a forward")
        loc = local(prompts, args.max_tokens, args.threads)
        print(f"run {run} local:  wall {loc['wall_ms']:.1f} ms a pass, engine busy {loc['busy_ms']:.1f} ms a forward")


if __name__ == "__main__":
    main()
