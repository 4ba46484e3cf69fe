"""The verifier engine's resident memory over time under concurrent requests, in this
process, with no network: each client thread prefills a random prompt (20-400 tokens),
verifies random chains of 1-6 tokens until 64 tokens are generated, releases its row,
and starts again. Prints the resident memory every `--every` seconds, then the slope over
the second half (docs/RELIABILITY.md, Soak).

    python experiments/verifier_memory_probe.py --minutes 4 --clients 8
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import numpy as np
import psutil

from runtime import loading
from speculative.sampling import SamplingParams
from speculative.tree import DraftTree
from verifier_service.engine import VerifierEngine


def resident_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def client(engine: VerifierEngine, seed: int, stop: float, done: list[int]) -> None:
    rng = random.Random(seed)
    vocab = engine.vocab_size
    for n in range(10**9):
        if time.monotonic() >= stop:
            return
        request_id = f"probe-{seed}-{n}"
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randrange(20, 400))]
        engine.prefill(request_id, prompt, SamplingParams(), reserve=80)
        generated = 0
        while generated < 64:
            chain = [rng.randrange(100, vocab) for _ in range(rng.randrange(1, 7))]
            out = engine.verify(request_id, DraftTree.chain(chain))
            generated += len(out.accepted) + 1
        engine.release(request_id)
        done[0] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--every", type=float, default=20.0, help="seconds between samples")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine's worker")
    args = parser.parse_args()
    model, _ = loading.load(None)
    engine = VerifierEngine(model, threads=args.threads)
    start = time.monotonic()
    stop, done = start + 60 * args.minutes, [0]
    threads = [threading.Thread(target=client, args=(engine, k, stop, done), daemon=True) for k in range(args.clients)]
    for t in threads:
        t.start()
    samples = []
    while time.monotonic() < stop:
        samples.append((time.monotonic() - start, resident_mb()))
        print(f"{samples[-1][0]:6.0f} s  {samples[-1][1]:8.1f} MB  {done[0]} requests", flush=True)
        time.sleep(min(args.every, max(0.0, stop - time.monotonic())))
    for t in threads:
        t.join()
    engine.close()
    half = [(t, mb) for t, mb in samples if t >= 30 * args.minutes]
    if len(half) < 2:
        print(f"{done[0]} requests; too few samples for a slope (raise --minutes or lower --every)")
        return
    slope = np.polyfit([t / 60 for t, _ in half], [mb for _, mb in half], 1)[0]
    print(f"{done[0]} requests; resident memory over the second half: {half[0][1]:.0f} -> {half[-1][1]:.0f} MB, "
          f"{slope:+.1f} MB/min")


if __name__ == "__main__":
    main()
