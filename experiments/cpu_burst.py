"""Take a share of one core in short bursts, as a server's other threads and processes do
beside the model it serves (docs/BENCHMARKS.md, "What the served gap is made of").

Run it beside an in-process bench to see what a little CPU taken from the model's cores
costs decoding:

    python experiments/cpu_burst.py --share 0.15 &
    specserve bench --questions ../shared/data/spec_bench/dev.jsonl --limit-per-category 2 --max-tokens 128 --modes ar suffix
    kill %1
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--share", type=float, default=0.15, help="share of one core to take, in (0, 1]")
    parser.add_argument("--burst-ms", type=float, default=2.0, help="length of each busy burst")
    args = parser.parse_args()
    if not 0 < args.share <= 1 or args.burst_ms <= 0:
        parser.error("--share must be in (0, 1] and --burst-ms positive")
    busy = args.burst_ms / 1000
    idle = busy * (1 - args.share) / args.share
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < busy:
            pass
        time.sleep(idle)


if __name__ == "__main__":
    main()
