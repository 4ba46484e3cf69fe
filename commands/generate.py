"""`specserve generate`: one request, in this process or on a server."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from functools import partial
from pathlib import Path

from drafter_service.registry import DRAFTER_NAMES, check_drafter
from speculative.sampling import MAX_LOGPROBS, InvalidArgument, SamplingParams

from .args import add_model_args, prepare_once


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text in this process")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as one user message")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 disables the top-k cut")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--drafter", default=None,
                   help=f"one of {', '.join(DRAFTER_NAMES)}; several fused with '+' (e.g. pld+suffix); or the "
                        "directory of a drafter `specserve train-drafter` wrote (default pld; with --server the "
                        "router chooses)")
    g.add_argument("--draft-length", type=int, default=None,
                   help="most tokens deep a draft goes per round (default 5; 0: no speculation; with --server: "
                        "at most the server's draft_length, default the server's)")
    g.add_argument("--tree-budget", type=int, default=None,
                   help="most draft nodes verified per round (default: the draft length, a chain's worth); "
                        "tree drafters branch to fill it")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    g.add_argument("--no-calibrate", action="store_true",
                   help="fused drafters (a+b) rank their nodes by the drafters' own confidences, not calibrated "
                        "to the rates the target took them at (to measure fusion without it; not with --server: the server's [router] calibrate applies)")
    g.add_argument("--parallel-layers", type=int, default=None, metavar="N",
                   help="EasySpec: model drafters run N consecutive layers' attentions at once on the "
                        "group's input, recomputing accepted tokens exactly (default 1: exact drafting; "
                        "see docs/DRAFTERS.md)")
    g.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="split the target across N processes spawned here (tensor parallelism; gloo on "
                        "the CPU, NCCL on CUDA; default 1: one process; see docs/SERVING.md)")
    g.add_argument("--server", metavar="HOST:PORT",
                   help="generate on a specserve server instead of in this process "
                        "(--model, --device, --dtype and --tree-budget then do not apply)")
    g.add_argument("--tls", action="store_true",
                   help="with --server: use TLS (system roots, or the file in GRPC_DEFAULT_SSL_ROOTS_FILE_PATH)")
    g.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="with --server: deadline per call")
    g.add_argument("--namespace", default="",
                   help="with --server: the memory namespace whose suffix index, recycling table and drafter "
                        "statistics the request learns in and drafts from (default: the server's shared one)")
    add_output_args(g)
    add_model_args(g)


def add_output_args(g) -> None:
    """Structured output, logprobs, penalties: in this process and with --server alike."""
    structure = g.add_mutually_exclusive_group()
    structure.add_argument("--json-schema", metavar="FILE|JSON",
                           help="the output is JSON this schema validates (a file holding the schema, or its JSON)")
    structure.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    structure.add_argument("--regex", help="the output matches this regular expression whole")
    structure.add_argument("--choice", action="append", metavar="TEXT",
                           help="the output is one of these strings (give the flag once for each)")
    structure.add_argument("--grammar", metavar="FILE|LARK",
                           help="the output follows this Lark grammar (llguidance's dialect; a file or its text)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's log-probability and its N likeliest alternatives (0..20)")
    g.add_argument("--processed-logprobs", action="store_true",
                   help="logprobs of the distribution after penalties, bias and grammar (default: the target's own)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="on the prompt's and the output's tokens, > 0 (default 1: off)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit (give the flag once for each token)")
    g.add_argument("--min-tokens", type=int, default=0, help="hold the end back until the output has this many tokens")


def logit_bias(pairs: list[str]) -> tuple[tuple[int, float], ...]:
    bias = {}
    for pair in pairs:
        token, sep, value = pair.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise InvalidArgument("logit_bias", f"give ID=BIAS (e.g. 198=-100), got {pair!r}") from None
        if not sep:
            raise InvalidArgument("logit_bias", f"give ID=BIAS (e.g. 198=-100), got {pair!r}")
    return tuple(sorted(bias.items()))


def constraint(args) -> tuple[str, object] | None:
    """The structured output asked for, as (kind, spec) for speculative.grammar.Grammars.compile, or None."""
    if args.json_schema is not None:
        text = _file_or_text(args.json_schema)
        try:
            return "json_schema", json.loads(text)
        except ValueError as e:
            raise InvalidArgument("json_schema", f"neither a file nor JSON: {e}") from None
    if args.json_object:
        return "json_object", True
    if args.regex is not None:
        return "regex", args.regex
    if args.choice:
        return "choice", list(args.choice)
    if args.grammar is not None:
        return "grammar", _file_or_text(args.grammar)
    return None


def _file_or_text(value: str) -> str:
    path = Path(value)
    try:
        return path.read_text() if len(value) < 4096 and path.is_file() else value
    except OSError:
        return value


def sampling_params(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                          logit_bias=logit_bias(args.logit_bias), min_tokens=args.min_tokens,
                          logprobs=args.logprobs, processed_logprobs=args.processed_logprobs)



def run(args) -> int:
    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:
        raise InvalidArgument("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {args.logprobs}")
    params = sampling_params(args)
    params.validate()  # cheap checks before loading the model
    if args.draft_length is not None and args.draft_length < 0:
        raise InvalidArgument("draft_length", f"must be >= 0, got {args.draft_length}")
    if args.logprobs is not None and not args.json:
        raise InvalidArgument("logprobs", "are printed with --json")
    wanted = constraint(args)  # a schema that is no JSON fails before the model loads
    if args.tree_budget is not None and args.tree_budget < 0:
        raise InvalidArgument("tree_budget", f"must be >= 0, got {args.tree_budget}")
    if args.drafter is not None:
        check_drafter(args.drafter)
    if not args.prompt.strip():
        raise InvalidArgument("prompt", "must not be empty")
    if args.server and args.parallel_layers is not None:
        raise InvalidArgument("parallel_layers", "does not apply with --server: the server's "
                                                 "[drafter_pools] parallel_layers does")
    if args.server and args.no_calibrate:
        raise InvalidArgument("no_calibrate", "does not apply with --server: the server's [router] calibrate does")
    if args.server and args.tree_budget is not None:
        raise InvalidArgument("tree_budget", "does not apply with --server: the server's drafters shape their trees")
    if args.server and args.tensor_parallel is not None:
        raise InvalidArgument("tensor_parallel", "does not apply with --server: the server's "
                                                 "[verifiers] tensor_parallel does")
    if args.tensor_parallel is not None and args.tensor_parallel < 1:
        raise InvalidArgument("tensor_parallel", f"must be >= 1, got {args.tensor_parallel}")
    if args.server:
        return _generate_remote(args, params, wanted)
    if args.tls or args.timeout is not None:
        raise InvalidArgument("tls" if args.tls else "timeout", "applies only with --server")
    if args.parallel_layers is not None and args.parallel_layers < 1:
        raise InvalidArgument("parallel_layers", f"must be >= 1, got {args.parallel_layers}")
    args.drafter = args.drafter or "pld"
    from cluster.local import LocalEngine, Request

    prepare_once(args.model, args.device)
    engine = LocalEngine.load(args.model, args.device, args.dtype, args.tensor_parallel or 1)
    grammars = None
    if wanted is not None:
        from speculative.grammar import Grammars

        grammars = Grammars.for_tokenizer(engine.tokenizer, engine.model.config.vocab_size)
        params = dataclasses.replace(params, grammar=grammars.compile(*wanted, wanted[0]))
    req = Request(args.prompt, args.chat, params, args.drafter, 5 if args.draft_length is None else args.draft_length,
                  args.tree_budget, parallel_layers=args.parallel_layers or 1, calibrate=not args.no_calibrate)
    tok = engine.tokenizer
    run_request = partial(engine.run, grammars=grammars)
    if args.json:
        result = run_request(req)
    else:
        shown = ""
        so_far: list[int] = []

        def stream(new):
            nonlocal shown
            so_far.extend(new)
            text = tok.decode(so_far)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text

        result = run_request(req, on_tokens=stream)
        sys.stdout.write("\n")
        return 0
    out = {
        "text": tok.decode(result.token_ids),
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.token_ids),
        "drafter": args.drafter,
        "target_forward_passes": result.target_forward_passes,
        "mean_accepted_tokens": round(result.mean_accepted_tokens, 4),
        "draft_tokens": result.draft_tokens,
        "accepted_draft_tokens": result.accepted_draft_tokens,
        "acceptance_rate": round(result.acceptance_rate, 4),
        "seconds": round(result.seconds, 4),
        "tokens_per_s": round(len(result.token_ids) / result.seconds, 3) if result.seconds else None,
    }
    if result.logprobs is not None:
        def text(token: int) -> str:
            return tok.decode([token], skip_special_tokens=False)

        out["logprobs"] = [_logprob_json(lp.token, text(lp.token), lp.logprob,
                                         [(t, text(t), v) for t, v in lp.top]) for lp in result.logprobs]
    print(json.dumps(out))
    return 0


def _logprob_json(token: int, text: str, logprob: float, top: list[tuple[int, str, float]]) -> dict:
    """A token's logprobs as --json prints them (a token a grammar rules out: -9999.0, as OpenAI)."""
    def finite(v: float) -> float:
        return v if math.isfinite(v) else -9999.0

    return {"token": token, "text": text, "logprob": finite(logprob),
            "top": [{"token": t, "text": s, "logprob": finite(v)} for t, s, v in top]}


def _generate_remote(args, params: SamplingParams, wanted: tuple[str, object] | None) -> int:
    """`generate` through a server; gRPC errors become one line, exit 2 for bad input, else 1."""
    import grpc

    from specserve.client import Client, SpecserveError

    if args.timeout is not None and not args.timeout > 0:
        raise InvalidArgument("timeout", f"must be positive, got {args.timeout}")
    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    call = dict(prompt, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k, seed=params.seed, drafter=args.drafter or "", namespace=args.namespace,
                presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                repetition_penalty=None if params.repetition_penalty == 1.0 else params.repetition_penalty,
                logit_bias=dict(params.logit_bias), min_tokens=params.min_tokens, logprobs=params.logprobs,
                processed_logprobs=params.processed_logprobs, draft_length=args.draft_length)
    if wanted is not None:
        call[wanted[0]] = wanted[1]
    try:
        with Client(args.server, tls=args.tls, timeout=args.timeout) as client:
            if not args.json:
                for chunk in client.stream(**call):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                sys.stdout.write("\n")
                return 0
            start = time.perf_counter()
            done = client.generate(**call)
            seconds = time.perf_counter() - start
    except SpecserveError as e:
        print(f"specserve: error: {e.code.name}: {' '.join(e.details.split())}", file=sys.stderr)
        return 2 if e.code == grpc.StatusCode.INVALID_ARGUMENT else 1
    u = done.usage
    out = {
        "text": done.text,
        "token_ids": list(done.token_ids),
        "finish_reason": done.finish_reason,
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "drafter": u.drafter,
        "target_forward_passes": u.target_forward_passes,
        "mean_accepted_tokens": round(u.mean_accepted_tokens, 4),
        "draft_tokens": u.draft_tokens,
        "accepted_draft_tokens": u.accepted_draft_tokens,
        "acceptance_rate": round(u.acceptance_rate, 4),
        "seconds": round(seconds, 4),
        "tokens_per_s": round(len(done.token_ids) / seconds, 3) if seconds else None,
    }
    if done.logprobs is not None:
        out["logprobs"] = [_logprob_json(lp.token, lp.text, lp.logprob, [(t.token, t.text, t.logprob) for t in lp.top])
                           for lp in done.logprobs]
    print(json.dumps(out))
    return 0

