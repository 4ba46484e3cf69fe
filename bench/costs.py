"""`specserve simulate --measure-costs FILE`: the simulator's costs, measured on this machine.

- Verification passes: `verify_batch` of R rows of 1 + N tokens each after a
  cached context (bench.harness.verify_pass_seconds), over a grid of R and N,
  fitted by least squares to base + row x rows + token x tokens.
- Prefill: one forward of P prompt tokens into an empty row, over a few P,
  fitted to base + token x P.
- Draft time per token of each drafter (bench.harness.draft_token_ms).
- Acceptance: each drafter generates on Spec-Bench dev questions in process,
  greedy, one chain of `draft_length` a round; every full-length round's
  (drafted, accepted) pair is kept per domain, and a pipelined run of the same
  questions gives how often a wholly accepted round's ahead draft was kept.
  The questions' prompt and output lengths are the simulated requests'.
- Call overhead: with `server`, plain-decoding requests through the running
  server; what each took beyond its prefill and its one-row, one-token
  passes (as measured, not the fit: one row takes its own path), per call
  (one a pass), median over requests. Without a server it is
  0 and the file says it was not measured.

Every timing is a median of `--timing-repeats`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from bench.harness import draft_token_ms, forward_ms, load_questions, verify_pass_seconds
from bench.load import CLIENT_TIMEOUT_S, WARM_UP
from bench.simulator import fit_linear
from cluster.local import LocalEngine
from drafter_service.registry import make_drafter
from speculative.batching import VerifyItem
from speculative.decoding import DraftRequest, generate
from runtime.model import attention_mask, causal_ancestors
from speculative.sampling import SamplingParams
from speculative.tree import DraftTree

PASS_ROWS = (1, 2, 4, 8)
PASS_NODES = (0, 5, 10)  # draft nodes per row, besides its root
PREFILL_TOKENS = (16, 64, 128, 256)
CONTEXT = 256  # cached tokens before each timed pass


def measure_passes(engine: LocalEngine, repeats: int) -> list[dict]:
    """Median ms of a verification pass of `rows` rows, each a root and a `nodes`-token chain."""
    m = engine.model
    rows_max, nodes_max = max(PASS_ROWS), max(PASS_NODES)
    cache = m.new_cache(CONTEXT + nodes_max + 16, batch=rows_max)
    ids = (torch.arange(CONTEXT) * 7 % 1000 + 100)[None].expand(rows_max, CONTEXT)
    with torch.inference_mode():
        m(ids, torch.arange(CONTEXT)[None].expand(rows_max, CONTEXT), cache,
          attention_mask(0, causal_ancestors(CONTEXT)).expand(rows_max, -1, -1))
    out = []
    for rows in PASS_ROWS:
        for nodes in PASS_NODES:
            chain = [int(t) for t in torch.arange(nodes) * 11 + 200]
            items = [VerifyItem(r, 42, DraftTree.chain(chain), SamplingParams(), torch.Generator())
                     for r in range(rows)]
            _log(f"verification pass: {rows} rows x {1 + nodes} tokens")
            verify_pass_seconds(m, cache, items, CONTEXT)  # warm-up
            times = [verify_pass_seconds(m, cache, items, CONTEXT) for _ in range(repeats)]
            out.append({"rows": rows, "tokens": rows * (1 + nodes),
                        "ms": round(statistics.median(times) * 1000, 3)})
    return out


def measure_prefill(engine: LocalEngine, repeats: int) -> dict[str, float]:
    """Median ms of a prefill of P tokens into an empty row, by P."""
    m = engine.model
    out = {}
    for n in PREFILL_TOKENS:
        ids = (torch.arange(n) * 7 % 1000 + 100)[None]
        times = []
        for _ in range(repeats + 1):
            cache = m.new_cache(n + 8)
            start = time.perf_counter()
            with torch.inference_mode():
                m(ids, torch.arange(n)[None], cache, attention_mask(0, causal_ancestors(n)), logits_from=n - 1)
            times.append(time.perf_counter() - start)
        out[str(n)] = round(statistics.median(times[1:]) * 1000, 3)
    return out


class _RecordingDrafter:
    """A drafter that notes each draft's budget and size, in order; everything else is the drafter's."""

    def __init__(self, drafter):
        self._drafter, self.drafts = drafter, []  # (depth budget, nodes drafted)

    def __getattr__(self, name):
        return getattr(self._drafter, name)

    def propose(self, request: DraftRequest) -> DraftTree:
        tree = self._drafter.propose(request)
        self.drafts.append((request.depth, min(len(tree), request.nodes)))
        return tree


def measure_acceptance(engine: LocalEngine, drafters: list[str], questions: list[dict], max_tokens: int,
                       draft_length: int) -> tuple[dict, list[dict]]:
    """Per drafter and domain: the full-length rounds' (drafted, accepted) and the pipelined reuse rate;
    and the questions as simulated requests (domain, prompt tokens, output tokens)."""
    eos = engine.tokenizer.eos_token_ids or engine.model.config.eos_token_ids
    params = SamplingParams(max_tokens=max_tokens)
    acceptance, requests = {}, []
    bar = tqdm(total=len(drafters) * len(questions), desc="acceptance", unit="question")
    for name in drafters:
        rounds: dict[str, list[list[int]]] = defaultdict(list)
        reused, whole = defaultdict(int), defaultdict(int)  # per domain: ahead drafts kept, rounds wholly accepted
        for i, q in enumerate(questions):
            ids = engine.prompt_ids(q["turns"][0], chat=True)
            domain = q["bench_category"]
            # a fresh namespace per run: what one question taught a learning drafter stays out of the next
            drafter = _RecordingDrafter(make_drafter(name, engine.model, namespace=f"costs/{name}/{i}"))
            result = generate(engine.model, ids, params, drafter, draft_length, eos)
            for (depth, drafted), accepted in zip(drafter.drafts, result.accepted_per_round):
                if depth == draft_length:  # rounds cut short by the output's end: the simulator cuts its own
                    rounds[domain].append([drafted, accepted])
                    whole[domain] += drafted > 0 and accepted == drafted
            piped = generate(engine.model, ids, params, make_drafter(name, engine.model,
                                                                     namespace=f"costs/{name}/p{i}"),
                             draft_length, eos, pipelined=True)
            reused[domain] += piped.reused_drafts
            if name == drafters[0]:
                requests.append({"domain": domain, "prompt_tokens": len(ids), "output_tokens": len(result.token_ids)})
            bar.update()
        acceptance[name] = {d: {"rounds": r, "reuse_rate": round(min(1.0, reused[d] / whole[d]), 3) if whole[d]
                                else 0.0} for d, r in rounds.items()}
    bar.close()
    return acceptance, requests


def served_plain_requests(server: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """Plain-decoding requests through `server`: each one's ms, target passes (the prefill's included)
    and prompt tokens."""
    from specserve.client import Client

    out = []
    with Client(server, timeout=CLIENT_TIMEOUT_S) as client:
        client.generate(messages=[{"role": "user", "content": WARM_UP}], max_tokens=max_tokens, drafter="none")
        for prompt in prompts:
            start = time.perf_counter()
            r = client.generate(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, drafter="none")
            out.append({"ms": (time.perf_counter() - start) * 1000, "passes": r.usage.target_forward_passes,
                        "prompt_tokens": r.usage.prompt_tokens})
    return out


def call_ms(requests: list[dict], costs: dict) -> float:
    """One router -> service call's latency: what a served plain-decoding request took beyond its prefill
    and its one-row, one-token passes, per call (one a pass); the median over requests."""
    v, p = costs["verify_pass"], costs["prefill"]
    # a one-row, one-token pass as measured: it takes its own path (cpu_tuning's one-row BLAS), off the fit
    one_pass = next((m["ms"] for m in v.get("measured", []) if m["rows"] == 1 and m["tokens"] == 1),
                    v["base_ms"] + v["row_ms"] + v["token_ms"])
    return max(0.0, statistics.median(
        (r["ms"] - (p["base_ms"] + p["token_ms"] * r["prompt_tokens"]) - (r["passes"] - 1) * one_pass) / r["passes"]
        for r in requests))


def _log(what: str) -> None:
    print(f"measure-costs: {what}", file=sys.stderr, flush=True)


def _engine_batch_wait_ms() -> float:
    """How long the served verifier waits to fill a batch (its engine's default)."""
    import inspect

    from verifier_service.engine import VerifierEngine

    return inspect.signature(VerifierEngine.__init__).parameters["batch_wait_s"].default * 1000


def measure_costs(args) -> dict:
    engine = LocalEngine.load(args.model, args.device, args.dtype)
    questions = load_questions(args.questions, args.limit_per_category)
    if not questions:
        raise ValueError(f"--questions: no questions in {args.questions}")
    _log("verification passes")
    passes = measure_passes(engine, args.timing_repeats)
    base, row, token = fit_linear([([p["rows"], p["tokens"]], p["ms"]) for p in passes])
    _log("prefills")
    prefill = measure_prefill(engine, args.timing_repeats)
    p_base, p_token = fit_linear([([int(n)], ms) for n, ms in prefill.items()])
    model_drafters = [d for d in args.drafters if d != "none"]
    _log("draft times")
    one_token = forward_ms(engine, sizes=(1,), repeats=args.timing_repeats)["1"]
    drafts = draft_token_ms(engine, model_drafters, one_token, tokens=args.draft_length, repeats=args.timing_repeats)
    acceptance, requests = measure_acceptance(engine, model_drafters, questions, args.max_tokens, args.draft_length)
    if not requests:  # plain decoding only: the questions' lengths from plain decoding
        eos = engine.tokenizer.eos_token_ids or engine.model.config.eos_token_ids
        for q in questions:
            ids = engine.prompt_ids(q["turns"][0], chat=True)
            r = generate(engine.model, ids, SamplingParams(max_tokens=args.max_tokens), None, 0, eos)
            requests.append({"domain": q["bench_category"], "prompt_tokens": len(ids),
                             "output_tokens": len(r.token_ids)})
    served = []
    if args.server:
        _log("call overhead")
        served = served_plain_requests(args.server, [q["turns"][0] for q in questions[:args.call_requests]],
                                       args.max_tokens)
    costs = {
        "command": "specserve " + " ".join(getattr(args, "argv", []) or []),
        "torch_threads": torch.get_num_threads(), "max_tokens": args.max_tokens, "draft_length": args.draft_length,
        "verify_pass": {"base_ms": round(base, 4), "row_ms": round(row, 4), "token_ms": round(token, 4),
                        "context": CONTEXT, "measured": passes},
        "prefill": {"base_ms": round(p_base, 4), "token_ms": round(p_token, 4), "measured_ms": prefill},
        "draft_token_ms": {name: d["ms"] for name, d in drafts.items()},
        "served_plain_requests": served,
        "batch_wait_ms": _engine_batch_wait_ms(),  # a setting, not a measurement
        "acceptance": acceptance,
        "questions": requests,
    }
    costs.update(call_ms=round(call_ms(served, costs), 3) if served else 0.0, call_ms_measured=bool(served))
    Path(args.measure_costs).write_text(json.dumps(costs, indent=1))
    return costs
