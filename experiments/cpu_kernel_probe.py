"""Time the default model's 120 layer products and its head, a pass's worth, by specserve's
own CPU products (runtime/cpu_kernels.py) and by torch's, for passes of 1 to 64 rows
(every torch thread; random weights of the model's shapes, each layer its own, so that they
stream from memory as a forward's do; the head after them; the ways' sweeps alternate, the
median of 21 each).

`--dtype int4` (the default): int4 layers and an int8 head, ours against torch's packed int
kernels. `--dtype float32`: ours against oneDNN's prepacked layers (`PackedLinear`, every row
count packed) and BLAS.

    python experiments/cpu_kernel_probe.py --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from cluster.local import set_cpu_threads
from runtime import cpu_kernels
from runtime.cpu_tuning import NativeLinear, PackedLinear
from runtime.quantize import Int4Linear, Int8Linear

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q/k/v, o, gate/up, down (out, in)
LAYERS = 30
HEAD = (49152, 576)
ROWS = (1, 2, 3, 4, 5, 6, 8, 16, 32, 64)


def int4_ways() -> dict[str, tuple[list, torch.nn.Module]]:
    ways = {}
    for native in (True, False):
        layers = [Int4Linear.quantized(torch.nn.Linear(k, n, bias=False), torch.bfloat16, native=native)
                  for _ in range(LAYERS) for n, k in LAYER_SHAPES]
        head = Int8Linear.quantized(torch.nn.Linear(HEAD[1], HEAD[0], bias=False), torch.bfloat16, native=native)
        ways["specserve" if native else "torch"] = (layers, head)
    return ways


def float32_ways() -> dict[str, tuple[list, torch.nn.Module]]:
    plain = [torch.nn.Linear(k, n, bias=False) for _ in range(LAYERS) for n, k in LAYER_SHAPES]
    head = torch.nn.Linear(HEAD[1], HEAD[0], bias=False)
    packed = [PackedLinear(m) for m in plain + [head]]
    for m in packed:
        m.one_row_blas = m.short_rows_blas = False
    blas = [lambda x, w=m.weight: F.linear(x, w) for m in plain + [head]]
    native = [NativeLinear(m) for m in plain + [head]]
    return {"specserve": (native[:-1], native[-1]), "oneDNN": (packed[:-1], packed[-1]), "BLAS": (blas[:-1], blas[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("int4", "float32"), default="int4")
    args = parser.parse_args()
    set_cpu_threads()
    if not cpu_kernels.available():
        raise SystemExit("specserve's CPU kernels cannot load here (see the warning above)")
    torch.manual_seed(0)
    ways = int4_ways() if args.dtype == "int4" else float32_ways()
    what = "int4 layer products | the int8 head" if args.dtype == "int4" else "float32 layer products | the head"
    print(f"ms a pass ({torch.get_num_threads()} torch threads): the {LAYERS * 4} {what}")
    print(f"{'rows':>4} " + " ".join(f"{name + ' layers':>16} {name + ' head':>14}" for name in ways))
    with torch.inference_mode():
        for rows in ROWS:
            xs = [torch.randn(rows, k) for _ in range(LAYERS) for _, k in LAYER_SHAPES]
            x = torch.randn(rows, HEAD[1])
            times = {name: ([], []) for name in ways}
            for i in range(22):  # the first round warms up
                for name, (layers, head) in ways.items():
                    start = time.perf_counter()
                    for layer, h in zip(layers, xs):
                        layer(h)
                    middle = time.perf_counter()
                    head(x)
                    if i:
                        times[name][0].append(middle - start)
                        times[name][1].append(time.perf_counter() - middle)
            cells = [statistics.median(t) * 1e3 for pair in times.values() for t in pair]
            print(f"{rows:>4} " + " ".join(f"{c:>16.2f}" if i % 2 == 0 else f"{c:>14.2f}" for i, c in enumerate(cells)))


if __name__ == "__main__":
    main()
