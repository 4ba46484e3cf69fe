"""What the router's streamed text (router/text.py) costs a round as the output grows: the
default model's tokenizer, an output of N tokens arriving 2 a round, two stop strings that
never match; the best of 3 (docs/SERVING.md, "The HTTP API").

    python experiments/streaming_text_cost.py --tokens 128 1024 4096

Another commit's router/text.py, from a worktree of it:

    PYTHONPATH=/path/to/worktree python experiments/streaming_text_cost.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from router.text import StreamingText
from runtime.loading import load_tokenizer

TEXT = Path(__file__).resolve().parents[1] / "README.md"  # English prose, code and tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 4096], help="output lengths")
    parser.add_argument("--per-round", type=int, default=2, help="tokens each round brings")
    args = parser.parse_args()
    tokenizer, _ = load_tokenizer()
    ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    ids = ids * (max(args.tokens) // len(ids) + 1)
    print(f"{'tokens':>6}  {'ms a request':>12}  {'us a round':>10}")
    for n in args.tokens:
        times = []
        for _ in range(3):
            text = StreamingText(tokenizer.decode, ["</s>", "\n\n\n"])
            start = time.perf_counter()
            for i in range(0, n, args.per_round):
                text.add(ids[i:i + args.per_round])
            text.finish()
            times.append(time.perf_counter() - start)
        best, rounds = min(times), -(-n // args.per_round)
        print(f"{n:>6}  {best * 1e3:>12.2f}  {best / rounds * 1e6:>10.1f}")


if __name__ == "__main__":
    main()
