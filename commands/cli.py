"""The `specserve` command line: one module a subcommand, each with its parser and
its `run`; nothing imports this package."""

from __future__ import annotations

import sys

from speculative.sampling import InvalidArgument

from . import bench, generate, keys, serve, train_drafter
from .args import Parser, flag

COMMANDS = {"generate": generate.run, "serve": serve.run, "bench": bench.run, "simulate": bench.run_simulate,
            "train-drafter": train_drafter.run, "keys": keys.run}


def build_parser() -> Parser:
    parser = Parser(prog="specserve", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    generate.add_parser(sub)
    serve.add_parser(sub)
    bench.add_parser(sub)
    bench.add_simulate_parser(sub)
    train_drafter.add_parser(sub)
    keys.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return COMMANDS[args.command](args)
    except InvalidArgument as e:
        print(f"specserve: error: {flag(e.field)}: {str(e).split(': ', 1)[1]}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
