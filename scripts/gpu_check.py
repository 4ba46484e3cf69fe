"""The lossless contract and the low-precision kernels on a GPU, which the tests cannot
reach (CI has none). Runs on any device; `--device cpu` is a dry run of the script.

1. Kernels, at the default model's layer shapes: does each kind of linear layer (float32
   and bfloat16 `nn.Linear`, `Int8Linear`, `Int4Linear`) give a row the same result alone
   as among k rows? Greedy speculative output equals plain decoding bit for bit only where
   it does (or where no near-tie meets the difference). And int4's CUDA packing against
   the CPU's: the same weights must come out.
2. Static shapes and CUDA graphs (runtime/static_pass.py, runtime/graphs.py), per precision:
   every bucket's captured pass, replayed with two different requests' inputs, against the
   eager pass (the largest logit difference, whether the argmax agrees, whether bit-exact).
3. Models, per precision: each drafter's greedy output against plain decoding in that
   precision, and float32's against Hugging Face transformers on the same device (a
   difference allowed only at a near-tie of HF's top-two logits, as tests/oracle.py);
   seeded sampling against plain seeded sampling. With `--graphs`, every run's rounds (and
   model drafters' draft steps) through captured graphs, against plain eager decoding.
4. Speed (`--speed`): a random model of the default model's full shape (30 layers, its
   vocabulary), so no GGUF is needed: one pass's host and wall time eager and replayed, and
   tokens/s of HF `generate`, plain decoding eager and from graphs, and drafters from
   graphs, on the same GPU, each output against plain eager decoding.

    python scripts/gpu_check.py --device cuda --out gpu_check.json
    python scripts/gpu_check.py --device cuda --tiny --out tiny.json   # a random model, no GGUF
    python scripts/gpu_check.py --all --out-dir docs/lab/gpu-graphs    # everything, about 10 minutes
    python scripts/gpu_check.py --dry-run --out dry.json               # the same code on the CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not

from bench.hf import HFRunner, departure  # noqa: E402 (no gRPC: the GPU machine may lack its packages)
from drafter_service.registry import make_drafter  # noqa: E402
from runtime.graphs import SharedPasses, StaticPasses  # noqa: E402
from runtime.loading import load, load_hf_dir, parse_dtype  # noqa: E402
from runtime.model import attention_mask, causal_ancestors  # noqa: E402
from runtime.quantize import Int4Linear, Int8Linear, quantize, quantize_int4  # noqa: E402
from runtime.static_pass import Bucket  # noqa: E402
from speculative.decoding import generate  # noqa: E402
from speculative.sampling import SamplingParams  # noqa: E402

QUESTIONS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "spec_bench" / "dev.jsonl"
SHAPES = {"attn.qkv": (576, 960), "attn.o": (576, 576), "mlp.gate_up": (576, 3072), "mlp.down": (1536, 576),
          "lm_head": (576, 49152)}  # (in, out) of the default model's layers
ROWS = (2, 3, 4, 6, 8, 16, 32, 64)
DRAFTERS = ("pld", "suffix", "self-int4", "layerskip", "small-general", "pld+suffix")
NEAR_TIE = 1e-3
# (label, sampling, tree budget, pipelined): each drafter's runs of each prompt
VARIANTS = (("greedy", "greedy", None, False), ("greedy tree 12", "greedy", 12, False),
            ("greedy pipelined", "greedy", None, True), ("seeded", "seeded", None, False))


def row_invariance(layer: nn.Module, in_features: int, device: str, dtype: torch.dtype) -> dict:
    """Per row count k: the largest difference between a row's result among k rows and alone."""
    x = torch.randn(max(ROWS), in_features, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(max(ROWS))])
        return {k: float((layer(x[:k]).float() - alone[:k].float()).abs().max()) for k in ROWS}


def kernels(device: str) -> dict:
    out = {}
    gen = torch.Generator().manual_seed(1)
    for part, (fan_in, fan_out) in SHAPES.items():
        w = torch.randn(fan_out, fan_in, generator=gen) * fan_in ** -0.5

        def linear(dtype: torch.dtype) -> nn.Linear:
            layer = nn.Linear(fan_in, fan_out, bias=False, device=device, dtype=dtype)
            layer.weight.data = w.to(device, dtype)
            return layer

        kinds = {"float32": (linear(torch.float32), torch.float32), "bfloat16": (linear(torch.bfloat16), None),
                 "int8": (Int8Linear.quantized(linear(torch.float32), torch.bfloat16), torch.bfloat16)}
        if part != "lm_head":  # the head is int8 in both int modes
            q, d, m = quantize_int4(w, 32)
            packed = Int4Linear(q.to(device), d.to(device), m.to(device), torch.bfloat16)
            kinds["int4"] = (packed, torch.bfloat16)
            if device != "cpu":  # the device's packing against the weights d * q + m (its scales are bfloat16)
                exact = (q.float().reshape(fan_out, -1, 32) * d[..., None] + m[..., None]).reshape(fan_out, fan_in)
                dev = packed.dequantized().cpu()
                out[f"{part} int4 packing, max |device - d*q+m| weight"] = float((dev - exact).abs().max())
        for kind, (layer, dtype) in kinds.items():
            worst = row_invariance(layer, fan_in, device, dtype or torch.bfloat16)
            out[f"{part} {kind} row invariance"] = {str(k): v for k, v in worst.items() if v} or "exact"
    return out


DRY_RUN_SHAPE = dict(widths=(64, 128), heads=(4, 2))  # --dry-run's models: seconds on a busy CPU


def tiny_model_dir(root: Path, layers: int = 4, vocab: int = 2048, widths: tuple[int, int] = (576, 1536),
                   heads: tuple[int, int] = (9, 3), positions: int = 1024) -> Path:
    """A random Llama of the default model's layer widths, 4 layers, a small vocabulary (the
    speed check: 30 layers and its vocabulary, the default model's shape)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=widths[0], intermediate_size=widths[1], num_hidden_layers=layers,
                      num_attention_heads=heads[0], num_key_value_heads=heads[1], max_position_embeddings=positions,
                      tie_word_embeddings=True, rope_theta=100000.0)
    LlamaForCausalLM(cfg).save_pretrained(root)
    return root


def precision_model(source: Path, device: str, precision: str):
    model = load_hf_dir(source, device, parse_dtype(precision))
    return quantize(model, precision) if precision != "float32" else model


# ---- static shapes and CUDA graphs ---------------------------------------------


def random_pass(b: int, t: int, starts: list[int], vocab: int, gen: torch.Generator):
    """A pass of b rows of t tokens after `starts`: random tokens, each row a random tree (a
    node's parent among the nodes before it), its last rows sometimes shorter (padding)."""
    span = max(starts) + t
    tokens = torch.randint(vocab, (b, t), generator=gen)
    positions = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, span, dtype=torch.bool)
    real = [t if r == 0 else int(torch.randint(1, t + 1, (1,), generator=gen)) for r in range(b)]
    for r, (start, n) in enumerate(zip(starts, real)):
        parents = [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)]
        depth = []
        for j, p in enumerate(parents):
            depth.append(0 if p < 0 else depth[p] + 1)
            mask[r, j, :start] = True
            k = j
            while k >= 0:
                mask[r, j, start + k] = True
                k = parents[k]
        positions[r, :n] = start + torch.tensor(depth)
        for j in range(n, t):
            mask[r, j, start + j] = True
    return tokens, positions, mask, real


PAGED_BLOCK = 16  # slots a block of the paged caches the bucket check also runs over


def paged_views(model, rows: int, slots: int, gen: torch.Generator):
    """Two equal paged caches' views of `rows` rows of `slots` slots each, every row's blocks
    scattered over the pool in one random order (as a verifier's are after a while)."""
    per_row = -(-slots // PAGED_BLOCK)
    order = torch.randperm(rows * per_row, generator=gen).tolist()
    tables = [order[r * per_row:(r + 1) * per_row] for r in range(rows)]
    caches = [model.new_paged_cache(rows * per_row, PAGED_BLOCK) for _ in range(2)]
    return caches, [c.rows(tables, [0] * rows) for c in caches]


def check_buckets(model, device: str, buckets: list[Bucket], graphs: bool, seed: int = 3, paged: bool = False
                  ) -> dict:
    """Each bucket's static pass (captured and replayed where `graphs`) against the eager pass, on
    two requests' inputs each (the second replays the first's graph), over equal caches: a
    KVCache's rows, or (`paged`) a paged cache's scattered blocks, as the verifier holds them."""
    rows = max(b.rows for b in buckets)
    slots = max(b.span for b in buckets) + 1
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    if paged:
        (_, pool), (eager, ours) = paged_views(model, rows, slots, gen)
        static = StaticPasses(model, pool, graphs=graphs)
    else:
        eager, ours = model.new_cache(slots, batch=rows), model.new_cache(slots, batch=rows)
        static = StaticPasses(model, ours, graphs=graphs)
    out = {"checked": 0, "exact": 0, "max_diff": 0.0, "differ": [], "capture_s": 0.0, "errors": {}}
    for bucket in buckets:
        b, t, s = bucket.rows, bucket.tokens, bucket.span
        for trial in range(2):
            try:
                # starts so that the pass's span lands in this bucket's (above half of it)
                hi = s - t
                lo = max(0, min(hi, s // 2 - t + 1))
                starts = [int(torch.randint(lo, hi + 1, (1,), generator=gen)) for _ in range(b)]
                for cache in (eager, ours):
                    for r in range(b):
                        cache.lengths[r] = 0
                prefix = torch.randint(vocab, (b, max(starts)), generator=gen)
                for r, n in enumerate(starts):  # the same prefix in both caches, eagerly
                    if n:
                        for cache in (eager, ours):
                            model(prefix[r:r + 1, :n].to(device), torch.arange(n, device=device)[None],
                                  cache.row_view(r), attention_mask(0, causal_ancestors(n, device)))
                tokens, positions, mask, real = random_pass(b, t, starts, vocab, gen)
                want = model(tokens.to(device), positions.to(device), eager.rows_view(0, b), mask.to(device),
                             real=real)
                started = time.perf_counter()
                got = static(tokens, positions, mask, list(range(b)), real=real, view=ours if paged else None)
                if trial == 0:
                    out["capture_s"] += time.perf_counter() - started
                diff = float((got - want).abs().max())
                out["checked"] += 1
                out["exact"] += diff == 0
                out["max_diff"] = max(out["max_diff"], diff)
                if not torch.equal(got.argmax(-1), want.argmax(-1)):
                    out["differ"].append({"bucket": [b, t, s], "trial": trial, "max_diff": diff})
            except Exception:
                out["errors"][f"{b}x{t}x{s}"] = traceback.format_exc(limit=6)
                break
    out["captured"] = len(static.captured())
    out["replays"] = static.replays
    out["capture_s"] = round(out["capture_s"], 2)
    return out


def buckets_section(args, source: Path, report: dict) -> None:
    dims = ((1, 2), (1, 4), (128,)) if args.dry_run else ((1, 2, 4, 8), (1, 2, 4, 8, 16, 32), (128, 256, 512))
    buckets = [Bucket(b, t, s) for b in dims[0] for t in dims[1] for s in dims[2]]
    out = report["buckets"] = {}
    for precision in args.bucket_dtypes or args.dtypes:
        try:
            model = precision_model(source, args.device, precision)
            for paged in (False, True):  # the drafters' contiguous caches, the verifier's paged one
                out[precision + ("-paged" if paged else "")] = check_buckets(
                    model, args.device, buckets, graphs=args.device.startswith("cuda"), paged=paged)
        except Exception:
            out[precision] = {"error": traceback.format_exc(limit=6)}
    for precision, r in out.items():
        print(f"buckets {precision}: " + (r["error"].strip().splitlines()[-1] if "error" in r else
              f"{r['exact']}/{r['checked']} bit-exact, largest difference {r['max_diff']:.1e}, "
              f"argmax differs in {len(r['differ'])}, {r['captured']} graphs captured in {r['capture_s']} s, "
              f"{len(r['errors'])} errors"), flush=True)
        for key, tb in r.get("errors", {}).items():
            print(f"  error {key}: {tb.strip().splitlines()[-1]}")


# ---- speed ----------------------------------------------------------------------


def pass_times(model, static: StaticPasses | None, prefix: int = 128, sizes=(1, 4, 16), repeats: int = 20) -> dict:
    """Median host time (the call returning, before the GPU is done) and wall time (its logits
    read) of one pass of t tokens after `prefix` cached, eager or replayed."""
    device = model.device
    cache = static.cache if static is not None else model.new_cache(prefix + max(sizes) + 1)
    cache.rollback(0)
    ids = torch.arange(prefix, device=device)[None] % model.config.vocab_size
    model(ids, torch.arange(prefix, device=device)[None], cache, attention_mask(0, causal_ancestors(prefix, device)))
    out = {}
    for t in sizes:
        host, wall = [], []
        tokens = torch.zeros(1, t, dtype=torch.long)
        positions = torch.arange(prefix, prefix + t)[None]
        mask = attention_mask(prefix, causal_ancestors(t))
        for i in range(repeats + 2):  # the first two: capture and warm
            cache.rollback(prefix)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            if static is None:
                logits = model(tokens.to(device), positions.to(device), cache, mask.to(device))
            else:
                logits = static(tokens, positions, mask, [0])
            launched = time.perf_counter()
            logits[0, -1, 0].item()
            if i >= 2:
                host.append(launched - start)
                wall.append(time.perf_counter() - start)
        out[str(t)] = {"host_ms": round(statistics.median(host) * 1000, 3),
                       "wall_ms": round(statistics.median(wall) * 1000, 3)}
    return out


def speed(args, report: dict) -> None:
    """The default model's shape with random weights: passes, then tokens/s per mode."""
    full = not args.dry_run
    out = report["speed"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        source = (tiny_model_dir(Path(tmp), layers=30, vocab=49152, positions=2048) if full
                  else tiny_model_dir(Path(tmp), layers=2, positions=256, **DRY_RUN_SHAPE))
        hf = HFRunner(source, device=args.device)
        n_tokens = args.speed_tokens
        asked = [ids for _, ids in prompts(None, args.speed_prompts, True, Path(args.questions))]
        for precision in args.speed_dtypes:
            res = out[precision] = {}
            try:
                model = precision_model(source, args.device, precision)
                static = StaticPasses.for_requests(model, model.config.max_position_embeddings - 1)
                res["pass eager"] = pass_times(model, None)
                res["pass static"] = pass_times(model, static)
                res["graphs"] = static.graphs
                params = SamplingParams(max_tokens=n_tokens)
                runs = {}
                if precision == "float32":
                    runs["hf-ar"] = [hf.run(p, params, "hf-ar") for p in asked]
                shared = SharedPasses()
                runs["ar eager"] = [(r.token_ids, r.seconds) for r in
                                    (generate(model, p, params, None) for p in asked)]
                for mode in ["ar"] + list(args.speed_drafters):
                    if mode == "self-int4" and precision in ("int8", "int4"):
                        continue  # an int target has no int4 twin to make

                    def drafter():
                        return None if mode == "ar" else make_drafter(mode, model, cuda_graphs=static.graphs,
                                                                    shared_passes=shared)
                    try:  # a first short run captures the mode's first buckets
                        generate(model, asked[0], SamplingParams(max_tokens=8), drafter(), 5, static=static)
                        rows = []
                        for p in asked:
                            r = generate(model, p, params, drafter(), 5, static=static)
                            rows.append((r.token_ids, r.seconds))
                        runs[f"{mode} graphs" if static.graphs else f"{mode} static"] = rows
                    except Exception:
                        res.setdefault("errors", {})[mode] = traceback.format_exc(limit=8)
                plain = [tokens for tokens, _ in runs["ar eager"]]
                for mode, rows in runs.items():
                    tokens = sum(len(t) for t, _ in rows)
                    row = {"tokens/s": round(tokens / sum(s for _, s in rows), 1)}
                    same = [t[:len(p)] == p[:len(t)] if mode == "hf-ar" else t == p
                            for (t, _), p in zip(rows, plain)]
                    row["equal to ar eager"] = f"{sum(same)}/{len(same)}"
                    res[mode] = row
                base = res.get("hf-ar", {}).get("tokens/s")
                if base:
                    for mode in res:
                        if isinstance(res[mode], dict) and "tokens/s" in res[mode]:
                            res[mode]["vs hf-ar"] = round(res[mode]["tokens/s"] / base, 2)
                res["captured"] = len(static.captured())
                del model, static, shared
            except Exception:
                res["error"] = traceback.format_exc(limit=8)
            print(f"speed {precision}: {json.dumps(res)}", flush=True)


def prompts(tokenizer, n: int, tiny: bool, questions: Path) -> list[tuple[str, list[int]]]:
    if tiny:  # repeated random phrases: something for the lookup drafters to find
        gen = torch.Generator().manual_seed(2)
        return [(f"random {i}", (torch.randint(3, 2048, (12,), generator=gen).repeat(4)).tolist()) for i in range(n)]
    seen, out = set(), []
    for line in questions.read_text().splitlines():
        q = json.loads(line)
        if q["category"] not in seen:
            seen.add(q["category"])
            out.append((q["category"], tokenizer.encode_chat([{"role": "user", "content": q["turns"][0]}])))
    return out[:n]


def compare(got: list[int], want: list[int]) -> dict:
    if got == want:
        return {"equal": True}
    pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return {"equal": False, "first_difference": pos, "lengths": [len(got), len(want)]}


def against_hf(hf: HFRunner, ids: list[int], got: list[int], max_tokens: int) -> dict:
    """Plain decoding's greedy tokens against HF's on the same device; where they part, HF's
    top-two logit gap there (a near-tie allows it, as tests/oracle.py)."""
    want, _ = hf.run(ids, SamplingParams(max_tokens=max_tokens), "hf-ar")
    got = got[:len(want)]  # HF stops at its config's end token, which a random model's run does not
    if got == want:
        return {"equal": True}
    row = {"equal": False, **departure(hf, ids, got, want)}
    row["near_tie"] = row["hf_top2_gap"] is not None and row["hf_top2_gap"] <= NEAR_TIE
    return row


def models(args, source: Path | None, tiny: bool, report: dict) -> None:
    """Fills report["models"], written out and summarised after each precision."""
    from runtime.loading import resolve_source

    hf = None  # Hugging Face on the device, loaded for the first float32 prompt
    out = report["models"] = {}
    for precision in args.dtypes:
        res = out[precision] = {}
        try:
            started = time.perf_counter()
            if tiny:
                model, tokenizer = load_hf_dir(source, args.device, parse_dtype(precision)), None
                if precision != "float32":
                    quantize(model, precision)
                eos = []
            else:
                model, tokenizer = load(args.model, args.device, precision)
                eos = tokenizer.eos_token_ids or model.config.eos_token_ids
            res["load_s"] = round(time.perf_counter() - started, 2)
        except Exception:
            res["load_error"] = traceback.format_exc(limit=4)
            continue
        for label, ids in prompts(tokenizer, args.prompts, tiny, Path(args.questions)):
            greedy = SamplingParams(max_tokens=args.max_tokens)
            seeded = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=7)
            plain = {}
            static = StaticPasses.for_requests(model, len(ids) + args.max_tokens + 64) if args.graphs else None
            shared = SharedPasses() if args.graphs else None
            for mode, params in (("greedy", greedy), ("seeded", seeded)):
                r = generate(model, ids, params, None, eos_token_ids=eos)
                if static is not None:  # plain decoding through the graphs, against it eager
                    g = generate(model, ids, params, None, eos_token_ids=eos, static=static)
                    tally = res.setdefault(f"ar graphs {mode}", {"equal": 0, "of": 0, "differences": {},
                                                                 "tokens_per_pass": []})
                    tally["equal"] += g.token_ids == r.token_ids
                    tally["of"] += 1
                    tally["tokens_per_pass"].append(1.0)
                    if g.token_ids != r.token_ids:
                        tally["differences"][label] = compare(g.token_ids, r.token_ids)
                plain[mode] = r.token_ids
                if mode == "greedy":
                    res.setdefault("ar tokens/s", []).append(len(r.token_ids) / r.seconds)
            if precision == "float32":
                try:
                    hf = hf or HFRunner(source if tiny else resolve_source(args.model), device=args.device)
                    res.setdefault("ar vs hf", {})[label] = against_hf(hf, ids, plain["greedy"], args.max_tokens)
                except Exception:
                    res["hf_error"] = traceback.format_exc(limit=4)
            for name in args.drafters:
                if (tiny and name == "small-general") or (name == "self-int4" and precision in ("int8", "int4")):
                    continue  # no checkpoint on a random model; an int target has no int4 twin to make
                for key, mode, tree, pipelined in VARIANTS:
                    key = f"{name} {key}"
                    params = greedy if mode == "greedy" else seeded
                    try:
                        d = make_drafter(name, model, cuda_graphs=bool(args.graphs), shared_passes=shared)
                        r = generate(model, ids, params, d, 5, eos, pipelined=pipelined, tree_budget=tree,
                                     static=static)
                    except Exception:
                        res.setdefault("errors", {})[key] = traceback.format_exc(limit=6)
                        break
                    row = compare(r.token_ids, plain[mode])
                    tally = res.setdefault(key, {"equal": 0, "of": 0, "differences": {}, "tokens_per_pass": []})
                    tally["equal"] += row["equal"]
                    tally["of"] += 1
                    tally["tokens_per_pass"].append(round(r.mean_accepted_tokens, 2))
                    if not row["equal"]:
                        tally["differences"][label] = row
        res["ar tokens/s"] = round(sorted(res["ar tokens/s"])[len(res["ar tokens/s"]) // 2], 1)
        del model
        write(args, report)
        print_precision(precision, res)


def write(args, report: dict) -> None:
    Path(args.out).write_text(json.dumps(report, indent=1))


def bench(args, out_dir: Path, budget_s: float, report: dict) -> None:
    """`specserve bench` on the shipped model (as docs/BENCHMARKS.md's H200 runs), graphs on then
    off, where the GGUF and the dev questions are on this machine; else says why not."""
    from runtime.loading import resolve_source

    try:
        source = resolve_source(args.model)
    except Exception as exc:
        report["bench"] = f"not run: no model ({exc})"
        return
    if not Path(args.questions).exists():
        report["bench"] = f"not run: no questions at {args.questions}"
        return
    report["bench"] = {}
    runs = (("graphs", ["hf-ar", "ar", "pld", "suffix", "pld+suffix+recycle", "self-int4", "small-general"], "on"),
            ("eager", ["ar", "pld"], "off"))
    for name, modes, graphs in runs:
        cmd = [sys.executable, "-m", "commands.cli", "bench", "--device", args.device, "--questions", args.questions,
               "--limit-per-category", "2", "--max-tokens", "128", "--modes", *modes, "--micro", "--cuda-graphs",
               graphs, "--out", str(out_dir / f"bench-{name}.json")] + (["--model", args.model] if args.model else [])
        started = time.perf_counter()
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=max(budget_s / len(runs), 30),
                                 cwd=Path(__file__).resolve().parents[1])
            report["bench"][name] = {"rc": run.returncode, "seconds": round(time.perf_counter() - started, 1),
                                     "tail": run.stdout[-3000:] + run.stderr[-3000:]}
        except subprocess.TimeoutExpired:
            report["bench"][name] = {"rc": "timeout", "seconds": round(time.perf_counter() - started, 1)}
        print(f"bench {name}: {report['bench'][name].get('rc')}", flush=True)


def summary(report: dict) -> str:
    """report.md: what each part found, in a few lines each."""
    lines = [f"# gpu_check: {report['device']}, torch {report['torch']}", ""]
    for name, v in report.get("kernels", {}).items():
        lines.append(f"- kernel {name}: " + (f"up to {max(v.values()):.1e} apart" if isinstance(v, dict) else str(v)))
    for precision, r in report.get("buckets", {}).items():
        lines.append(f"- buckets {precision}: " + (r["error"].strip().splitlines()[-1] if "error" in r else
                     f"{r['exact']}/{r['checked']} bit-exact, largest {r['max_diff']:.1e}, argmax differs "
                     f"{len(r['differ'])}, {r['captured']} captured in {r['capture_s']} s, errors {list(r['errors'])}"))
    for precision, res in report.get("models", {}).items():
        for key, v in res.items():
            if isinstance(v, dict) and "of" in v:
                lines.append(f"- {precision} {key}: {v['equal']}/{v['of']} equal to plain")
            elif key == "ar vs hf":
                lines.append(f"- {precision} ar vs HF: {sum(r['equal'] for r in v.values())}/{len(v)} equal")
            elif key in ("load_error", "hf_error", "errors"):
                lines.append(f"- {precision} {key}: {str(v)[-300:]}")
    for precision, res in report.get("speed", {}).items():
        lines.append(f"- speed {precision}: {json.dumps(res)}")
    bench_runs = report.get("bench")
    if bench_runs is not None:
        lines.append(f"- bench: {json.dumps(bench_runs)[:2000]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default=None, help="default: the shipped GGUF")
    p.add_argument("--tiny", action="store_true", help="a random model of the default model's widths instead")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8", "int4"])
    p.add_argument("--drafters", nargs="+", default=list(DRAFTERS))
    p.add_argument("--questions", default=str(QUESTIONS), help="Spec-Bench JSONL (default ../shared's dev set)")
    p.add_argument("--prompts", type=int, default=13, help="one dev question per category, at most 13")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-models", action="store_true")
    p.add_argument("--buckets", action="store_true", help="every bucket's static pass against the eager pass")
    p.add_argument("--bucket-dtypes", nargs="+", default=None, help="the buckets' precisions (default: --dtypes)")
    p.add_argument("--graphs", action="store_true", help="the models' runs through static passes (graphs on CUDA)")
    p.add_argument("--speed", action="store_true", help="the speed check on a random full-size model")
    p.add_argument("--speed-dtypes", nargs="+", default=["float32", "bfloat16", "int4"])
    p.add_argument("--speed-drafters", nargs="+", default=["pld", "suffix", "layerskip", "self-int4"])
    p.add_argument("--speed-prompts", type=int, default=3)
    p.add_argument("--speed-tokens", type=int, default=128)
    p.add_argument("--all", action="store_true", help="kernels, buckets, the tiny model's runs through graphs, "
                   "speed, then `specserve bench` where the model and questions are here; needs --out-dir")
    p.add_argument("--budget-s", type=float, default=570, help="with --all: stop starting parts after this")
    p.add_argument("--dry-run", action="store_true", help="on the CPU, small: the code paths a GPU run takes")
    p.add_argument("--out", default=None)
    p.add_argument("--out-dir", default=None, help="with --all: check.json, report.md and the bench's files")
    args = p.parse_args()
    started = time.perf_counter()
    if args.dry_run:  # every part, as small as it goes, on the CPU
        args.device, args.tiny, args.buckets, args.graphs, args.speed = "cpu", True, True, True, True
        args.dtypes, args.bucket_dtypes, args.prompts, args.max_tokens = ["float32"], ["float32", "int4"], 1, 8
        args.drafters = ["pld", "layerskip"]
        args.speed_dtypes, args.speed_drafters, args.speed_prompts, args.speed_tokens = ["float32"], ["pld"], 1, 8
    if args.all:
        if not args.out_dir:
            p.error("--all needs --out-dir")
        args.tiny, args.buckets, args.graphs, args.speed = True, True, True, True
        args.prompts, args.max_tokens = 2, 48
    out_dir = Path(args.out_dir) if args.out_dir else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        args.out = args.out or str(out_dir / "check.json")
    if not args.out:
        p.error("--out or --out-dir")
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__}
    if not args.skip_kernels and not args.dry_run:
        try:
            report["kernels"] = kernels(args.device)
        except Exception:
            report["kernels_error"] = traceback.format_exc()
    print(report["device"], "torch", report["torch"])
    for name, v in report.get("kernels", {}).items():  # a row-invariance dict: its largest difference
        print(f"  {name}: " + (f"up to {max(v.values()):.1e} apart" if isinstance(v, dict) else str(v)))
    if "kernels_error" in report:
        print(report["kernels_error"])
    with tempfile.TemporaryDirectory() as tmp:
        shape = DRY_RUN_SHAPE if args.dry_run else {}
        source = tiny_model_dir(Path(tmp), **shape) if args.tiny else None
        if args.buckets:
            buckets_section(args, source or tiny_model_dir(Path(tmp) / "b", **shape), report)
            write(args, report)
        if not args.skip_models:
            models(args, source, args.tiny, report)
    if args.speed and time.perf_counter() - started < args.budget_s:
        speed(args, report)
        write(args, report)
    if args.all and time.perf_counter() - started < args.budget_s:
        bench(args, out_dir, args.budget_s - (time.perf_counter() - started), report)
    report["seconds"] = round(time.perf_counter() - started, 1)
    write(args, report)
    if out_dir is not None:
        (out_dir / "report.md").write_text(summary(report))


def print_precision(precision: str, res: dict) -> None:
    print(f"{precision}: load {res.get('load_s')} s, plain decoding {res.get('ar tokens/s')} tokens/s", flush=True)
    for key, v in res.items():
        if key == "ar vs hf":
            same = sum(r["equal"] for r in v.values())
            ties = sum(r.get("near_tie", False) for r in v.values())
            print(f"  ar vs HF: {same}/{len(v)} equal, {ties} more differ at a near-tie; "
                  f"{ {k: r for k, r in v.items() if not r['equal']} }")
        elif isinstance(v, dict) and "of" in v:
            mean = sum(v["tokens_per_pass"]) / max(len(v["tokens_per_pass"]), 1)
            print(f"  {key}: {v['equal']}/{v['of']} equal to plain, {mean:.2f} tokens a pass"
                  + (f", differ: {v['differences']}" if v["differences"] else ""))
    for key in ("load_error", "hf_error"):
        if key in res:
            print(f"  {key}: {res[key]}")
    for key, tb in res.get("errors", {}).items():
        print(f"  error {key}: {tb.strip().splitlines()[-1]}")


if __name__ == "__main__":
    main()
