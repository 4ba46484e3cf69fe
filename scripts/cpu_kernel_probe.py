"""Time the default model's 120 int4 layer products and its int8 head, a pass's worth, by
specserve's own CPU products (speculative/cpu_kernels.py) and by torch's packed kernels, for
passes of 1 to 32 rows (every torch thread; random weights of the model's shapes, each layer
its own, so that they stream from memory as a forward's do; the head after them).

    python scripts/cpu_kernel_probe.py
"""

from __future__ import annotations

import statistics
import time

import torch

from cluster.local import set_cpu_threads
from speculative import cpu_kernels
from speculative.quantize import Int4Linear, Int8Linear

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q/k/v, o, gate/up, down (out, in)
LAYERS = 30
HEAD = (49152, 576)


def median_ms(fn, repeats: int = 30) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    set_cpu_threads()
    if not cpu_kernels.available():
        raise SystemExit("specserve's CPU kernels cannot load here (see the warning above)")
    torch.manual_seed(0)
    kinds = {}
    for native in (True, False):
        layers = [Int4Linear.quantized(torch.nn.Linear(k, n, bias=False), torch.bfloat16, native=native)
                  for _ in range(LAYERS) for n, k in LAYER_SHAPES]
        head = Int8Linear.quantized(torch.nn.Linear(HEAD[1], HEAD[0], bias=False), torch.bfloat16, native=native)
        kinds["specserve" if native else "torch"] = (layers, head)
    print(f"ms a pass ({torch.get_num_threads()} torch threads): the {LAYERS * 4} int4 layer products | the int8 head")
    print(f"{'rows':>4} " + " ".join(f"{name + ' layers':>16} {name + ' head':>14}" for name in kinds))
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 6, 8, 16, 32):
            cells = []
            for layers, head in kinds.values():
                xs = [torch.randn(rows, layer.in_features) for layer in layers]
                x = torch.randn(rows, HEAD[1])
                products = median_ms(lambda: [layer(h) for layer, h in zip(layers, xs)])
                cells += [products, median_ms(lambda: ([layer(h) for layer, h in zip(layers, xs)], head(x))) - products]
            print(f"{rows:>4} " + " ".join(f"{c:>16.2f}" if i % 2 == 0 else f"{c:>14.2f}" for i, c in enumerate(cells)))

if __name__ == "__main__":
    main()
