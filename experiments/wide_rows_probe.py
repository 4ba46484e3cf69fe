"""When one row of a batched verification pass is wide: split attention or pad it.

Times `speculative.batching.verify_batch` on the default target with 8 rows of
about 400 cached tokens, every row verifying one token except the first
`--wide-rows`, which verify a chain of `--width` tokens (root included). The
pass runs with `Attention._few_wide_rows` forced (model.WIDE_ROWS_SHARE 1:
however many rows are wide) and forbidden (every row's queries padded to the widest), the two alternating
within one run, and prints the median of each (docs/DESIGN-NOTES.md).

    python experiments/wide_rows_probe.py --width 6 --wide-rows 1
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.harness import verify_pass_seconds
from cluster.local import LocalEngine, set_cpu_threads
from runtime import model as model_module
from speculative.batching import VerifyItem
from runtime.cpu_tuning import PAD_ROWS_TO
from runtime.model import attention_mask, causal_ancestors
from speculative.sampling import SamplingParams
from speculative.tree import DraftTree

ROWS, PREFIX = 8, 400


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=6, help="tokens a wide row verifies, root included")
    parser.add_argument("--wide-rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    set_cpu_threads()
    m = LocalEngine.load().model
    cache = m.new_cache(PREFIX + args.width + PAD_ROWS_TO, batch=ROWS)
    ids = (torch.arange(PREFIX) * 7 % 1000 + 100)[None].expand(ROWS, PREFIX)
    with torch.inference_mode():
        m(ids, torch.arange(PREFIX)[None].expand(ROWS, PREFIX), cache,
          attention_mask(0, causal_ancestors(PREFIX)).expand(ROWS, -1, -1))
    chain = [int(t) for t in torch.arange(args.width - 1) * 11 + 200]
    greedy = SamplingParams()

    def one_pass(share: int) -> float:
        model_module.WIDE_ROWS_SHARE = share
        items = [VerifyItem(row, 42, DraftTree.chain(chain if row < args.wide_rows else []), greedy,
                            torch.Generator()) for row in range(ROWS)]
        return verify_pass_seconds(m, cache, items, PREFIX) * 1000

    split, padded = [], []
    for _ in range(3):  # warm-up
        one_pass(1), one_pass(10 ** 6)
    for _ in range(args.repeats):
        split.append(one_pass(1))
        padded.append(one_pass(10 ** 6))
    print(f"{args.wide_rows} of {ROWS} rows {args.width} wide: split attention {statistics.median(split):.1f} ms, "
          f"padded {statistics.median(padded):.1f} ms (median of {args.repeats})")


if __name__ == "__main__":
    main()
