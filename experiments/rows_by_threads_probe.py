"""One target forward by new tokens at a given thread count, to tell what bounds a wide pass:
with one thread there is no fork/join, so a 17-row pass that costs more than one row by a larger
ratio at one thread than at two is bound by the products' arithmetic, not by the threads' join
(docs/lab/cpu-generations.md). Run once per thread count, the products' OpenMP threads set alike:

    OMP_NUM_THREADS=1 SPECSERVE_CPU_KERNELS=native python experiments/rows_by_threads_probe.py --threads 1 --dtype int4
    OMP_NUM_THREADS=2 SPECSERVE_CPU_KERNELS=native python experiments/rows_by_threads_probe.py --threads 2 --dtype int4

Medians and minimums of 12 passes after 2 warm-ups, 128 cached tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cluster.env import cpu_tuning_from_env
from runtime import loading
from runtime.model import attention_mask, causal_ancestors

SIZES = (1, 2, 6, 17)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, required=True, help="torch's threads (set OMP_NUM_THREADS alike)")
    parser.add_argument("--dtype", default="int4", choices=["float32", "bfloat16", "int8", "int4"])
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = loading.load(dtype=args.dtype, cpu_tuning=cpu_tuning_from_env())
    prefix = 128
    cache = model.new_cache(prefix + max(SIZES) + 8)
    ms: dict[int, list[float]] = {}
    with torch.inference_mode():
        model(torch.arange(prefix)[None] % 1000, torch.arange(prefix)[None], cache,
              attention_mask(0, causal_ancestors(prefix)))
        for t in SIZES:
            positions, tokens = torch.arange(prefix, prefix + t)[None], torch.zeros(1, t, dtype=torch.long)
            mask = attention_mask(prefix, causal_ancestors(t))
            ms[t] = []
            for i in range(args.repeats + 2):
                cache.rollback(prefix)
                start = time.perf_counter()
                model(tokens, positions, cache, mask)[0, -1, 0].item()
                if i >= 2:
                    ms[t].append((time.perf_counter() - start) * 1000)
    median = {t: statistics.median(v) for t, v in ms.items()}
    print(f"| {args.dtype} | {args.threads} | " + " | ".join(f"{median[t]:.1f} ({min(ms[t]):.1f})" for t in SIZES)
          + f" | {median[17] / median[1]:.2f} |")


if __name__ == "__main__":
    main()
