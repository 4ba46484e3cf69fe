"""Where a target's pass spends its time (docs/BENCHMARKS.md).

Loads the default target in `--dtype` as the bench does (CPU tuning on, every core),
caches `--context` tokens, and times passes of `--tokens` new tokens, one by default
(median of `--rounds`), then
profiles 10 of them with torch.profiler and prints the operators by their own time, per
pass. With `--compile` it also times the same pass with each layer compiled by
`torch.compile`: what is left of the difference is eager PyTorch's cost per operator
(specserve runs eager; the compiled layers round differently). Not for prepacked float32
layers, whose packed operators the compiler does not take. specserve's own products
(runtime/cpu_kernels.py) are not torch operators: the profile leaves them out;
SPECSERVE_CPU_KERNELS=torch times torch's instead.

    python experiments/pass_profile.py --dtype int4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cluster.env import cpu_tuning_from_env
from cluster.local import set_cpu_threads
from runtime import loading
from runtime.cpu_tuning import NativeLinear, PackedLinear
from runtime.model import attention_mask, causal_ancestors

PROFILED = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=loading.DTYPES)
    parser.add_argument("--context", type=int, default=128, help="tokens cached before the timed passes")
    parser.add_argument("--tokens", type=int, default=1, help="new tokens a pass (a verification pass: several)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--rows", type=int, default=15, help="operators to list")
    parser.add_argument("--compile", action="store_true", help="also time the pass with compiled layers")
    args = parser.parse_args()
    set_cpu_threads()
    model, _ = loading.load(dtype=args.dtype, cpu_tuning=cpu_tuning_from_env())  # SPECSERVE_CPU_KERNELS
    ctx = args.context
    t = args.tokens
    cache = model.new_cache(ctx + t + 8)
    with torch.inference_mode():
        model(torch.arange(ctx)[None] % 1000 + 100, torch.arange(ctx)[None], cache,
              attention_mask(0, causal_ancestors(ctx)))
        tokens, positions = torch.arange(200, 200 + t)[None], torch.arange(ctx, ctx + t)[None]
        mask = attention_mask(ctx, causal_ancestors(t))

        def one_pass() -> None:
            model(tokens, positions, cache, mask)
            cache.lengths[0] = ctx

        def median_ms() -> float:
            for _ in range(3):  # warm up
                one_pass()
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                one_pass()
                times.append(time.perf_counter() - start)
            return statistics.median(times) * 1e3

        print(f"{args.dtype}: {t}-token pass after {ctx} cached tokens, {median_ms():.2f} ms "
              f"(median of {args.rounds}, {torch.get_num_threads()} torch threads)")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILED):
                one_pass()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events) / PROFILED / 1e3
        print(f"profiled: {total:.2f} ms of operators' own time a pass")
        print(f"{'operator':<52} {'ms a pass':>10} {'calls a pass':>13}")
        for e in events[:args.rows]:
            print(f"{e.key:<52} {e.self_cpu_time_total / PROFILED / 1e3:>10.2f} {e.count / PROFILED:>13.0f}")
        if args.compile and any(isinstance(m, (PackedLinear, NativeLinear)) for m in model.modules()):
            print("compiled layers: not measured, the compiler does not take prepacked layers")
        elif args.compile:
            for layer in model.layers:
                layer.forward = torch.compile(layer.forward, dynamic=True)
            print(f"compiled layers: {median_ms():.2f} ms a pass")


if __name__ == "__main__":
    main()
