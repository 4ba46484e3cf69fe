"""The coordinator: runs each request's rounds (`rounds.Request`) against the services it
holds, and keeps what its requests learn together (calibrations, what drafting costs)."""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Collection, Iterator

from speculative.calibration import Calibration
from speculative.namespaces import DEFAULT_NAMESPACE, Namespaces
from speculative.stopping import clip

from ..adaptive import DraftCostMemory, PassCostModel
from ..stats import RoundStats
from .channels import Channels
from .job import Cancelled, Emitted, Job
from .rounds import Request
from .services import Services


class Coordinator:
    """Runs jobs against the services that `verifiers()` and `drafters()` list."""

    def __init__(self, verifiers: Callable[[], list[str]], drafters: Callable[[], list[str]],
                 channels: Channels | None = None, pass_costs: PassCostModel | None = None,
                 service_wait_s: float = 0.0, learning_drafters: Collection[str] = (), calibrate: bool = True,
                 prior_draft_costs: Callable[[], dict[str, float]] = dict):
        """`learning_drafters`: drafter kinds the pools train online (`[drafter_pools.learner]`),
        sent the target's scores after each pass as the kinds that learn from them are.
        `calibrate`: greedy fusion ranks nodes by calibrated confidences (`[router] calibrate`).
        `prior_draft_costs`: each drafter kind's token cost as its pools measured it at start
        (router.adaptive.DraftCostMemory)."""
        # what the requests' verify and draft sides reach: the services, channels, threads
        self.services = Services(verifiers, drafters, channels or Channels(), pass_costs, service_wait_s,
                                 learning_drafters)
        # what drafting cost lately at each load: requests whose plain rounds run on the
        # verifier start from it (`Request.prefill`)
        self.draft_costs = DraftCostMemory(prior_token_costs=prior_draft_costs)
        # each namespace's confidence calibration of each drafter kind (greedy fusion), learned
        # from every request of that namespace here
        self._calibrations: Namespaces[dict[str, Calibration]] = Namespaces(lambda _: {})
        self._calibrations_lock = threading.Lock()
        self.calibrate = calibrate
        self._running = 0  # jobs running here now (`load`)
        self._running_lock = threading.Lock()

    def load(self) -> int:
        """Requests sharing each verifier if a job started now: the jobs running here and the
        new one, over the verifiers listed (the load that `draft_costs` are remembered at)."""
        with self._running_lock:
            running = self._running
        return -(-(running + 1) // max(1, len(self.services.verifiers())))

    def calibration(self, kind: str, namespace: str = DEFAULT_NAMESPACE) -> Calibration:
        kinds = self._calibrations.get(namespace)
        with self._calibrations_lock:
            return kinds.setdefault(kind, Calibration())

    def run(self, job: Job, stats: RoundStats) -> Iterator[Emitted]:
        """Yield each round's newly verified tokens (with their logprobs, when asked),
        recording into `stats`."""
        req = Request(self.services, job, stats, self.draft_costs, self.calibration if self.calibrate else None)
        finish = None
        with self._running_lock:
            self._running += 1
        try:
            while finish is None:
                if job.is_cancelled():
                    raise Cancelled()
                req.rnd += 1
                with contextlib.closing(req.rounds(job.prompt_ids + req.verified)) as rounds:
                    for new in rounds:
                        clipped, finish = clip(new, len(req.verified), job.params.max_tokens, job.eos_token_ids)
                        new = new.cut(clipped)
                        req.verified.extend(new)
                        yield new
                        if finish is not None or job.is_cancelled():
                            break  # closing `rounds` cancels a Decode call still running
        finally:
            with self._running_lock:
                self._running -= 1
            stats.finish()
            # here, not after the loop: a caller stops taking rounds at the last one, which
            # closes this generator there
            if finish is not None:
                req.drafting.give_output(job.prompt_ids + req.verified)
            req.release()

