"""What reading the KV cache through block tables costs a one-row pass: the same decode step
over a contiguous KVCache row and over a paged cache's blocks (gathered into a scratch per
layer, runtime/paged_kv.py), on the default model, at a few context lengths.

    python experiments/paged_gather_probe.py [--dtype float32] [--lengths 128 512 2048]
"""

from __future__ import annotations

import argparse
import time

import torch

from runtime import loading
from runtime.model import attention_mask, causal_ancestors
from runtime.paged_kv import BlockPool, SequenceBlocks


def step(model, cache, start: int) -> float:
    t0 = time.perf_counter()
    model(torch.tensor([[7]]), torch.tensor([[start]]), cache, attention_mask(start, causal_ancestors(1)))
    cache.rollback(start)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = loading.load(dtype=args.dtype)
    bs = args.block_size
    print(f"{args.dtype}, {torch.get_num_threads()} threads, block size {bs}")
    print("context  contiguous ms  paged ms  overhead")
    for n in args.lengths:
        tokens = torch.randint(100, 20000, (n,))
        contiguous = model.new_cache(n + 8)
        model(tokens[None], torch.arange(n)[None], contiguous, attention_mask(0, causal_ancestors(n)))
        blocks = -(-(n + 8) // bs)
        pool, store = BlockPool(blocks, bs), model.new_paged_cache(blocks, bs)
        seq = SequenceBlocks(pool)
        seq.reserve(n + 8)
        rows = store.rows([seq.blocks], [0])
        model(tokens[None], torch.arange(n)[None], rows, attention_mask(0, causal_ancestors(n)))
        times = ([], [])  # alternating, the least of each: the machine may be shared
        for _ in range(args.repeats):
            times[0].append(step(model, contiguous, n))
            times[1].append(step(model, rows, n))
        a, b = min(times[0]), min(times[1])
        print(f"{n:7d}  {a * 1e3:13.2f}  {b * 1e3:8.2f}  {100 * (b / a - 1):+7.1f}%")


if __name__ == "__main__":
    main()
