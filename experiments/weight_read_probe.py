"""How much of a one-token pass is reading the weights (docs/BENCHMARKS.md, Float32).

Loads the default target as the bench does (float32, CPU tuning on, every core), then
alternates, `--rounds` times: one forward of one new token after `--context` cached
tokens, and every linear layer of the model (the LM head included) multiplying one
row, one after another, by BLAS and by the prepacked path (which is faster depends
on the CPU). Prints the median of each, the weight bytes, and the rate each reads
them at: the faster of the two is the floor a one-token pass cannot go under while
it reads float32 weights; the rest of the pass is attention, norms and the other
small operations.

    python experiments/weight_read_probe.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from cluster.local import set_cpu_threads
from runtime import loading
from runtime.cpu_tuning import PackedLinear
from runtime.model import attention_mask, causal_ancestors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=128, help="tokens cached before the timed pass")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    set_cpu_threads()
    model, _ = loading.load()
    layers = [m for m in model.modules() if isinstance(m, (PackedLinear, torch.nn.Linear))]
    weights = [m.weight for m in layers]
    mb = sum(w.numel() * w.element_size() for w in weights) / 1e6
    cache = model.new_cache(args.context + 8)
    ctx = args.context
    with torch.inference_mode():
        model(torch.arange(ctx)[None] % 1000 + 100, torch.arange(ctx)[None], cache,
              attention_mask(0, causal_ancestors(ctx)))
        token, position, mask = torch.tensor([[200]]), torch.tensor([[ctx]]), attention_mask(ctx, causal_ancestors(1))
        rows = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}

        def forward() -> None:
            model(token, position, cache, mask)
            cache.lengths[0] = ctx

        def by_blas() -> None:
            for w in weights:
                F.linear(rows[w.shape[1]], w)

        def packed() -> None:
            for m in layers:
                m._packed(rows[m.in_features])

        paths = [("forward", "one-token forward", forward), ("blas", "linear layers alone, one row by BLAS", by_blas)]
        if all(isinstance(m, PackedLinear) for m in layers):
            paths.append(("packed", "linear layers alone, one row packed", packed))
        times: dict[str, list[float]] = {name: [] for name, _, _ in paths}
        for i in range(args.rounds + 2):  # the first two warm up
            for name, _, fn in paths:
                start = time.perf_counter()
                fn()
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
    print(f"{len(weights)} linear layers, {mb:.0f} MB of weights, {torch.get_num_threads()} torch threads")
    for name, label, _ in paths:
        ms = statistics.median(times[name]) * 1000
        print(f"{label}: {ms:.1f} ms, {mb / ms:.1f} GB/s of weights")


if __name__ == "__main__":
    main()
