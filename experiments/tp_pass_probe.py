"""Per-pass time and communication of a tensor-parallel target at 1..N ranks (docs/SERVING.md).

Each rank is a spawned process (gloo on the CPU, cores shared out among the ranks, CPU
tuning on). Rank 0 prefills a context, then times verification-sized passes (one row of
1 + `--tree` tokens, rolled back after each), the LM head alone over as many tokens (rank
0 runs it whole), and a prefill; the median of each, and the bytes each verification pass
moves (all-reduces and rank 0's broadcast of the call), are printed as JSON.

    python experiments/tp_pass_probe.py --ranks 1 3                   # the default model
    python experiments/tp_pass_probe.py --ranks 1 3 --dtype int4      # in a precision (--dtype)
    python experiments/tp_pass_probe.py --ranks 1 2 --heads 8 --kv-heads 4   # a random model of its size
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

from runtime import loading
from runtime.cpu_tuning import CpuTuning, apply_cpu_tuning
from runtime.model import Transformer, attention_mask, causal_ancestors
from runtime.tp import TensorParallelTarget, serve_rank
from verifier_service import tp_group


@dataclass(frozen=True)
class RandomLoader:
    """A random model of the default model's size with other head counts (for rank counts
    the default's 9 heads do not take)."""
    directory: str
    heads: int
    kv_heads: int

    def __call__(self, device: str) -> Transformer:
        cfg = loading.load_tokenizer(self.directory)[1]
        cfg = replace(cfg, num_heads=self.heads, num_kv_heads=self.kv_heads, head_dim=cfg.hidden_size // self.heads)
        torch.manual_seed(0)
        model = Transformer(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        return model.to(device).eval()


def passes(model, context: int, tree: int, repeats: int) -> dict:
    """Median seconds of a verification-sized pass and of a prefill of `context` tokens."""
    cache = model.new_cache(context + tree + 8)
    tokens = torch.randint(0, 1000, (1, context))

    def prefill() -> float:
        cache.rollback(0)
        start = time.perf_counter()
        model(tokens, torch.arange(context)[None], cache, attention_mask(0, causal_ancestors(context)),
              logits_from=context - 1)
        return time.perf_counter() - start

    def verify() -> float:
        n = 1 + tree
        start = time.perf_counter()
        model(torch.randint(0, 1000, (1, n)), torch.arange(context, context + n)[None], cache,
              attention_mask(context, causal_ancestors(n)))
        seconds = time.perf_counter() - start
        cache.rollback(context)
        return seconds

    def head() -> float:
        """The LM head and final norm alone, over a verification pass's tokens (rank 0's)."""
        plain = getattr(model, "model", model)
        x = torch.randn(1, 1 + tree, plain.config.hidden_size)
        start = time.perf_counter()
        with torch.inference_mode():
            plain.lm_head(plain.norm(x))
        return time.perf_counter() - start

    prefill_s = statistics.median(prefill() for _ in range(3))
    head_s = statistics.median(head() for _ in range(repeats))
    for _ in range(3):  # warm up
        verify()
    counts = tp_group.COUNTS
    counts.reset()
    verify_s = statistics.median(verify() for _ in range(repeats))
    per_pass = {"all_reduces": counts.all_reduces / repeats, "all_reduce_bytes": counts.all_reduce_bytes / repeats,
                "broadcast_bytes": counts.broadcast_bytes / repeats}
    return {"verify_pass_ms": round(verify_s * 1e3, 2), "head_ms": round(head_s * 1e3, 2),
            "prefill_ms": round(prefill_s * 1e3, 1), **per_pass}


def _rank(rank: int, world: int, store_dir: str, loader, args, out: str) -> None:
    threads = args.threads or tp_group.threads_per_rank(world)
    torch.set_num_threads(threads)
    tp_group.join_group(rank, world, store_dir, "cpu")
    try:
        model = tp_group.load_shard(loader, rank, world, "cpu", CpuTuning())
        if rank:
            serve_rank(model, tp_group.receive)
            return
        target = TensorParallelTarget(model, tp_group.send)
        result = passes(target, args.context, args.tree, args.repeats)
        target.stop()
        Path(out).write_text(json.dumps({"ranks": world, "dtype": args.dtype, "threads_per_rank": threads,
                                         **result}))
    finally:
        tp_group.leave_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--heads", type=int, default=None, help="a random model of the default's size with these heads")
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--tree", type=int, default=5, help="draft nodes of a verification pass")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch threads a rank (default: the cores shared out)")
    parser.add_argument("--dtype", default="float32", choices=list(loading.DTYPES),
                        help="the default model's precision (--heads: float32 only)")
    args = parser.parse_args()
    if args.heads is not None and args.dtype != "float32":
        parser.error("--heads runs a random float32 model: leave out --dtype")
    loader = tp_group.checkpoint_loader(None, args.dtype)
    if args.heads is not None:
        loader = RandomLoader(loader.directory, args.heads, args.kv_heads or args.heads)
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            store = Path(tmp) / "store"
            store.mkdir()
            out = Path(tmp) / "result.json"
            if world == 1:
                torch.set_num_threads(args.threads or tp_group.threads_per_rank(1))
                if args.heads is None:  # as one process loads it, in its precision
                    model, _ = loading.load(dtype=args.dtype)
                else:
                    model = loader("cpu")
                    apply_cpu_tuning(model, CpuTuning())
                result = {"ranks": 1, "dtype": args.dtype, "threads_per_rank": torch.get_num_threads(),
                          **passes(model, args.context, args.tree, args.repeats)}
            else:
                mp.spawn(_rank, args=(world, str(store), loader, args, str(out)), nprocs=world)
                result = json.loads(out.read_text())
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
