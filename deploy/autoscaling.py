"""Serve autoscaling policies: each service scales on its own signal.

Every replica reports one custom metric, its load as a multiple of the load its
settings aim at (1.0 = on target): a router its requests in flight, a verifier
the share of its rows held or queued, a drafter pool the share of its time spent
drafting (deploy/app.py computes them). So drafting scales apart from
verification, CoSine's balance of the two. A policy asks for as many replicas as
it takes to bring the summed load back to 1.0 each; Serve applies the config's
min/max replicas and up/down delays around it.
"""

from __future__ import annotations

import math
from typing import Any

ROUTER_LOAD = "router_load"
VERIFIER_LOAD = "verifier_load"
DRAFTER_LOAD = "drafter_load"


def replicas_for(loads: dict[Any, float], current: int) -> int:
    """Replicas that would carry the summed load at 1.0 each; `current` while nothing is reported."""
    if not loads:
        return current
    return math.ceil(sum(loads.values()) - 1e-6)


def _policy(metric: str):
    def policy(ctx) -> tuple[int, dict]:
        loads = (ctx.aggregated_metrics or {}).get(metric, {})
        return replicas_for(loads, ctx.target_num_replicas), {}

    policy.__name__ = f"{metric}_policy"
    return policy


router_policy = _policy(ROUTER_LOAD)
verifier_policy = _policy(VERIFIER_LOAD)
drafter_policy = _policy(DRAFTER_LOAD)
