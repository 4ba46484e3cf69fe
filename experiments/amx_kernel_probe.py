"""specserve's 8-bit-activation products alone on AMX and on VNNI (runtime/q8_amx.cpp,
docs/DESIGN-NOTES.md): the default model's gate/up (3072x576), down (576x1536) and head
(49152x576) shapes, int4 (Q4_1) and int8 (Q8_0 block scales), random weights, for each count
of rows the best of 7 runs alternated AMX off and on, in µs a call.

    OMP_NUM_THREADS=1 python experiments/amx_kernel_probe.py --rows 8 17
"""

from __future__ import annotations

import argparse
import time

import torch

from runtime import cpu_kernels

SHAPES = [(49152, 576), (3072, 576), (576, 1536)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 8, 17])
    args = parser.parse_args()
    if not cpu_kernels.available() or not cpu_kernels.amx():
        raise SystemExit("AMX does not run here")
    for out, k in SHAPES:
        q, d, m = torch.randint(0, 16, (out, k), dtype=torch.int32), torch.rand(out, k // 32) * 0.01, \
            torch.randn(out, k // 32) * 0.01
        packed = cpu_kernels.int4_pack(q, d, m)
        codes, scales = cpu_kernels.int8_pack(torch.randint(-128, 128, (out, k), dtype=torch.int8),
                                              torch.rand(out, k // 32) * 0.01)
        for rows in args.rows:
            x = torch.randn(rows, k)
            runs = {"int4": lambda: cpu_kernels.int4_linear_q8(x, packed, out),
                    "int8": lambda: cpu_kernels.int8_linear_q8(x, codes, scales, out)}
            best = {}
            for _ in range(7):
                for on in (False, True):
                    cpu_kernels.use_amx(on)
                    for name, run in runs.items():
                        run()
                        n = max(3, int(2e5 / (out * rows + 1e4)))
                        start = time.perf_counter()
                        for _ in range(n):
                            run()
                        us = (time.perf_counter() - start) / n * 1e6
                        best[name, on] = min(best.get((name, on), us), us)
            cpu_kernels.use_amx(True)
            print(f"{out}x{k}, {rows} rows: " + "; ".join(
                f"{name} VNNI {best[name, False]:.0f}, AMX {best[name, True]:.0f} µs" for name in runs), flush=True)


if __name__ == "__main__":
    main()
