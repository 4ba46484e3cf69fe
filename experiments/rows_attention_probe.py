"""Batched verification passes with specserve's attention over cached rows against PyTorch's SDPA.

Loads the default target in `--dtype` as the bench does (CPU tuning on, every core; its
layers get `Attention.rows_attention` where specserve's kernels run), caches one row per
`--contexts` entry (by default the mix of prompt lengths the served load bench sends: a
few long summarisation and RAG prompts among short questions), and times a
`verify_batch` pass of one token a row, and of the same rows with one of them holding a
`--nodes`-token chain, each with specserve's attention and with SDPA (the layers'
`rows_attention` taken away), the four alternating within one run, median of `--repeats`.
SDPA pads every row's keys to the batch's longest context; specserve's reads each row's
own (docs/DESIGN-NOTES.md, CPU cost model).

    python experiments/rows_attention_probe.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from cluster.env import cpu_tuning_from_env
from cluster.local import set_cpu_threads
from runtime import loading
from speculative.batching import VerifyItem, verify_batch
from runtime.model import attention_mask, causal_ancestors
from speculative.sampling import SamplingParams
from speculative.tree import DraftTree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=loading.DTYPES)
    parser.add_argument("--contexts", type=int, nargs="+", default=[60, 80, 120, 200, 250, 700, 900, 1600],
                        help="cached tokens of each row")
    parser.add_argument("--nodes", type=int, default=5, help="draft tokens of the one drafted row")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    set_cpu_threads()
    model, _ = loading.load(dtype=args.dtype, cpu_tuning=cpu_tuning_from_env())  # SPECSERVE_CPU_KERNELS
    ours = [layer.attn.rows_attention for layer in model.layers]
    if ours[0] is None:
        raise SystemExit("specserve's attention is not installed here (SPECSERVE_CPU_KERNELS=torch, or no kernels)")
    contexts = args.contexts
    cache = model.new_cache(max(contexts) + args.nodes + 8, batch=len(contexts))
    with torch.inference_mode():
        for row, n in enumerate(contexts):
            view = cache.rows_view(row, row + 1)
            model(torch.arange(n)[None] * 7 % 1000 + 100, torch.arange(n)[None], view,
                  attention_mask(0, causal_ancestors(n)))
    chain = [int(t) for t in torch.arange(args.nodes) * 11 + 200]
    # SDPA reads caches in the attention dtype, as the model has them without specserve's
    # attention (float64 for the int models, whose caches specserve's reads in float32)
    caches = {"specserve": cache, "sdpa": copy.copy(cache)}
    dtype = model.attention_dtype or cache.k.dtype
    caches["sdpa"].k, caches["sdpa"].v = cache.k.to(dtype), cache.v.to(dtype)
    caches["sdpa"].lengths = list(cache.lengths)

    def one_pass(draft: list[int], attention) -> float:
        for layer, own in zip(model.layers, ours):
            layer.attn.rows_attention = own if attention == "specserve" else None
        items = [VerifyItem(row, 42, DraftTree.chain(draft if row == len(contexts) - 1 else []), SamplingParams(),
                            torch.Generator()) for row in range(len(contexts))]
        start = time.perf_counter()
        with torch.inference_mode():
            verify_batch(model, caches[attention], items)
        elapsed = time.perf_counter() - start
        for row, n in enumerate(contexts):
            caches[attention].rollback(n, row=row)
        return elapsed

    cases = {(what, attention): (draft, attention) for what, draft in (("one token a row", []),
                                                                      (f"one row {args.nodes} more", chain))
             for attention in ("specserve", "sdpa")}
    times: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    for i in range(args.repeats + 3):
        for case, (draft, attention) in cases.items():
            seconds = one_pass(draft, attention)
            if i >= 3:  # warm-up
                times[case].append(seconds)
    print(f"{args.dtype}, {len(contexts)} rows of {', '.join(map(str, contexts))} cached tokens "
          f"(medians of {args.repeats}, ms):")
    for what in dict.fromkeys(what for what, _ in cases):
        ms = {attention: statistics.median(times[(what, attention)]) * 1e3 for attention in ("specserve", "sdpa")}
        print(f"  {what}: specserve's attention {ms['specserve']:.1f}, SDPA {ms['sdpa']:.1f}")


if __name__ == "__main__":
    main()
