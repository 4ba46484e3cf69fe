"""What Python memory grows with requests through a router: a router on loopback gRPC
services (tiny random model, `pld` and `suffix` drafters, all in this process), 8
streaming clients of random prompts, tracemalloc compared before and after
`--requests` requests (after a warm-up), the top growths by traceback
(docs/RELIABILITY.md, Soak: the router's resident memory grows in the soak).

    python experiments/router_memory_probe.py --requests 1500

With --rss, no tracemalloc: the process's resident size after every 500 requests, and
--drafters picks the requests' drafters (`pld none`: no suffix index, which grows by
design, in the pool):

    python experiments/router_memory_probe.py --rss --requests 5000 --drafters pld none
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import grpc  # noqa: E402
import psutil  # noqa: E402

from drafter_service.pool import DrafterPool  # noqa: E402
from loopback import loopback  # noqa: E402  (tests/loopback.py)
from protos import specserve_pb2 as pb  # noqa: E402
from protos import specserve_pb2_grpc as pb_grpc  # noqa: E402
from router.servicer import RouterConfig, RouterServicer  # noqa: E402
from router.servicer import serve as serve_router  # noqa: E402
from test_bench_load import CharTokenizer  # noqa: E402
from tiny import TINY, tiny_model  # noqa: E402
from verifier_service.engine import VerifierEngine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=400)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--rss", action="store_true", help="the resident size every 500 requests, no tracemalloc")
    parser.add_argument("--drafters", nargs="+", default=["pld", "suffix", "pld+suffix", ""],
                        help="what the requests name as their drafter, one at random each")
    args = parser.parse_args()
    target = tiny_model(0)
    kinds = sorted({k for d in args.drafters for k in d.split("+") if k and k != "none"} | {"pld"})
    pool, engine = DrafterPool(target, kinds=kinds), VerifierEngine(target, max_batch=4, max_len=64)
    config = RouterConfig(context_length=TINY.max_position_embeddings - 12, eos_token_ids=[],
                          vocab_size=TINY.vocab_size, default_drafter="pld", draft_length=3, adaptive=True)
    rng = random.Random(0)
    with loopback(pool, engine) as coordinator:
        server, port = serve_router(RouterServicer(CharTokenizer(), coordinator, config), "127.0.0.1", 0)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.SpecserveStub(channel)

            def ask(_: int) -> None:
                prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(3, 20)))
                req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=20),
                                         drafter=rng.choice(args.drafters))
                for _ in stub.GenerateStream(req):
                    pass

            def run(n: int) -> None:
                with ThreadPoolExecutor(8) as clients:
                    list(clients.map(ask, range(n)))

            if args.rss:
                process = psutil.Process()
                for done in range(500, args.requests + 1, 500):
                    run(500)
                    gc.collect()
                    print(f"{done} requests: {process.memory_info().rss / 1e6:.1f} MB", flush=True)
                server.stop(None)
                return
            run(args.warmup)
            gc.collect()
            tracemalloc.start(25)
            before = tracemalloc.take_snapshot()
            start = time.monotonic()
            run(args.requests)
            print(f"{args.requests} requests in {time.monotonic() - start:.0f} s")
            gc.collect()
            after = tracemalloc.take_snapshot()
        server.stop(None)
    for stat in after.compare_to(before, "traceback")[:args.top]:
        print(stat)
        for line in stat.traceback.format()[-8:]:
            print("   ", line)


if __name__ == "__main__":
    main()
