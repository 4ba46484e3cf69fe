"""One target forward by new tokens with specserve's 8-bit-activation products on AMX and off
it, alternated pass by pass in one process (docs/BENCHMARKS.md, AMX): the bench's `--micro`
measurement (`bench.harness.forward_ms`: 128 cached tokens, T new ones, median) for each
`--dtype`, AMX on and off in turn so that both see the same load of a shared machine.

    SPECSERVE_CPU_KERNELS=native python experiments/amx_forward_probe.py --dtype int4 int8

Medians and minimums (on a machine shared with other work the minimum is the least disturbed).
`--loop 17 20` instead runs passes of 17 new tokens for 20 s, AMX as SPECSERVE_AMX says, for a
profiler: `py-spy record --native -f raw -o pass.txt -- python experiments/amx_forward_probe.py
--dtype int4 --loop 17 20`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cluster.env import cpu_tuning_from_env
from cluster.local import set_cpu_threads
from runtime import cpu_kernels, loading
from runtime.model import attention_mask, causal_ancestors

SIZES = (1, 2, 4, 8, 16, 17, 32)


def forwards(model, repeats: int, prefix: int = 128) -> dict[bool, dict[int, list[float]]]:
    """The ms of each forward of T new tokens, AMX off and on, alternated."""
    cache = model.new_cache(prefix + max(SIZES) + 8)
    ids = torch.arange(prefix)[None] % model.config.vocab_size
    model(ids, torch.arange(prefix)[None], cache, attention_mask(0, causal_ancestors(prefix)))
    times = {False: {t: [] for t in SIZES}, True: {t: [] for t in SIZES}}
    for t in SIZES:
        positions, tokens = torch.arange(prefix, prefix + t)[None], torch.zeros(1, t, dtype=torch.long)
        mask = attention_mask(prefix, causal_ancestors(t))
        for i in range(2 * repeats + 2):
            on = bool(i % 2) != bool(i // 2 % 2)  # off on on off off on ...
            cpu_kernels.use_amx(on)
            cache.rollback(prefix)
            start = time.perf_counter()
            model(tokens, positions, cache, mask)[0, -1, 0].item()
            if i >= 2:  # the first of each: warm-up
                times[on][t].append(time.perf_counter() - start)
    cpu_kernels.use_amx(True)
    return {on: {t: [s * 1000 for s in v] for t, v in by.items()} for on, by in times.items()}


def loop(dtype: str, t: int, seconds: float, prefix: int = 128) -> None:
    model, _ = loading.load(dtype=dtype, cpu_tuning=cpu_tuning_from_env())
    cache = model.new_cache(prefix + t + 8)
    with torch.inference_mode():
        model(torch.arange(prefix)[None] % 1000, torch.arange(prefix)[None], cache,
              attention_mask(0, causal_ancestors(prefix)))
        positions, tokens = torch.arange(prefix, prefix + t)[None], torch.zeros(1, t, dtype=torch.long)
        mask, passes, end = attention_mask(prefix, causal_ancestors(t)), 0, time.time() + seconds
        while time.time() < end:
            cache.rollback(prefix)
            model(tokens, positions, cache, mask)[0, -1, 0].item()
            passes += 1
    print(f"{passes} passes of {t} new tokens, AMX {'on' if cpu_kernels.amx() else 'off'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["int4", "int8"], choices=["int4", "int8"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--loop", type=float, nargs=2, metavar=("TOKENS", "SECONDS"),
                        help="only run passes of TOKENS new tokens for SECONDS (for a profiler)")
    parser.add_argument("--threads", type=int, help="torch's and the products' threads (default: every core)")
    args = parser.parse_args()
    if args.threads:  # OMP_NUM_THREADS sets the products' (their own OpenMP runtime)
        torch.set_num_threads(args.threads)
    else:
        set_cpu_threads()
    if args.loop:
        loop(args.dtype[0], int(args.loop[0]), args.loop[1])
        return
    print("| dtype | AMX | stat | " + " | ".join(f"{t}" for t in SIZES) + " | 17 / 1 |")
    print("| --- | --- | --- |" + " ---: |" * (len(SIZES) + 1))
    for dtype in args.dtype:
        model, _ = loading.load(dtype=dtype, cpu_tuning=cpu_tuning_from_env())
        if not cpu_kernels.amx():
            raise SystemExit("AMX does not run here (no AMX-INT8, no permission, SPECSERVE_AMX=0 or torch's kernels)")
        with torch.inference_mode():
            ms = forwards(model, args.repeats)
        for stat, fn in (("median", statistics.median), ("min", min)):  # min: the least disturbed
            for on in (False, True):
                row = {t: fn(v) for t, v in ms[on].items()}
                print(f"| {dtype} | {'on' if on else 'off'} | {stat} | " + " | ".join(f"{row[t]:.2f}" for t in SIZES)
                      + f" | {row[17] / row[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
