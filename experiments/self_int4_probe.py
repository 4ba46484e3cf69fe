"""How well the `self-int4` drafter (the target with int4 weights) guesses the target, and
what its drafting costs: the default target decodes dev prompts greedily in float32; the
int4 twin (drafter_service.registry, as a pool builds it) scores each output teacher-forced,
and where its next token equals the target's, a draft goes on. From that, the tokens a
target pass would verify with k-token drafts (greedy, the twin's drafts being what it
predicts on the verified text). Then one token's forward and a prompt's, float32 against
int4, on 1 and 2 torch threads (docs/DRAFTERS.md, self-int4).

    python experiments/self_int4_probe.py --per-category 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from drafter_service.registry import SELF_INT4, make_drafter
from speculative.decoding import generate
from runtime.loading import load
from runtime.model import attention_mask, causal_ancestors
from speculative.sampling import SamplingParams

QUESTIONS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "spec_bench" / "dev.jsonl"


def next_tokens(model, ids: list[int]) -> list[int]:
    """The model's greedy next token after each prefix of `ids`."""
    n = len(ids)
    logits = model(torch.tensor([ids]), torch.arange(n)[None], model.new_cache(n + 4),
                   attention_mask(0, causal_ancestors(n)), logits_from=0)
    return logits[0].argmax(-1).tolist()


def tokens_per_pass(agree: list[list[int]], k: int) -> float:
    """Verified tokens a pass with drafts of up to k tokens: a draft's tokens are accepted while
    the twin agrees with the target, then the target's own token comes."""
    passes = tokens = 0
    for marks in agree:
        i = 0
        while i < len(marks):
            accepted = 0
            while accepted < k and i + accepted < len(marks) and marks[i + accepted]:
                accepted += 1
            step = min(accepted + 1, len(marks) - i)
            passes, tokens, i = passes + 1, tokens + step, i + step
    return tokens / passes


def forward_ms(model, cached: int, new: int, repeats: int = 7) -> float:
    """Median ms of a forward of `new` tokens after `cached` ones."""
    cache = model.new_cache(cached + new + 4)
    if cached:
        model(torch.arange(100, 100 + cached)[None], torch.arange(cached)[None], cache,
              attention_mask(0, causal_ancestors(cached)), logits_from=cached - 1)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(torch.arange(200, 200 + new)[None], torch.arange(cached, cached + new)[None], cache,
              attention_mask(cached, causal_ancestors(new)), logits_from=new - 1)
        times.append(time.perf_counter() - start)
        cache.rollback(cached)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=Path, default=QUESTIONS)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 3, 5, 8])
    args = parser.parse_args()
    target, tokenizer = load()
    twin = make_drafter(SELF_INT4, target).model
    eos = tokenizer.eos_token_ids or target.config.eos_token_ids
    picked: dict[str, list[str]] = {}
    for line in args.questions.read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            picked.setdefault(q["category"], [])
            if len(picked[q["category"]]) < args.per_category:
                picked[q["category"]].append(q["turns"][0])
    agree = []
    with torch.inference_mode():
        for prompts in picked.values():
            for prompt in prompts:
                ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
                out = generate(target, ids, SamplingParams(max_tokens=args.max_tokens), None, 0, eos).token_ids
                guesses = next_tokens(twin, ids + out[:-1])[len(ids) - 1:]
                agree.append([int(g == t) for g, t in zip(guesses, out)])
        marks = [m for a in agree for m in a]
        print(f"{len(agree)} prompts ({args.per_category} per category), {len(marks)} output tokens: the twin's "
              f"next token equals the float32 target's at {sum(marks) / len(marks):.1%} of them")
        for k in args.drafts:
            print(f"  drafts of up to {k}: {tokens_per_pass(agree, k):.2f} tokens a target pass")
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for cached, new in ((128, 1), (700, 1), (0, 64), (0, 700)):
                f, q = forward_ms(target, cached, new), forward_ms(twin, cached, new)
                print(f"  {threads} thread(s), {new} token(s) after {cached}: float32 {f:.1f} ms, int4 {q:.1f} ms")


if __name__ == "__main__":
    main()
