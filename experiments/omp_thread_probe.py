"""Why a serving process keeps every thread but one at one torch thread.

Times one linear layer (576 -> 1536, the target's shape, on 6 rows) on a new
thread, after the main thread ran it with `--main-threads` torch threads
(0: the main thread runs nothing). With 2 on a 2-core machine, libgomp holds
more OpenMP threads than cores and stops spinning between parallel regions,
and the new thread's layer gets 2-3x slower (docs/DESIGN-NOTES.md).

    python experiments/omp_thread_probe.py --main-threads 2
    python experiments/omp_thread_probe.py --main-threads 0
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.nn.functional as F


def microseconds(x: torch.Tensor, w: torch.Tensor, n: int = 2000) -> float:
    with torch.inference_mode():
        for _ in range(50):
            F.linear(x, w)
        start = time.perf_counter()
        for _ in range(n):
            F.linear(x, w)
        return 1e6 * (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--main-threads", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the new thread")
    args = parser.parse_args()
    w, x = torch.randn(1536, 576), torch.randn(1, 6, 576)
    if args.main_threads:
        torch.set_num_threads(args.main_threads)
        print(f"main thread ({args.main_threads} torch threads): {microseconds(x, w):.1f} us")
    result = {}

    def on_new_thread():
        torch.get_num_threads()
        torch.set_num_threads(args.threads)
        result["us"] = microseconds(x, w)

    thread = threading.Thread(target=on_new_thread)
    thread.start()
    thread.join()
    print(f"new thread ({args.threads} torch threads): {result['us']:.1f} us")


if __name__ == "__main__":
    main()
