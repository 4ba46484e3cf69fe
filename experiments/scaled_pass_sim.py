"""The simulator against a validation report's levels with each level's verification pass as it was
served there: the fitted pass cost scaled to the measured mean pass at the measured rows and tokens a
row. What is left of the error is outside the pass (docs/lab/simulator-validation.md, two verifier nodes).

    python experiments/scaled_pass_sim.py run5.json run5.fitted.costs.json --verifiers 2
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench.simulator import costs_from_dict  # noqa: E402
from validate_simulator import DRAFT_LENGTH, replicate, sim_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="scripts/netns_cluster.py validate --json's report")
    parser.add_argument("costs", help="its fitted costs (.fitted.costs.json)")
    parser.add_argument("--verifiers", type=int, default=2, help="the levels of this many verifier nodes")
    parser.add_argument("--drafter", default="pld")
    parser.add_argument("--rate", type=float, default=0.5)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    fitted = json.loads(Path(args.costs).read_text())
    v = fitted["verify_pass"]
    print("| delay ms | clients | pass scale | measured tokens/s | simulated, pass as served | error |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in json.loads(Path(args.report).read_text())["rows"]:
        if r.get("verifiers", 1) != args.verifiers:
            continue
        rows, tokens = r["measured_mean_batch_rows"], r.get("measured_row_tokens") or 1 + DRAFT_LENGTH
        scale = r["measured_pass_ms"] / (v["base_ms"] + (v["row_ms"] + v["token_ms"] * tokens) * rows)
        costs = copy.deepcopy(fitted)
        for k in ("base_ms", "row_ms", "token_ms"):
            costs["verify_pass"][k] = v[k] * scale
        sim = replicate(costs_from_dict(costs), sim_config(args, r["pools"], r["clients"], r["delay_ms"],
                                                            args.verifiers), args.repeats)["tokens_per_s"]
        print(f"| {r['delay_ms']:g} | {r['clients']} | {scale:.2f} | {r['measured_tokens_per_s']:.2f} | {sim:.2f} | "
              f"{sim / r['measured_tokens_per_s'] - 1:+.1%} |")


if __name__ == "__main__":
    main()
