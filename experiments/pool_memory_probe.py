"""What grows in a drafter pool with requests: the pool of the default config, in this
process (the default target, its drafters `--kinds`), `--clients` threads each running
requests one after another, no verifier: a request is prefilled on a dev prompt, then
round after round drafts up to 5 tokens and is told the next 1-3 tokens of the
prompt's own text as the verified ones (so the pool learns from real text, as when
serving), for `--rounds` rounds, and released. The dev prompts are cycled as the soak
cycles them. The process's resident memory is printed every `--every` requests, and
tracemalloc compares Python's allocations after `--warmup` requests with those at the
end, the top growths by traceback (docs/RELIABILITY.md, Soak: the drafter pool). With
`--trim`, each report also asks glibc to hand its free memory back (`malloc_trim`) and
prints the resident size after: growth that a trim takes back was free memory the
allocator kept, not memory in use.

    python experiments/pool_memory_probe.py --requests 1200
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import random
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from cluster.actors import load_on_one_thread
from cluster.config import ServeConfig
from drafter_service.pool import DrafterPool
from speculative.sampling import SamplingParams

QUESTIONS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "spec_bench" / "dev.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=32)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--kinds", nargs="+", default=list(ServeConfig().drafter_pools.kinds))
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--questions", type=Path, default=QUESTIONS)
    parser.add_argument("--trim", action="store_true", help="malloc_trim at each report, and print the size after")
    args = parser.parse_args()
    libc = ctypes.CDLL("libc.so.6") if args.trim else None
    cfg = ServeConfig()
    model, tokenizer = load_on_one_thread(cfg)
    pool = DrafterPool(model, kinds=tuple(args.kinds))
    prompts = [tokenizer.encode_chat([{"role": "user", "content": json.loads(line)["turns"][0]}])
               for line in args.questions.read_text().splitlines() if line.strip()]
    order = itertools.cycle(range(len(prompts)))
    lock, done = threading.Lock(), [0]
    proc = psutil.Process()

    def one_request(i: int) -> None:
        with lock:
            text = prompts[next(order)]
        rng = random.Random(i)
        cut = max(1, len(text) // 2)
        context, rest = text[:cut], text[cut:]
        kind = args.kinds[i % len(args.kinds)]
        pool.prefill(f"r{i}", kind, context, SamplingParams())
        length, new = len(context), []
        for _ in range(args.rounds):
            if not rest:
                break
            if pool.propose(f"r{i}", length, new, max_tokens=5) is None:
                raise RuntimeError(f"request r{i} lost its drafting state")
            length += len(new)
            k = rng.randint(1, 3)
            new, rest = rest[:k], rest[k:]
        pool.release(f"r{i}")
        with lock:
            done[0] += 1
            if done[0] % args.every == 0:
                line = f"{done[0]} requests: {proc.memory_info().rss / 1e6:.0f} MB resident"
                if libc is not None:
                    libc.malloc_trim(0)
                    line += f", {proc.memory_info().rss / 1e6:.0f} MB after malloc_trim"
                print(line, flush=True)

    def run(first: int, n: int) -> None:
        with ThreadPoolExecutor(args.clients) as clients:
            list(clients.map(one_request, range(first, first + n)))

    start = time.monotonic()
    run(0, args.warmup)
    gc.collect()
    tracemalloc.start(25)
    before = tracemalloc.take_snapshot()
    run(args.warmup, args.requests)
    gc.collect()
    after = tracemalloc.take_snapshot()
    print(f"{args.warmup + args.requests} requests in {time.monotonic() - start:.0f} s, "
          f"{proc.memory_info().rss / 1e6:.0f} MB resident; Python allocations grown since request {args.warmup}:")
    for stat in after.compare_to(before, "traceback")[:args.top]:
        print(stat)
        for line in stat.traceback.format()[-6:]:
            print("   ", line)


if __name__ == "__main__":
    main()
