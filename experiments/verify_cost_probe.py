"""Measure the goodput model's three costs (router/adaptive.py) on this machine.

A verification pass of B rows, one holding a draft of `nodes` tokens, costs
1 + verify_row_cost x (B - 1) + verify_token_cost x nodes
+ verify_pad_cost x B x nodes one-row, one-token passes. This times
`speculative.batching.verify_batch` on the default target, every row after
`--context` cached tokens: one row with one token (the unit), one row with a
`--nodes`-token chain after it (gives verify_token_cost), `--rows` rows of one
token each (gives verify_row_cost), and the same rows with one of them holding
the chain (what the draft adds beyond its tokens gives verify_pad_cost).
Medians of `--repeats`, the four passes alternating within one run.
`--curve N` also times one row with a chain of 0 to N nodes, alternating: on a
CPU the cost is not linear in the nodes (the model's `verify_token_cost`
averages it).

    python experiments/verify_cost_probe.py --rows 8 --nodes 5
    python experiments/verify_cost_probe.py --rows 8 --nodes 5 --curve 15
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.harness import verify_pass_seconds
from cluster.local import LocalEngine, set_cpu_threads
from speculative.batching import VerifyItem
from runtime.model import attention_mask, causal_ancestors
from speculative.sampling import SamplingParams
from speculative.tree import DraftTree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--curve", type=int, default=0, help="also time one row with 0 to this many draft nodes")
    args = parser.parse_args()
    set_cpu_threads()
    m = LocalEngine.load().model
    rows, n = args.rows, args.context
    cache = m.new_cache(n + max(args.nodes, args.curve) + 8, batch=rows)
    ids = (torch.arange(n) * 7 % 1000 + 100)[None].expand(rows, n)
    with torch.inference_mode():
        m(ids, torch.arange(n)[None].expand(rows, n), cache, attention_mask(0, causal_ancestors(n)).expand(rows, -1, -1))
    chain = [int(t) for t in torch.arange(args.nodes) * 11 + 200]

    def one_pass(batch: int, draft: list[int]) -> float:
        items = [VerifyItem(row, 42, DraftTree.chain(draft if row == 0 else []), SamplingParams(), torch.Generator())
                 for row in range(batch)]
        return verify_pass_seconds(m, cache, items, n)

    cases = {"unit": (1, []), "alone": (1, chain), "rows": (rows, []), "draft": (rows, chain)}
    # the curve: one row with a chain of 1 to --curve nodes
    cases |= {nodes: (1, [int(t) for t in torch.arange(nodes) * 11 + 200]) for nodes in range(1, args.curve + 1)}
    times: dict[str | int, list[float]] = {name: [] for name in cases}
    for i in range(args.repeats + 3):
        for name, (batch, draft) in cases.items():
            t = one_pass(batch, draft)
            if i >= 3:  # warm-up
                times[name].append(t)
    unit, alone, full, drafted = (statistics.median(times[name]) for name in ("unit", "alone", "rows", "draft"))
    row_cost = (full / unit - 1) / (rows - 1)
    token_cost = (alone / unit - 1) / args.nodes
    pad_cost = ((drafted - full) / unit / args.nodes - token_cost) / rows
    print(f"one row, one token {unit * 1e3:.1f} ms; with a {args.nodes}-token draft {alone * 1e3:.1f} ms; "
          f"{rows} rows {full * 1e3:.1f} ms; with the draft in one of them {drafted * 1e3:.1f} ms "
          f"(medians of {args.repeats})")
    print(f"verify_row_cost {row_cost:.3f}  verify_token_cost {token_cost:.3f}  verify_pad_cost {pad_cost:.4f}")
    if args.curve:
        print(f"one row, a chain of N nodes, in one-row, one-token passes (medians of {args.repeats}):")
        print("  ".join(f"{nodes}: {statistics.median(times[nodes]) / unit:.2f}" for nodes in range(1, args.curve + 1)))


if __name__ == "__main__":
    main()
