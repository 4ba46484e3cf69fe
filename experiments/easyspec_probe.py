"""EasySpec against exact drafting, greedy: drafting time per token and acceptance per
draft position (docs/DRAFTERS.md "EasySpec").

    python experiments/easyspec_probe.py --drafters layerskip small-general --parallel 1 2 4 \
        --questions 3 --max-tokens 64 --draft-length 4 --sequential

Each config is a (drafter, parallel_layers, runner); parallel_layers 1 is exact
drafting, `--sequential` adds each P > 1 with the group's attentions run one after
another (the fuzzy math without the threads), to tell the two effects apart.

Timing: after a 128-token context is cached, one `propose` of `--draft-length`
tokens (which re-feeds the last context token exactly, as a round after a verdict
does), timed per drafted token; the configs take turns, `--repeats` rounds, and
the median is reported, so that load on a shared machine hits them alike.
Acceptance: greedy rounds replayed against the target's own greedy output of each
dev question (decoded once, with prompt lookup: lossless, so it is the target's):
each round accepts the longest prefix of the draft that matches it, plus the
target's next token, exactly what greedy verification does, without paying for
the target's passes. Reported: mean accepted draft tokens per round and the rate at
which draft position d is accepted when position d-1 was.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from cluster.local import LocalEngine
from drafter_service.registry import make_drafter
from speculative.decoding import DraftRequest, generate
from speculative.easyspec import run_sequentially
from speculative.sampling import SamplingParams

DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "dev.jsonl"


def build(engine, name: str, parallel: int, threads: bool):
    drafter = make_drafter(name, engine.model, parallel_layers=parallel)
    if not threads:
        drafter.layer_runner = run_sequentially
    return drafter


def draft_ms_per_token(engine, configs, depth: int, repeats: int) -> list[float]:
    """Median ms per drafted token of each config, the configs taking turns."""
    context = [int(t) for t in torch.arange(128) * 7 % 1000 + 100]
    drafters = [build(engine, *config) for config in configs]
    for drafter in drafters:
        drafter.propose(DraftRequest(context, depth, SamplingParams()))  # caches the context
    times = [[] for _ in configs]
    for _ in range(repeats):
        for drafter, samples in zip(drafters, times):
            start = time.perf_counter()
            tree = drafter.propose(DraftRequest(context, depth, SamplingParams()))
            samples.append((time.perf_counter() - start) / len(tree.tokens))
    return [round(1000 * statistics.median(samples), 3) for samples in times]


def replay(drafter, prompt: list[int], target_out: list[int], depth: int) -> list[int]:
    """Accepted draft tokens of each greedy round over `target_out` (the target's own output)."""
    accepted, done = [], 0
    while done < len(target_out) - 1:
        draft = drafter.propose(DraftRequest(prompt + target_out[:done], depth, SamplingParams())).tokens
        want = target_out[done:done + len(draft)]
        n = next((i for i, (a, b) in enumerate(zip(draft, want)) if a != b), min(len(draft), len(want)))
        accepted.append(n)
        done += n + 1  # the accepted tokens and the target's own next one
    return accepted


def per_depth(accepted_per_round: list[int], depth: int) -> list[float]:
    """P(draft position d accepted | position d-1 accepted), d = 1..depth."""
    rates = []
    for d in range(1, depth + 1):
        reached = sum(a >= d - 1 for a in accepted_per_round)
        rates.append(sum(a >= d for a in accepted_per_round) / reached if reached else float("nan"))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafters", nargs="+", default=["layerskip", "small-general"])
    ap.add_argument("--parallel", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sequential", action="store_true", help="also run P > 1 without threads")
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft-length", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30, help="timing rounds per config")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()

    engine = LocalEngine.load()
    questions = [json.loads(line)["turns"][0] for line in DEV.read_text().splitlines()][:args.questions]
    prompts = [engine.prompt_ids(q, chat=True) for q in questions]
    eos = engine.tokenizer.eos_token_ids or engine.model.config.eos_token_ids
    pld = make_drafter("pld", engine.model)
    outputs = [generate(engine.model, ids, SamplingParams(max_tokens=args.max_tokens), pld, 4, eos).token_ids
               for ids in prompts]
    rows, replayed = [], {}
    for name in args.drafters:
        configs = [(name, p, True) for p in args.parallel]
        if args.sequential:
            configs += [(name, p, False) for p in args.parallel if p > 1]
        ms = draft_ms_per_token(engine, configs, args.draft_length, args.repeats)
        for config, draft_ms in zip(configs, ms):
            if config[2] or (name, config[1]) not in replayed:  # the runner changes the time, not the drafts
                replayed[name, config[1]] = [n for ids, out in zip(prompts, outputs)
                                             for n in replay(build(engine, *config), ids, out, args.draft_length)]
            accepted = replayed[name, config[1]]
            row = {"drafter": name, "parallel_layers": config[1], "runner": "threads" if config[2] else "sequential",
                   "draft_ms_per_token": draft_ms, "rounds": len(accepted),
                   "mean_accepted_per_round": round(sum(accepted) / max(len(accepted), 1), 3),
                   "acceptance_by_depth": [round(r, 3) for r in per_depth(accepted, args.draft_length)]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
