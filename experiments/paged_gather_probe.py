"""What reading the KV cache through block tables costs a one-row pass, on the default model,
at a few context lengths: the same decode step over a contiguous KVCache row and over a paged
cache's blocks (runtime/paged_kv.py): the whole pass, one layer's attention alone (where
specserve's kernels read the blocks through a slot map; SDPA's path gathers them), and the
plan a forward makes once (its slot maps and indices). Each side alternates with the other
and the least time of each is kept: the machine may be shared.

    python experiments/paged_gather_probe.py [--dtype float32] [--lengths 128 512 2048] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from runtime import loading
from runtime.model import additive_mask, attention_mask, causal_ancestors
from runtime.paged_kv import BlockPool, SequenceBlocks


def least(calls, repeats: int) -> list[float]:
    """The least seconds of each call, the calls alternating."""
    times = [[] for _ in calls]
    for _ in range(repeats):
        for call, spent in zip(calls, times):
            start = time.perf_counter()
            call()
            spent.append(time.perf_counter() - start)
    return [min(spent) for spent in times]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--repeats", type=int, default=20, help="passes of each side (a layer alone: 10x)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    model, _ = loading.load(dtype=args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    bs, cfg, attn = args.block_size, model.config, model.layers[0].attn
    print(f"{args.dtype}, {torch.get_num_threads()} torch threads, block size {bs}, attention by "
          f"{'specserve kernels' if attn.rows_attention or attn.fused_attention else 'SDPA'}\n")
    print("| context | pass, contiguous ms | pass, paged ms | a layer's attention, contiguous us | paged us | "
          "plan us |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in args.lengths:
        tokens = torch.randint(100, 20000, (n,))
        contiguous = model.new_cache(n + 8)
        model(tokens[None], torch.arange(n)[None], contiguous, attention_mask(0, causal_ancestors(n)))
        blocks = -(-(n + 8) // bs)
        pool, store = BlockPool(blocks, bs), model.new_paged_cache(blocks, bs)
        seq = SequenceBlocks(pool)
        seq.reserve(n + 8)
        model(tokens[None], torch.arange(n)[None], store.rows([seq.blocks], [0]), attention_mask(0, causal_ancestors(n)))
        step = (torch.tensor([[7]]), torch.tensor([[n]]))

        def contiguous_pass():
            model(*step, contiguous, attention_mask(n, causal_ancestors(1)))
            contiguous.rollback(n)

        def paged_pass():
            model(*step, store.rows([seq.blocks], [n]), attention_mask(n, causal_ancestors(1)))

        a, b = least([contiguous_pass, paged_pass], args.repeats)
        x = torch.randn(1, 1, cfg.hidden_size, dtype=model.dtype)
        cos, sin = (table[step[1]].unsqueeze(1).to(model.dtype) for table in (model.rope_cos, model.rope_sin))
        mask = additive_mask(attention_mask(n, causal_ancestors(1)), model.attention_dtype or contiguous.k.dtype)[:, None]
        rows = store.rows([seq.blocks], [n])
        with torch.inference_mode():
            layer_a, layer_b, plan = least([lambda: attn(x, cos, sin, contiguous.k[0], contiguous.v[0], [n], mask),
                                            lambda: attn(x, cos, sin, *rows.layer(0), [n], mask),
                                            lambda: store.rows([seq.blocks], [n]).plan([n], 1)], 10 * args.repeats)
        print(f"| {n} | {a * 1e3:.1f} | {b * 1e3:.1f} | {layer_a * 1e6:.0f} | {layer_b * 1e6:.0f} | {plan * 1e6:.0f} |")


if __name__ == "__main__":
    main()
