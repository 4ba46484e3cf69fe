"""`specserve generate`: one request, in this process or on a server."""

from __future__ import annotations

import json
import sys
import time

from drafter_service.registry import DRAFTER_NAMES, check_drafter
from speculative.sampling import InvalidArgument, SamplingParams

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
    g.add_argument("--draft-length", type=int, default=5, help="most tokens deep a draft goes per round")
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
                        "(--model, --device, --dtype, --draft-length and --tree-budget then do not apply)")
    g.add_argument("--tls", action="store_true",
                   help="with --server: use TLS (system roots, or the file in GRPC_DEFAULT_SSL_ROOTS_FILE_PATH)")
    g.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="with --server: deadline per call")
    g.add_argument("--namespace", default="",
                   help="with --server: the memory namespace whose suffix index, recycling table and drafter "
                        "statistics the request learns in and drafts from (default: the server's shared one)")
    add_model_args(g)


def sampling_params(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)



def run(args) -> int:
    params = sampling_params(args)
    params.validate()  # cheap checks before loading the model
    if args.draft_length < 0:
        raise InvalidArgument("draft_length", f"must be >= 0, got {args.draft_length}")
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
    if args.server and args.tensor_parallel is not None:
        raise InvalidArgument("tensor_parallel", "does not apply with --server: the server's "
                                                 "[verifiers] tensor_parallel does")
    if args.tensor_parallel is not None and args.tensor_parallel < 1:
        raise InvalidArgument("tensor_parallel", f"must be >= 1, got {args.tensor_parallel}")
    if args.server:
        return _generate_remote(args, params)
    if args.tls or args.timeout is not None:
        raise InvalidArgument("tls" if args.tls else "timeout", "applies only with --server")
    if args.parallel_layers is not None and args.parallel_layers < 1:
        raise InvalidArgument("parallel_layers", f"must be >= 1, got {args.parallel_layers}")
    args.drafter = args.drafter or "pld"
    from cluster.local import LocalEngine, Request

    prepare_once(args.model, args.device)
    engine = LocalEngine.load(args.model, args.device, args.dtype, args.tensor_parallel or 1)
    req = Request(args.prompt, args.chat, params, args.drafter, args.draft_length, args.tree_budget,
                  parallel_layers=args.parallel_layers or 1, calibrate=not args.no_calibrate)
    tok = engine.tokenizer
    if args.json:
        result = engine.run(req)
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

        result = engine.run(req, on_tokens=stream)
        sys.stdout.write("\n")
        return 0
    print(json.dumps({
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
    }))
    return 0


def _generate_remote(args, params: SamplingParams) -> int:
    """`generate` through a server; gRPC errors become one line, exit 2 for bad input, else 1."""
    import grpc

    from specserve.client import Client, SpecserveError

    if args.timeout is not None and not args.timeout > 0:
        raise InvalidArgument("timeout", f"must be positive, got {args.timeout}")
    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    call = dict(prompt, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k, seed=params.seed, drafter=args.drafter or "", namespace=args.namespace)
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
    print(json.dumps({
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
    }))
    return 0

