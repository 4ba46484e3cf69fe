"""What bounds a pipelined served round: the same prompts through a running server, rounds
in sequence and then pipelined, against the drafter's own cost in this process.

    export SPECSERVE_CLUSTER_SECRET=$(python -c 'import secrets; print(secrets.token_hex(16))')
    specserve serve --config bench/configs/own_cores_int4.toml &
    python experiments/pipelined_round_probe.py --server 127.0.0.1:50064 --draft-length 5

(`--draft-length` must be the server's `[router] draft_length`.) Served, for each way: tokens/s,
ms a round, the verifier's time in its forward passes (its Stats call) and the CPU time of
the router and drafter-pool processes, per round (`served_pass_probe.served`). Pipelined, a round cannot take
less than its longer side: when that is drafting, the mode makes at most one token per
draft token the pool makes. In process, on one torch thread as the pool drafts, the drafter
proposes `--draft-length` tokens after each prompt (median of `--repeats`), which gives that
ceiling in tokens/s. Run with nothing else busy; the server must be idle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from served_pass_probe import QUESTIONS, served


def draft_token_ms(prompts: list[str], drafter: str, draft_length: int, repeats: int) -> float:
    """Median ms a draft token of `drafter` in this process on one torch thread, over proposals
    of `draft_length` tokens after each prompt (the prefill of the prompt not counted)."""
    from drafter_service.registry import make_drafter
    from speculative.decoding import DraftRequest
    from runtime.loading import load
    from speculative.sampling import SamplingParams, make_generator

    torch.set_num_threads(1)
    target, tokenizer = load()
    times = []
    for prompt in prompts:
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        for _ in range(repeats):
            model_drafter = make_drafter(drafter, target)
            # as in a round: the drafter has the context up to its last verified token, takes it, drafts
            model_drafter.propose(DraftRequest(ids[:-1], 1, SamplingParams(), make_generator(0), max_nodes=1))
            started = time.perf_counter()
            model_drafter.propose(DraftRequest(ids, draft_length, SamplingParams(), make_generator(0),
                                               max_nodes=draft_length))
            times.append((time.perf_counter() - started) / draft_length)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, help="a running specserve server, HOST:PORT")
    ap.add_argument("--drafter", default="self-int4")
    ap.add_argument("--draft-length", type=int, required=True, help="the server's [router] draft_length")
    ap.add_argument("--questions", default=str(QUESTIONS))
    ap.add_argument("--prompts", type=int, default=3, help="the first N dev questions")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="in-process proposals timed per prompt")
    args = ap.parse_args()
    questions = [json.loads(line) for line in Path(args.questions).read_text().splitlines() if line.strip()]
    prompts = [q["turns"][0] for q in questions[:args.prompts]]
    rows = {way: served(args.server, prompts, args.max_tokens, args.drafter, way == "pipelined")
            for way in ("sequential", "pipelined")}
    for way, r in rows.items():
        print(f"served {way}: {r['tokens_per_s']:.1f} tokens/s, {r['tokens_per_pass']:.2f} tokens and "
              f"{r['wall_ms']:.1f} ms a round; verifier busy {r['busy_ms']:.1f} ms a forward; CPU a round: "
              f"router {r['router_cpu_ms']:.1f} ms, pool {r['pool_cpu_ms']:.1f} ms")
    gain = rows["pipelined"]["tokens_per_s"] / rows["sequential"]["tokens_per_s"]
    print(f"pipelined against sequential: {gain:.2f}x")
    ms = draft_token_ms(prompts, args.drafter, args.draft_length, args.repeats)
    print(f"in process, one thread: {ms:.1f} ms a draft token of {args.drafter}, so a pipelined mode bound by "
          f"drafting makes at most {1000 / ms:.1f} tokens/s")


if __name__ == "__main__":
    main()
