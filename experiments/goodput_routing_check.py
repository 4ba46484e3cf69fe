"""A quick, Ray-free look at "auto" routing by goodput against single drafters.

A real router, one verifier and one drafter pool (`bench/configs/served.toml`'s router settings and
pool kinds) serve the default target on loopback gRPC in this process; the first turn of
`--limit-per-category` dev questions per category goes through each mode in turn (each
mode in its own memory namespace, as the bench's served modes are), and the script prints
each mode's tokens per target pass (load-free) and tokens/s (not, on a shared machine) per
bench group, and the routes "auto" chose.

    python experiments/goodput_routing_check.py --limit-per-category 1 --modes auto pld suffix

This is not `specserve bench`: no Ray, no HTTP, no Hugging Face reference; the numbers a
claim needs come from the bench (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import time
import tomllib
from collections import Counter, defaultdict
from pathlib import Path

import grpc

from bench.questions import load_questions
from cluster.local import set_cpu_threads
from cluster.state import EmbeddedStateStore
from drafter_service.pool import DrafterPool
from drafter_service.servicer import serve as serve_drafters
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from router.adaptive import PassCostModel
from router.coordinator import Channels, Coordinator
from router.domains import bench_group
from router.expertise import ExpertiseRouter
from router.servicer import RouterConfig, RouterServicer
from router.servicer import serve as serve_router
from router.settings import RouterSettings
from runtime import loading
from speculative.drafter_kinds import drafter_domains
from verifier_service.engine import VerifierEngine
from verifier_service.servicer import serve as serve_verifier

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", default=str(REPO.parent / "shared/data/spec_bench/dev.jsonl"))
    ap.add_argument("--limit-per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=["auto", "pld", "suffix"])
    ap.add_argument("--config", default=str(REPO / "bench/configs/served.toml"))
    args = ap.parse_args()

    served = tomllib.loads(Path(args.config).read_text())
    settings = RouterSettings(**served["router"])
    kinds = served["drafter_pools"]["kinds"]
    set_cpu_threads()
    model, tokenizer = loading.load()
    pool, engine = DrafterPool(model, kinds=kinds), VerifierEngine(model, max_batch=4, max_len=2048)
    (pool_server, pool_port), (verifier_server, verifier_port) = serve_drafters(pool), serve_verifier(engine)
    pass_costs = PassCostModel(settings.verify_row_cost, settings.verify_token_cost, settings.verify_pad_cost)
    coordinator = Coordinator(verifiers=lambda: [f"127.0.0.1:{verifier_port}"],
                              drafters=lambda: [f"127.0.0.1:{pool_port}"], pass_costs=pass_costs,
                              channels=Channels())
    config = RouterConfig.of(settings, context_length=2048,
                             eos_token_ids=list(tokenizer.eos_token_ids or model.config.eos_token_ids),
                             vocab_size=model.config.vocab_size, routed_drafters=tuple(kinds))
    expertise = ExpertiseRouter(EmbeddedStateStore(), refresh_s=settings.routing_refresh_s,
                                specialties={k: drafter_domains(k) for k in kinds})
    servicer = RouterServicer(tokenizer, coordinator, config, expertise)
    router, port = serve_router(servicer, "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.SpecserveStub(channel)
    questions = load_questions(args.questions, args.limit_per_category)
    # per mode and group: tokens, passes, seconds; auto's routes
    totals: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0]))
    routes: dict[str, Counter] = defaultdict(Counter)
    try:
        for q in questions:
            group = bench_group(q["category"])
            for mode in args.modes:
                start = time.perf_counter()
                resp = stub.Generate(pb.GenerateRequest(
                    messages=[pb.ChatMessage(role="user", content=q["turns"][0])],
                    drafter="" if mode == "auto" else mode, namespace=f"check/{mode}",
                    sampling=pb.SamplingParams(max_tokens=args.max_tokens)), timeout=600)
                seconds = time.perf_counter() - start
                for key in (group, "all"):
                    t = totals[mode][key]
                    t[0] += resp.usage.completion_tokens
                    t[1] += resp.usage.target_forward_passes
                    t[2] += seconds
                if mode == "auto":
                    routes[group][resp.usage.drafter] += 1
                print(f"{group:14} {mode:8} {resp.usage.drafter:24} {resp.usage.completion_tokens:4} tokens "
                      f"{resp.usage.completion_tokens / max(resp.usage.target_forward_passes, 1):.2f} a pass "
                      f"{resp.usage.completion_tokens / seconds:.1f} tok/s", flush=True)
    finally:
        channel.close()
        router.stop(None)
        pool_server.stop(None)
        verifier_server.stop(None)
        engine.close()
    groups = sorted({g for m in totals.values() for g in m} - {"all"}) + ["all"]
    print("\ngroup          " + "".join(f"{m:>22}" for m in args.modes) + "   (tokens a pass, tok/s)")
    for g in groups:
        cells = []
        for m in args.modes:
            tokens, passes, seconds = totals[m][g]
            cells.append(f"{tokens / max(passes, 1):10.2f} {tokens / max(seconds, 1e-9):10.1f} ")
        print(f"{g:14} " + "".join(cells))
    print("\nauto's routes:", {g: dict(c) for g, c in routes.items()})


if __name__ == "__main__":
    main()
