"""`specserve bench`: decoding modes side by side on Spec-Bench questions.

Every mode runs on the same prompts, in the same process, interleaved per
question so drift on the machine hits all modes alike. Greedy, chat
template. Tokens/s is generated tokens over wall seconds (median of
`--repeats` timings per generation); speedups are against Hugging Face
`generate` (`hf-ar`) in the same run. `llamacpp-ar` and `llamacpp-pld` run llama.cpp
on the GGUF as it is (`bench.llamacpp`, an optional extra).

Served modes call a running server: `served-<drafter>` and `pipelined-<drafter>`
over gRPC (`--server`), `http-<drafter>` over its OpenAI-compatible HTTP API
(`--http`). With a drafter in process, served and over HTTP in one run, the
report's overhead table is what each API adds per request on the same prompts.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.chart import write_chart
from bench.hf import HF_PLD_TOKENS, HFRunner, departure  # noqa: F401 (the bench's and its callers')
from bench.http_client import REQUEST_FAILED, HttpClient
from bench.llamacpp import LLAMACPP_MODES, LlamaCppRunner, agreement_lines
from bench.load import CLIENT_TIMEOUT_S, WARM_UP
from bench.questions import CATEGORIES, load_questions
from cluster.local import LocalEngine, Request
from drafter_service.registry import SHIPPED_DRAFTERS
from runtime.cpu_tuning import PAD_ROWS_TO
from speculative.sampling import SamplingParams

HF_MODES = {"hf-ar", "hf-pld"}
MODEL_DRAFTERS = ("layerskip",) + SHIPPED_DRAFTERS  # drafters that run a network per draft token
SERVED = "served-"  # served-<mode>: the same drafter through a running server (--server), rounds in sequence
PIPELINED = "pipelined-"  # pipelined-<mode>: served, drafting each next round while the verifier checks this one
HTTP = "http-"  # http-<mode>: served through the OpenAI-compatible HTTP API (--http); the server's `pipelined`
GRPC = (SERVED, PIPELINED)
REMOTE = GRPC + (HTTP,)
# served-<drafter>@<placement>: where the request's eagle drafter runs (GenerateRequest.eagle_placement:
# verifier or pool); without it, the server's `[router] eagle_placement`
PLACEMENT = "@"


def served_drafter(mode: str) -> str | None:
    """The drafter a served mode's requests name (`ar` or `none`: "none", plain decoding;
    `auto`: "", the server routes), or None for a mode run in process."""
    for prefix in REMOTE:
        if mode.startswith(prefix):
            drafter = mode.removeprefix(prefix).partition(PLACEMENT)[0]
            return {"ar": "none", "auto": ""}.get(drafter, drafter)
    return None


def eagle_placement(mode: str) -> str:
    """A served mode's eagle placement (`served-eagle@pool`: "pool"; "": the server's)."""
    return mode.partition(PLACEMENT)[2] if served_drafter(mode) is not None else ""


def local_mode(mode: str) -> str:
    """The in-process mode a served one runs remotely (`served-none` and `http-none`: `ar`;
    `served-eagle@pool`: `eagle`)."""
    for prefix in REMOTE:
        if mode.startswith(prefix):
            local = mode.removeprefix(prefix).partition(PLACEMENT)[0]
            return "ar" if local == "none" else local
    return mode


def mode_namespace(run_id: str, mode: str, repeat: int | str) -> str:
    """The memory namespace of one bench run's mode and repeat: nothing any other mode or
    repeat taught the drafters reaches it."""
    return f"bench-{run_id}/{mode}/{repeat}"


class ServedRunner:
    """A running specserve server, called like a client would: over gRPC (HOST:PORT),
    or with `http` over its OpenAI-compatible API (http://HOST:PORT)."""

    def __init__(self, address: str, http: bool = False):
        from specserve.client import Client

        self.http = http
        self.client = (HttpClient(address, timeout=CLIENT_TIMEOUT_S) if http
                       else Client(address, timeout=CLIENT_TIMEOUT_S))

    def run(self, prompt: str, params: SamplingParams, mode: str, namespace: str = ""
            ) -> tuple[list[int], float, int, tuple[int, int]]:
        """Tokens, seconds, target passes, (draft tokens, accepted draft tokens)."""
        # over HTTP there is no per-request `pipelined`: the server's setting holds
        extra = {} if self.http else {"pipelined": mode.startswith(PIPELINED), "eagle_placement": eagle_placement(mode)}
        start = time.perf_counter()
        out = self.client.generate(messages=[{"role": "user", "content": prompt}], max_tokens=params.max_tokens,
                                   temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                   seed=params.seed, drafter=served_drafter(mode), namespace=namespace, **extra)
        u = out.usage
        return (list(out.token_ids), time.perf_counter() - start, u.target_forward_passes,
                (u.draft_tokens, u.accepted_draft_tokens))


OVERHEAD_APIS = ("in_process", "grpc", "http")


def api_overhead(per_request: dict[str, list[float]]) -> list[dict]:
    """What each API adds per request: for each drafter run in at least two of in process,
    served over gRPC (`served-`) and over HTTP (`http-`), the median seconds per request of
    each, and the median over the same prompts of the per-prompt differences HTTP - gRPC and
    gRPC - in process, in ms. `per_request`: per mode, its seconds per question in order."""
    by: dict[str, dict[str, str]] = defaultdict(dict)
    for mode in per_request:
        if mode in HF_MODES or mode.startswith(PIPELINED):
            continue
        api = "http" if mode.startswith(HTTP) else "grpc" if mode.startswith(SERVED) else "in_process"
        by[local_mode(mode)].setdefault(api, mode)
    rows = []
    for drafter, modes in by.items():
        if len(modes) < 2:
            continue
        times = {api: per_request[m] for api, m in modes.items()}
        row: dict = {"drafter": drafter, "modes": modes, "requests": min(len(t) for t in times.values())}
        for api in OVERHEAD_APIS:
            row[f"{api}_s"] = round(statistics.median(times[api]), 4) if api in times else None
        for a, b in (("grpc", "in_process"), ("http", "grpc")):
            row[f"{a}_minus_{b}_ms"] = (round(1000 * statistics.median(x - y for x, y in zip(times[a], times[b])), 2)
                                        if a in times and b in times else None)
        rows.append(row)
    return rows


OVERHEAD_COLUMNS = ("modes", "requests", "in process s", "gRPC s", "HTTP s", "gRPC - in process ms",
                    "HTTP - gRPC ms")


def _overhead_cells(row: dict) -> list[str]:
    def num(v: float | None, fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    return [" / ".join(row["modes"][api] for api in OVERHEAD_APIS if api in row["modes"]), str(row["requests"]),
            num(row["in_process_s"], ".3f"), num(row["grpc_s"], ".3f"), num(row["http_s"], ".3f"),
            num(row["grpc_minus_in_process_ms"], "+.1f"), num(row["http_minus_grpc_ms"], "+.1f")]


OVERHEAD_TITLE = ("Per-request overhead of each API on the same prompts (median seconds per request; the "
                  "differences are the median over prompts of each prompt's difference, ms):")


def _overhead_table(report: dict) -> list[str]:
    rows = report.get("overhead_per_request") or []
    if not rows:
        return []
    lines = ["", OVERHEAD_TITLE, "", "| " + " | ".join(OVERHEAD_COLUMNS) + " |",
             "| --- |" + " ---: |" * (len(OVERHEAD_COLUMNS) - 1)]
    return lines + ["| " + " | ".join(_overhead_cells(r)) + " |" for r in rows]


def forward_ms(engine: LocalEngine, sizes=(1, 2, 4, 6, 8, 16, 17, 32), prefix: int = 128, repeats: int = 10,
               static=None) -> dict[str, float]:
    """Median time of one target forward of T new tokens after a cached prefix; with `static`
    (runtime.graphs.StaticPasses) through its static passes, each size's first (a capture on
    CUDA) untimed."""
    from runtime.model import attention_mask, causal_ancestors

    m = engine.model
    dev = m.device
    cache = m.new_cache(prefix + max(sizes) + PAD_ROWS_TO) if static is None else static.cache
    cache.rollback(0)
    ids = torch.arange(prefix, device=dev)[None] % m.config.vocab_size
    m(ids, torch.arange(prefix, device=dev)[None], cache, attention_mask(0, causal_ancestors(prefix, dev)))
    out = {}
    for t in sizes:
        times = []
        for i in range(repeats + (static is not None)):
            cache.rollback(prefix)
            start = time.perf_counter()
            positions = torch.arange(prefix, prefix + t, device=dev)[None]
            tokens = torch.zeros(1, t, dtype=torch.long, device=dev)
            mask = attention_mask(prefix, causal_ancestors(t, dev))
            logits = m(tokens, positions, cache, mask) if static is None else static(tokens, positions, mask, [0])
            logits[0, -1, 0].item()  # on a GPU, waits for the pass
            if static is None or i:
                times.append(time.perf_counter() - start)
        out[str(t)] = round(statistics.median(times) * 1000, 2)
    cache.rollback(0)
    return out


def verify_pass_seconds(model, cache, items, context: int) -> float:
    """Time one `verify_batch` pass of `items`, then roll every cache row back to `context` tokens."""
    from speculative.batching import verify_batch

    start = time.perf_counter()
    with torch.inference_mode():
        verify_batch(model, cache, items)
    elapsed = time.perf_counter() - start
    for row in range(len(cache.lengths)):
        cache.rollback(context, row=row)
    return elapsed


def draft_token_ms(engine: LocalEngine, drafters: list[str], target_ms: float, prefix: int = 128,
                   tokens: int = 5, repeats: int = 10, tree_nodes: int | None = None) -> dict[str, dict[str, float]]:
    """Median time of one draft token of each model drafter after a cached prefix,
    and its ratio to one target forward of one token; with `tree_nodes`, also of one
    level of a greedy token tree of that many nodes, `tokens` deep."""
    from drafter_service.registry import make_drafter
    from speculative.decoding import DraftRequest

    context = [int(t) for t in torch.arange(prefix) * 7 % 1000 + 100]
    out = {}
    for name in drafters:
        drafter = make_drafter(name, engine.model)
        drafter.propose(DraftRequest(context, tokens, SamplingParams()))  # prefill the drafter's cache
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            drafter.propose(DraftRequest(context, tokens, SamplingParams()))  # re-feeds the last token, drafts `tokens`
            times.append((time.perf_counter() - start) / tokens)
        ms = statistics.median(times) * 1000
        out[name] = {"ms": round(ms, 2), "ratio_to_target_forward": round(ms / target_ms, 3)}
        if tree_nodes and tree_nodes > tokens:
            levels = []
            for _ in range(repeats):
                start = time.perf_counter()
                drafter.propose(DraftRequest(context, tokens, SamplingParams(), max_nodes=tree_nodes))
                levels.append((time.perf_counter() - start) / tokens)
            level_ms = statistics.median(levels) * 1000
            out[name].update(tree_level_ms=round(level_ms, 2), tree_level_ratio=round(level_ms / target_ms, 3))
    return out


def load_seconds(model: str | None, device: str = "cpu") -> dict[str, float]:
    """Cold load (GGUF conversion into an empty cache) and cached load, onto `device`."""
    from cluster.env import cpu_tuning_from_env
    from runtime import loading

    tuning = cpu_tuning_from_env()
    src = loading.resolve_source(model)
    if src.suffix != ".gguf":
        start = time.perf_counter()
        loading.load(model, device, cpu_tuning=tuning)
        return {"cached": round(time.perf_counter() - start, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        loading.load(model, device, cache_dir=tmp, cpu_tuning=tuning)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        loading.load(model, device, cache_dir=tmp, cpu_tuning=tuning)
        cached = time.perf_counter() - start
    return {"cold": round(cold, 2), "cached": round(cached, 2)}


@dataclass
class Generation:
    """One mode's answer to one question, timed."""
    tokens: list[int]
    seconds: float
    passes: int | None = None  # target forward passes; None where the mode does not say
    drafts: tuple[int, int] | None = None  # (draft tokens, accepted draft tokens)


@dataclass
class Runners:
    """What runs the bench's modes: our engine in process, and where the modes ask for
    them, Hugging Face, llama.cpp and a running server over gRPC and over HTTP."""
    args: Any  # the bench's arguments: draft length, tree budget, parallel layers
    engine: LocalEngine
    hf: HFRunner | None
    llama: LlamaCppRunner | None
    served: ServedRunner | None
    http: ServedRunner | None

    @classmethod
    def start(cls, args, questions: list[dict], run_id: str) -> "Runners":
        from runtime import loading

        served = ServedRunner(args.server) if any(m.startswith(GRPC) for m in args.modes) else None
        http = ServedRunner(args.http, http=True) if any(m.startswith(HTTP) for m in args.modes) else None
        for mode in args.modes:  # untimed: the first request over each API pays for connecting and warming up
            runner = http if mode.startswith(HTTP) else served if served_drafter(mode) is not None else None
            if runner is None:
                continue
            try:
                runner.client.generate(messages=[{"role": "user", "content": WARM_UP}], max_tokens=args.max_tokens,
                                       drafter=served_drafter(mode), namespace=mode_namespace(run_id, mode, "warm-up"))
            except REQUEST_FAILED as e:  # before loading anything: a wrong address fails at once
                flag = f"--http {args.http}" if runner is http else f"--server {args.server}"
                raise ValueError(f"{flag}: the warm-up request of mode {mode} failed: {e}") from e
        engine = LocalEngine.load(args.model, args.device, args.dtype)
        graphs = getattr(args, "cuda_graphs", "auto")
        if graphs != "auto":
            engine.cuda_graphs = graphs == "on"
        # the hf-* modes stay float32 whatever --dtype: they are the judge of float32 and the
        # baseline the low-precision modes are measured against
        source = loading.resolve_source(args.model)
        hf = HFRunner(source, device=args.device) if HF_MODES & set(args.modes) else None
        # llama.cpp: the GGUF as it is, threads as many as torch's here (LocalEngine.load set them),
        # a context for the longest prompt, its answer and one more draft
        llama = LlamaCppRunner(
            source, args.modes, n_threads=torch.get_num_threads(), pld_tokens=args.draft_length,
            eos=engine.tokenizer.eos_token_ids or engine.model.config.eos_token_ids,
            n_ctx=max(len(engine.prompt_ids(q["turns"][0], chat=True)) for q in questions) + args.max_tokens
            + args.draft_length + 1) if set(LLAMACPP_MODES) & set(args.modes) else None
        return cls(args, engine, hf, llama, served, http)

    def generate(self, mode: str, prompt: str, ids: list[int], params: SamplingParams, namespace: str) -> Generation:
        args = self.args
        if mode in HF_MODES:
            return Generation(*self.hf.run(ids, params, mode))
        if mode in LLAMACPP_MODES:
            return Generation(*self.llama.run(ids, params, mode))
        if served_drafter(mode) is not None:
            runner = self.http if mode.startswith(HTTP) else self.served
            return Generation(*runner.run(prompt, params, mode, namespace))
        r = self.engine.run(Request(prompt, True, params, "none" if mode == "ar" else mode, args.draft_length,
                                    getattr(args, "tree_budget", None), namespace,
                                    getattr(args, "parallel_layers", None) or 1,
                                    calibrate=not getattr(args, "no_calibrate", False)))
        return Generation(r.token_ids, r.seconds, r.target_forward_passes,
                          (r.draft_tokens, r.accepted_draft_tokens))


class Tally:
    """Per (mode, category): tokens, seconds, target passes, draft tokens and accepted ones,
    summed over questions (a sum is None once any question's mode did not report it)."""

    def __init__(self):
        self.sums: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0, 0, 0, 0])

    def add(self, mode: str, category: str, tokens: int, seconds: float, passes: int | None,
            drafts: tuple[int, int] | None) -> None:
        for cat in (category, "overall"):
            s = self.sums[(mode, cat)]
            s[0] += tokens
            s[1] += seconds
            s[2] = None if passes is None or s[2] is None else s[2] + passes
            s[3:] = [None, None] if drafts is None or s[3] is None else [s[3] + drafts[0], s[4] + drafts[1]]

    def rows(self, modes: list[str]) -> list[dict]:
        """The report's rows, by category then mode, with speedups against hf-ar's."""
        rows = []
        for cat in CATEGORIES + ["overall"]:
            base = self.sums.get(("hf-ar", cat))
            base_tps = base[0] / base[1] if base and base[1] else None
            for mode in modes:
                if (mode, cat) not in self.sums:
                    continue
                tokens, seconds, passes, drafted, accepted = self.sums[(mode, cat)]
                tps = tokens / seconds if seconds else 0.0
                rows.append({
                    "mode": mode, "category": cat, "tokens_per_s": round(tps, 3),
                    "mean_accepted_tokens": round(tokens / passes, 3) if passes else None,
                    "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                    "speedup_vs_hf_ar": round(tps / base_tps, 3) if base_tps else None,
                    "generated_tokens": int(tokens),
                })
        return rows

    def served_overhead(self, modes: list[str]) -> dict[str, float]:
        """Per served mode whose drafter also ran in process: the extra wall milliseconds per
        target pass (one round) of the served path over the in-process one."""
        overall = {mode: v[:3] for (mode, cat), v in self.sums.items() if cat == "overall"}
        overhead = {}
        for mode in modes:
            local = local_mode(mode)
            if mode.startswith((SERVED, HTTP)) and local in overall:
                (_, s_served, p_served), (_, s_local, p_local) = overall[mode], overall[local]
                overhead[mode] = round(1000 * (s_served / p_served - s_local / p_local), 2)
        return overhead


def run_bench(args) -> dict:
    questions = load_questions(args.questions, args.limit_per_category)
    if not questions:
        raise ValueError(f"--questions: no questions in {args.questions}")
    # Each mode, and each repeat of it, drafts in a memory namespace of its own (suffix index,
    # recycling table, calibrations, expertise statistics; in process and served alike): one fed
    # by another mode's run of this very question would draft its answer from memory. Within
    # one, learning across questions stays, as in production.
    run_id = uuid.uuid4().hex[:8]
    runners = Runners.start(args, questions, run_id)
    temperature = getattr(args, "temperature", 0.0)
    tally = Tally()
    same_as_hf: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    departures: dict[str, list[dict]] = defaultdict(list)  # mode: where its outputs leave hf-ar's
    per_request: dict[str, list[float]] = defaultdict(list)  # mode: seconds per question (median of repeats)
    outputs: dict[str, list[list[int]]] = defaultdict(list)  # mode: its tokens per question
    bar = tqdm(total=len(questions) * len(args.modes) * args.repeats, desc="bench", unit="gen")
    for qi, q in enumerate(questions):
        prompt = q["turns"][0]
        ids = runners.engine.prompt_ids(prompt, chat=True)
        # sampled runs: one seed per question, the same for every mode
        params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature,
                                seed=None if temperature == 0 else getattr(args, "seed", 0) + qi)
        reference = None
        for mode in args.modes:
            times = []
            for repeat in range(args.repeats):
                gen = runners.generate(mode, prompt, ids, params, mode_namespace(run_id, mode, repeat))
                times.append(gen.seconds)
                bar.update()
            seconds = statistics.median(times)
            per_request[mode].append(seconds)
            outputs[mode].append(gen.tokens)
            if mode == "hf-ar":
                reference = gen.tokens
            elif reference is not None and temperature == 0:  # sampled runs differ by design
                same_as_hf[mode][0] += gen.tokens == reference
                same_as_hf[mode][1] += 1
                if gen.tokens != reference:  # untimed: where, and how close HF's own choice was there
                    departures[mode].append({"question": qi, "category": q["bench_category"],
                                             **departure(runners.hf, ids, gen.tokens, reference)})
            tally.add(mode, q["bench_category"], len(gen.tokens), seconds, gen.passes, gen.drafts)
    bar.close()

    report = {
        "command": "specserve " + " ".join(getattr(args, "argv", []) or []),
        "max_tokens": args.max_tokens, "limit_per_category": args.limit_per_category,
        "draft_length": args.draft_length, "tree_budget": getattr(args, "tree_budget", None),
        "repeats": args.repeats, "torch_threads": torch.get_num_threads(), "temperature": temperature,
        "identical_to_hf_ar": {m: f"{a}/{n}" for m, (a, n) in same_as_hf.items()},
        "departures_from_hf_ar": dict(departures),
        "identical_to_ar": identical_to_ar(outputs, args.dtype, temperature),
        "served_overhead_ms_per_round": tally.served_overhead(args.modes),
        "overhead_per_request": api_overhead(per_request),
        "results": tally.rows(args.modes),
    }
    if runners.llama is not None:
        report["llamacpp"] = runners.llama.report(outputs, [q["bench_category"] for q in questions], args.dtype)
    if args.micro:
        engine = runners.engine
        report["forward_ms"] = forward_ms(engine)
        if engine.static_passes() is not None:  # the same passes at static shapes (CUDA graphs)
            report["forward_ms_static"] = forward_ms(engine, static=engine.static_passes())
        report["load_seconds"] = load_seconds(args.model, args.device)
        report["draft_token_ms"] = draft_token_ms(engine, [m for m in args.modes if m in MODEL_DRAFTERS],
                                                  report["forward_ms"]["1"], tokens=args.draft_length,
                                                  tree_nodes=getattr(args, "tree_budget", None))
    Path(args.out).write_text(json.dumps(report, indent=2))
    Path(args.out).with_suffix(".md").write_text(to_markdown(report))
    write_chart(report, Path(args.out).with_suffix(".png"))
    print_table(report)
    return report


def identical_to_ar(outputs: dict[str, list[list[int]]], dtype: str, temperature: float) -> dict | None:
    """Greedy, with `ar` run: per speculative mode of ours (in process or served), how many
    outputs equal our plain decoding's in the bench's dtype, the lossless contract of every
    precision (hf-ar judges float32 only)."""
    if temperature != 0 or "ar" not in outputs:
        return None
    ref = outputs["ar"]
    ours = [m for m in outputs if m != "ar" and m not in HF_MODES and m not in LLAMACPP_MODES]
    return {"dtype": dtype, **{m: f"{sum(o == r for o, r in zip(outputs[m], ref))}/{len(ref)}" for m in ours}}


def _table(report: dict) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Modes, and per category one cell per mode: "tokens/s (speedup) [mean accepted]"."""
    modes = list(dict.fromkeys(r["mode"] for r in report["results"]))
    by = {(r["mode"], r["category"]): r for r in report["results"]}
    rows = []
    for cat in dict.fromkeys(r["category"] for r in report["results"]):
        cells = []
        for m in modes:
            r = by.get((m, cat))
            cell = "" if r is None else f"{r['tokens_per_s']:.1f}"
            if r is not None and r["speedup_vs_hf_ar"] is not None and m != "hf-ar":
                cell += f" ({r['speedup_vs_hf_ar']:.2f}x)"
            if r is not None and r["mean_accepted_tokens"] is not None:
                cell += f" [{r['mean_accepted_tokens']:.2f}]"
            cells.append(cell)
        rows.append((cat, cells))
    return modes, rows


def _gap(gap: float | None) -> str:
    return "HF ended" if gap is None else f"{gap:.1e}"


def _footnotes(report: dict) -> list[str]:
    notes = []
    if report.get("identical_to_hf_ar"):
        notes.append("Outputs identical to hf-ar: " + ", ".join(f"{m} {v}" for m, v in report["identical_to_hf_ar"].items()))
    listed: dict[str, str] = {}  # a departures line: the mode it was first written for
    for mode, where in (report.get("departures_from_hf_ar") or {}).items():
        line = ", ".join(f"{d['category']} {d['token']} ({_gap(d['hf_top2_gap'])})" for d in where)
        notes.append(f"Where {mode} leaves hf-ar (token, HF's top-two logit gap there): "
                     + (f"as {listed[line]}" if line in listed else line))
        listed.setdefault(line, mode)
    if len(same := dict(report.get("identical_to_ar") or {})) > 1:
        dtype = same.pop("dtype")
        notes.append(f"Outputs identical to ar ({dtype}): " + ", ".join(f"{m} {v}" for m, v in same.items()))
    if report.get("served_overhead_ms_per_round"):
        notes.append(f"Served overhead per round (ms): {report['served_overhead_ms_per_round']}")
    if "forward_ms" in report:
        notes.append(f"One target forward (ms) by new tokens: {report['forward_ms']}")
    if "forward_ms_static" in report:
        notes.append(f"The same from static passes (CUDA graphs): {report['forward_ms_static']}")
        notes.append(f"Model load (s): {report['load_seconds']}")
    for name, d in report.get("draft_token_ms", {}).items():
        notes.append(f"One draft token of {name}: {d['ms']} ms, {d['ratio_to_target_forward']:.1%} of a target forward")
        if "tree_level_ms" in d:
            notes.append(f"One level of {name}'s greedy tree ({report['tree_budget']} nodes, "
                         f"{report['draft_length']} deep): {d['tree_level_ms']} ms, "
                         f"{d['tree_level_ratio']:.1%} of a target forward")
    return notes


def _acceptance_table(report: dict) -> list[str]:
    """Per category and drafting mode: "mean accepted tokens per pass / acceptance rate"."""
    rows = [r for r in report["results"] if r.get("acceptance_rate") is not None]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    if not modes:
        return []
    by = {(r["mode"], r["category"]): r for r in rows}
    lines = ["", "Mean accepted tokens per target pass / acceptance rate of draft tokens:", "",
             "| category | " + " | ".join(modes) + " |", "| --- |" + " ---: |" * len(modes)]
    for cat in dict.fromkeys(r["category"] for r in rows):
        cells = [f"{by[(m, cat)]['mean_accepted_tokens']:.2f} / {by[(m, cat)]['acceptance_rate']:.0%}"
                 if (m, cat) in by else "" for m in modes]
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    return lines


def to_markdown(report: dict) -> str:
    """The report as a Markdown table, for docs/BENCHMARKS.md."""
    modes, rows = _table(report)
    lines = [f"Command: `{report['command']}`", "",
             "Tokens/s (speedup vs hf-ar) [mean accepted tokens per target pass]:", "",
             "| category | " + " | ".join(modes) + " |", "| --- |" + " ---: |" * len(modes)]
    lines += [f"| {cat} | " + " | ".join(cells) + " |" for cat, cells in rows]
    lines += _acceptance_table(report)
    lines += _overhead_table(report)
    lines += agreement_lines(report)
    return "\n".join(lines + [""] + _footnotes(report)) + "\n"


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    modes, rows = _table(report)
    table = Table(title="specserve bench (greedy, tokens/s; mean accepted tokens per target pass)")
    table.add_column("category")
    for m in modes:
        table.add_column(m, justify="right")
    for cat, cells in rows:
        table.add_row(cat, *cells)
    console = Console()
    console.print(table)
    if report.get("overhead_per_request"):
        overhead = Table(title="per-request overhead by API (same prompts)")
        for i, name in enumerate(OVERHEAD_COLUMNS):
            overhead.add_column(name, justify="left" if i == 0 else "right")
        for r in report["overhead_per_request"]:
            overhead.add_row(*_overhead_cells(r))
        console.print(overhead)
    for note in _footnotes(report):
        console.print(note)
