"""The lossless contract and the low-precision kernels on a GPU, which the tests cannot
reach (CI has none). Runs on any device; `--device cpu` is a dry run of the script.

1. Kernels, at the default model's layer shapes: does each kind of linear layer (float32
   and bfloat16 `nn.Linear`, `Int8Linear`, `Int4Linear`) give a row the same result alone
   as among k rows? Greedy speculative output equals plain decoding bit for bit only where
   it does (or where no near-tie meets the difference). And int4's CUDA packing against
   the CPU's: the same weights must come out.
2. Models, per precision: each drafter's greedy output against plain decoding in that
   precision, and float32's against Hugging Face transformers on the same device (a
   difference allowed only at a near-tie of HF's top-two logits, as tests/oracle.py);
   seeded sampling against plain seeded sampling.

    python scripts/gpu_check.py --device cuda --out gpu_check.json
    python scripts/gpu_check.py --device cuda --tiny --out tiny.json   # a random model, no GGUF
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch import nn

from bench.harness import HFRunner, departure
from drafter_service.registry import make_drafter
from speculative.decoding import generate
from runtime.loading import load, load_hf_dir, parse_dtype
from runtime.quantize import Int4Linear, Int8Linear, quantize, quantize_int4
from speculative.sampling import SamplingParams

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


def tiny_model_dir(root: Path) -> Path:
    """A random Llama of the default model's layer widths, 4 layers, a small vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=1024,
                      tie_word_embeddings=True, rope_theta=100000.0)
    LlamaForCausalLM(cfg).save_pretrained(root)
    return root


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
            for mode, params in (("greedy", greedy), ("seeded", seeded)):
                r = generate(model, ids, params, None, eos_token_ids=eos)
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
                        r = generate(model, ids, params, make_drafter(name, model), 5, eos,
                                     pipelined=pipelined, tree_budget=tree)
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
        Path(args.out).write_text(json.dumps(report, indent=1))
        print_precision(precision, res)


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
    p.add_argument("--out", required=True)
    args = p.parse_args()
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__}
    if not args.skip_kernels:
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
        models(args, tiny_model_dir(Path(tmp)) if args.tiny else None, args.tiny, report)


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
