"""Time one row through torch's packed int8/int4 CPU kernels against a dense layer, on
float32 and on bfloat16 input (one torch thread): why runtime/quantize.py computes its
packed layers in bfloat16 (docs/DESIGN-NOTES.md, Precision).

    python experiments/packed_kernel_probe.py
"""

from __future__ import annotations

import time

import torch

SHAPES = [(1536, 576), (576, 1536), (49152, 576)]  # the default model's MLP in/out and its head
GROUP = 32


def microseconds(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    torch.set_num_threads(1)
    print("out x in, input dtype: dense, int8, int4 (microseconds per row)")
    for n, k in SHAPES:
        w = torch.randn(n, k)
        scale = w.abs().amax(1) / 127
        w8 = (w / scale[:, None]).round().to(torch.int8)
        w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 2)
        for dtype in (torch.float32, torch.bfloat16):
            x, dense = torch.randn(1, k, dtype=dtype), w.to(dtype)
            scales_and_zeros = torch.randn(k // GROUP, n, 2, dtype=dtype)
            times = [microseconds(lambda: torch.nn.functional.linear(x, dense)),
                     microseconds(lambda: torch._weight_int8pack_mm(x, w8, scale.to(dtype))),
                     microseconds(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w4, GROUP, scales_and_zeros))]
            print(f"{n} x {k}, {str(dtype).removeprefix('torch.')}: " + ", ".join(f"{t:.0f}" for t in times))


if __name__ == "__main__":
    main()
