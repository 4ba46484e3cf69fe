"""Resident memory of one prepacked layer given every row count from 1 to --rows, through
oneDNN as one call (the raw kernel) and as `PackedLinear` runs it (slices of at most
PACKED_CHUNK_ROWS rows, padded to a few sizes); and the time of a long input both ways on
one torch thread (docs/DESIGN-NOTES.md, "A packed layer meets few shapes"). Each way runs
in a process of its own, so the other's memory does not count.

    python experiments/packed_memory_probe.py --rows 1300
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import psutil
import torch
from torch import nn

from runtime.cpu_tuning import PackedLinear


def resident_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def run(way: str, rows: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layer = PackedLinear(nn.Linear(576, 1536))
    raw = lambda x: torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")  # noqa: E731
    call = raw if way == "raw" else layer._packed
    start = resident_mb()
    with torch.inference_mode():
        for n in range(1, rows + 1):
            call(torch.randn(n, 576))
        x = torch.randn(1000, 576)
        call(x)
        begin = time.perf_counter()
        for _ in range(10):
            call(x)
        ms = (time.perf_counter() - begin) / 10 * 1e3
    print(f"| {way} | {rows} | {resident_mb() - start:.0f} | {ms:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1300)
    parser.add_argument("--way", choices=("raw", "packed"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way:
        return run(args.way, args.rows)
    print("| way | row counts run | memory grown (MB) | 1,000 rows (ms) |\n| --- | ---: | ---: | ---: |")
    for way in ("raw", "packed"):
        subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--way", way], check=True)


if __name__ == "__main__":
    main()
