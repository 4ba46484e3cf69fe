"""Measure online learning: a stream of dev prompts of one category through the
single-process decoding loop with a small drafter that learns from it (its learner
thread running beside, publishing versions it swaps in between rounds), against the
same stream drafted by the frozen drafter and decoded plainly.

Prints, per window of requests, the mean accepted tokens per target pass of the
learning drafter and of the frozen one on the same prompts, whether every output
equals plain greedy decoding, the tokens per second of each, and what the learner did.

    python scripts/online_learning.py --category translation --drafter small-math --limit 53 --passes 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cluster.state import EmbeddedStateStore
from drafter_service.learner import OnlineLearning
from drafter_service.published import PublishedDrafters
from drafter_service.registry import make_drafter
from drafter_service.settings import LearnerSettings
from router.domains import read_questions
from runtime import loading
from speculative.decoding import generate
from speculative.sampling import SamplingParams

DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "dev.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", default=str(DEV))
    ap.add_argument("--category", default="translation")
    ap.add_argument("--drafter", default="small-math")
    ap.add_argument("--limit", type=int, default=24, help="prompts of the category, in file order")
    ap.add_argument("--passes", type=int, default=1,
                    help="times the stream goes through those prompts (a category has at most 54)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft-length", type=int, default=4)
    ap.add_argument("--window", type=int, default=8, help="requests per reported window")
    ap.add_argument("--steps-per-minute", type=float, default=30.0)
    ap.add_argument("--tokens-per-step", type=int, default=1024)
    ap.add_argument("--publish-every-steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the serving thread")
    ap.add_argument("--out", help="write each request's numbers here (JSON lines)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    target, tokenizer = loading.load()
    questions = [q for q in read_questions(args.questions) if q["category"] == args.category][:args.limit]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in questions] * args.passes
    eos = tokenizer.eos_token_ids or target.config.eos_token_ids
    params = SamplingParams(max_tokens=args.max_tokens)

    settings = LearnerSettings(enabled=True, steps_per_minute=args.steps_per_minute, lr=args.lr,
                               tokens_per_step=args.tokens_per_step, publish_every_steps=args.publish_every_steps,
                               refresh_s=0.1)
    published = PublishedDrafters(tempfile.mkdtemp(prefix="online-"), EmbeddedStateStore(), settings.refresh_s)
    learning = OnlineLearning(settings, published, target.config.vocab_size)
    learning.learner(args.drafter)  # loaded before the clock starts
    rows = []

    def run(drafter, prompt):
        started = time.perf_counter()
        result = generate(target, prompt, params, drafter=drafter, draft_length=args.draft_length, eos_token_ids=eos)
        return result, time.perf_counter() - started

    for i, prompt in enumerate(prompts):
        # interleaved per request, so drift of a shared machine hits all three alike; the
        # learner's thread runs only while the learning drafter serves (what learning costs it)
        drafter = learning.wrap(make_drafter(args.drafter, target), args.drafter, args.category, target)
        learning.start()
        learned, learned_s = run(drafter, prompt)
        learning.stop()
        drafter.flush()
        frozen, frozen_s = run(make_drafter(args.drafter, target), prompt)
        plain, plain_s = run(None, prompt)
        rows.append({"request": i, "version": drafter.version, "learning": learned.mean_accepted_tokens,
                     "frozen": frozen.mean_accepted_tokens, "learning_s": learned_s, "frozen_s": frozen_s,
                     "plain_s": plain_s, "tokens": len(learned.token_ids),
                     "equal_plain": learned.token_ids == plain.token_ids == frozen.token_ids})
        print(f"request {i}: v{drafter.version} {learned.mean_accepted_tokens:.2f} tokens/pass "
              f"(frozen {frozen.mean_accepted_tokens:.2f}), equal to plain: {rows[-1]['equal_plain']}, "
              f"{learned_s:.1f}/{frozen_s:.1f}/{plain_s:.1f} s, learner {learning.status()['drafters']}", flush=True)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"\n{args.category}, drafter {args.drafter}, {len(rows)} requests of {args.max_tokens} tokens")
    print("| requests | learning: accepted tokens/pass | frozen | difference | versions served |")
    print("| --- | ---: | ---: | ---: | --- |")
    for start in range(0, len(rows), args.window):
        part = rows[start:start + args.window]
        a, b = statistics.mean(r["learning"] for r in part), statistics.mean(r["frozen"] for r in part)
        versions = sorted({r["version"] for r in part})
        print(f"| {start + 1}-{start + len(part)} | {a:.3f} | {b:.3f} | {a - b:+.3f} | {versions} |")
    per_pass = len(questions)
    for p in range(args.passes):  # the same prompts each pass: what the learner made of them
        part = rows[p * per_pass:(p + 1) * per_pass]
        print(f"pass {p + 1} (requests {p * per_pass + 1}-{(p + 1) * per_pass}): learning "
              f"{statistics.mean(r['learning'] for r in part):.3f}, frozen {statistics.mean(r['frozen'] for r in part):.3f}")
    tokens = sum(r["tokens"] for r in rows)
    print(f"outputs equal to plain greedy decoding: {sum(r['equal_plain'] for r in rows)}/{len(rows)}")
    speed = {mode: tokens / sum(r[f"{mode}_s"] for r in rows) for mode in ("learning", "frozen", "plain")}
    print(f"tokens/s: learning (learner thread running) {speed['learning']:.2f}, frozen {speed['frozen']:.2f}, "
          f"plain {speed['plain']:.2f}")
    learner = learning.learners[args.drafter]
    print(f"learner: {learner.steps} steps, last loss {learner.last_loss}, published version {learner.version}, "
          f"buffer {learner.buffer.tokens(args.category)} tokens")


if __name__ == "__main__":
    main()
