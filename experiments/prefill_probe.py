"""What a prompt's prefill costs by each path (docs/DESIGN-NOTES.md, "Long prefills").

Loads the default target in `--dtype` as the bench does (CPU tuning on, every core) and
prefills the chat prompts of the dev questions' `--categories`, each `--rounds` times by
three paths in alternation:

- before: attention with the causal mask built out, long passes' linear layers packed;
- is_causal: SDPA's is_causal instead of the mask (`runtime.model.CAUSAL_MIN_TOKENS`),
  checked to give the same logits bit for bit;
- tuned: is_causal and the long-pass path `apply_cpu_tuning` chose (BLAS where it won;
  the same as is_causal for the int modes, which have no packed layers: with
  specserve's own products their layers take passes of over 256 rows by BLAS themselves).

Prints the median ms per prompt; then, for the longest prompt, how far each path's
logits at its last DECODED positions are from those tokens decoded one at a time after
the rest (what a prefill has to match for a request prefilled again to continue alike).

    python experiments/prefill_probe.py --dtype int4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import runtime.model as model_module
from bench.questions import load_questions
from cluster.local import LocalEngine
from runtime import loading
from runtime.cpu_tuning import PackedLinear
from runtime.model import attention_mask, causal_ancestors

MASKED_ALWAYS = 1 << 30  # a CAUSAL_MIN_TOKENS no prompt reaches
DECODED = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=loading.DTYPES)
    parser.add_argument("--questions", default="../shared/data/spec_bench/dev.jsonl")
    parser.add_argument("--categories", nargs="+", default=["summarization", "rag", "qa"])
    parser.add_argument("--limit-per-category", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = LocalEngine.load(None, "cpu", args.dtype)
    model, causal_min = engine.model, model_module.CAUSAL_MIN_TOKENS
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    tuned_blas = bool(packed) and packed[0].long_rows_blas
    paths = {"before": (MASKED_ALWAYS, False), "is_causal": (causal_min, False), "tuned": (causal_min, tuned_blas)}

    def prefill(ids: list[int], path: str, scored: int = 1) -> tuple[torch.Tensor, float]:
        """The logits of the last `scored` positions, and the seconds the pass took."""
        model_module.CAUSAL_MIN_TOKENS, blas = paths[path]
        for m in packed:
            m.long_rows_blas = blas
        n = len(ids)
        cache = model.new_cache(n)
        start = time.perf_counter()
        logits = model(torch.tensor([ids]), torch.arange(n)[None], cache, attention_mask(0, causal_ancestors(n)),
                       logits_from=n - scored)
        return logits[0], time.perf_counter() - start

    def decoded(ids: list[int]) -> torch.Tensor:
        """The last DECODED tokens' logits, each token decoded alone after the ones before."""
        n = len(ids) - DECODED
        cache = model.new_cache(len(ids))
        model(torch.tensor([ids[:n]]), torch.arange(n)[None], cache, attention_mask(0, causal_ancestors(n)))
        return torch.cat([model(torch.tensor([[ids[j]]]), torch.tensor([[j]]), cache,
                                attention_mask(j, causal_ancestors(1)))[0] for j in range(n, len(ids))])

    tuned = "no packed layers" if not packed else "BLAS" if tuned_blas else "packed"
    print(f"{args.dtype}, long passes' linear layers as tuned: {tuned}")
    print(f"{'category':<14} {'tokens':>6} {'before ms':>10} {'is_causal':>10} {'tuned':>6} {'tuned max |dlogit|':>19}")
    longest: list[int] = []
    for q in load_questions(args.questions, args.limit_per_category):
        if q["category"] not in args.categories:
            continue
        ids = engine.prompt_ids(q["turns"][0], chat=True)
        longest = max(longest, ids, key=len)
        prefill(ids, "tuned")  # warm up
        times: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(args.rounds):
            logits = {}
            for path in paths:
                logits[path], seconds = prefill(ids, path)
                times[path].append(seconds)
            if not torch.equal(logits["before"], logits["is_causal"]):
                raise SystemExit(f"{q['category']}: is_causal's logits differ from the masked pass's")
        ms = {path: statistics.median(t) * 1e3 for path, t in times.items()}
        drift = (logits["tuned"] - logits["before"]).abs().max().item()
        print(f"{q['category']:<14} {len(ids):>6} {ms['before']:>10.1f} {ms['is_causal'] / ms['before']:>9.2f}x "
              f"{ms['tuned'] / ms['before']:>5.2f}x {drift:>19.1e}")
    alone = decoded(longest)
    for path in ("before", "tuned"):
        apart = (prefill(longest, path, DECODED)[0] - alone).abs().max().item()
        print(f"{path}: the last {DECODED} of {len(longest)} tokens prefilled against decoded one at a time, "
              f"max |dlogit| {apart:.1e}")
    model_module.CAUSAL_MIN_TOKENS = causal_min
    for m in packed:
        m.long_rows_blas = tuned_blas


if __name__ == "__main__":
    main()
