"""What the eagle chain's confidence stop buys (speculative.eagle.STOP_BELOW): greedy, the first
dev question of each category, plain decoding, prompt lookup and `eagle` chains with several
stops (and a 8-node tree), each config twice in turn, in one process.

    python experiments/eagle_stop_probe.py
"""

import json
import time

from cluster.local import LocalEngine, Request
from speculative import eagle
from speculative.sampling import SamplingParams

CONFIGS = [("none", 0.0, None, 5), ("pld", 0.0, None, 5), ("eagle", 0.0, None, 5), ("eagle", 0.2, None, 5),
           ("eagle", 0.4, None, 5), ("eagle", 0.4, None, 8), ("eagle", 0.0, 8, 4)]


def main() -> None:
    questions = {}
    for line in open("../shared/data/spec_bench/dev.jsonl"):
        q = json.loads(line)
        questions.setdefault(q["category"], q)
    engine = LocalEngine.load(None)
    params = SamplingParams(temperature=0.0, max_tokens=128)

    def run(mode, stop, budget, depth):
        eagle.STOP_BELOW = stop  # read by each new EagleDrafter
        tokens = seconds = passes = 0
        for q in questions.values():
            start = time.perf_counter()
            r = engine.run(Request(q["turns"][0], True, params, mode, depth, budget))
            seconds += time.perf_counter() - start
            tokens, passes = tokens + len(r.token_ids), passes + r.target_forward_passes
        return tokens / seconds, tokens / passes

    run("none", 0.0, None, 5)  # warm-up
    for repeat in range(2):
        for mode, stop, budget, depth in CONFIGS:
            tps, per_pass = run(mode, stop, budget, depth)
            print(f"{repeat} {mode} stop {stop} tree budget {budget} depth {depth}: {tps:.1f} tokens/s, "
                  f"{per_pass:.2f} tokens a pass", flush=True)


if __name__ == "__main__":
    main()
