"""Which cache rows a verification pass verifies changes its time: `verify_batch` on the
default target, one torch thread, each row a root and a 5-token chain after 256 cached
tokens, on a cache the size of the served verifier's (8 rows of 4,352 slots) and on one
just big enough (docs/BENCHMARKS.md, Cluster simulator: the simulator's costs time
leading rows; the served verifier's requests sit on any row).

    python experiments/verify_rows_probe.py
"""

from __future__ import annotations

import statistics
import time

import torch

from runtime import loading
from speculative.batching import VerifyItem, verify_batch
from runtime.model import attention_mask, causal_ancestors
from speculative.sampling import SamplingParams
from speculative.tree import DraftTree

CONTEXT = 256
CASES = [("one row, cache of 1 row", 1, [0]), ("row 0, cache of 8 rows", 8, [0]), ("row 5, cache of 8 rows", 8, [5]),
         ("3 rows, cache of 3 rows", 3, [0, 1, 2]), ("rows 0-2, cache of 8 rows", 8, [0, 1, 2]),
         ("rows 1, 4, 6, cache of 8 rows", 8, [1, 4, 6])]


def pass_ms(model, batch: int, rows: list[int], repeats: int = 5) -> float:
    max_len = 4352 if batch == 8 else CONTEXT + 32
    cache = model.new_cache(max_len, batch=batch)
    ids = (torch.arange(CONTEXT) * 7 % 1000 + 100)[None].expand(batch, CONTEXT)
    with torch.inference_mode():
        model(ids, torch.arange(CONTEXT)[None].expand(batch, CONTEXT), cache,
              attention_mask(0, causal_ancestors(CONTEXT)).expand(batch, -1, -1))
    items = [VerifyItem(r, 42, DraftTree.chain([200, 211, 222, 233, 244]), SamplingParams(), torch.Generator())
             for r in rows]
    times = []
    for _ in range(repeats + 1):  # the first warms up
        start = time.perf_counter()
        with torch.inference_mode():
            verify_batch(model, cache, items)
        times.append(time.perf_counter() - start)
        for r in range(batch):
            cache.rollback(CONTEXT, row=r)
    return statistics.median(times[1:]) * 1000


def main() -> None:
    torch.set_num_threads(1)
    model, _ = loading.load(None)
    print("| rows verified | ms a pass |\n| --- | ---: |")
    for label, batch, rows in CASES:
        print(f"| {label} | {pass_ms(model, batch, rows):.1f} |", flush=True)


if __name__ == "__main__":
    main()
