"""The draft side of a request: its drafters (`Drafting`, whose trees are fused when there
are several), each the request held at one drafter pool (`DraftSide`), replaced when it fails."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import grpc

from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from protos.convert import params_to_pb, tree_from_pb
from speculative.calibration import Calibration
from speculative.drafter_kinds import abilities
from speculative.fusion import fuse
from speculative.pipeline import reuse_ahead
from speculative.tree import DraftTree

from ..stats import RoundStats
from .channels import RETRYABLE
from .features import FeatureLog
from .job import DeadlineExceeded, Job
from .services import Services
from .side import Side

MAX_OBSERVED = 4096  # positions kept for a drafter not asked to draft for a while (newest kept)
# tries of one Propose (another pool after a failure, a prefill after lost state); then the
# round goes undrafted rather than wait on failing pools
PROPOSE_ATTEMPTS = 3


class Drafting:
    """Every drafter of one request; the trees of several are fused into one."""

    def __init__(self, services: Services, job: Job, calibration: Callable[[str, str], Calibration] | None):
        """`calibration(kind, namespace)`: the namespace's confidence calibration of a drafter kind
        (None: greedy fusion takes the drafters' confidences as they are)."""
        self.job = job
        several = len(job.drafters) > 1
        # drafters of one request may share a pool: each needs its own id there
        # the target's features for a pool's eagle drafter (eagle_placement "pool"), None without one
        self.features = FeatureLog() if job.pool_feature_layers else None
        self.sides = [DraftSide(services, job, kind, stream=1 + i,
                                request_id=f"{job.service_id}/{kind}" if several else job.service_id,
                                features=self.features if abilities(kind).drafts_from_features else None)
                      for i, (kind, _) in enumerate(job.drafters)]
        self._threads = ThreadPoolExecutor(len(self.sides), thread_name_prefix="draft") if several else None
        # greedy fusion ranks nodes by each drafter's calibrated confidence (`speculative.calibration`)
        self.calibrations = ([calibration(kind, job.namespace) for kind, _ in job.drafters]
                             if several and job.params.greedy and calibration is not None else None)

    def propose(self, context: list[int], budgets: list[int], speculative: list[int] = ()) -> list[DraftTree]:
        """Each drafter's own tree of up to its budget (empty for one that cannot draft),
        after `context` and, drafting ahead, the unverified `speculative` tokens."""
        def one(side: DraftSide, budget: int) -> DraftTree:
            if budget <= 0:  # not asked (no prefill, no sync): it catches up when it next drafts
                return DraftTree()
            return tree_from_pb(side.propose(context, budget, speculative, self.job.tree_nodes(budget)),
                                self.job.vocab_size)

        if self._threads is None:
            return [one(self.sides[0], budgets[0])]
        return list(self._threads.map(one, self.sides, budgets))

    def seconds_per_token(self, trees: list[DraftTree]) -> list[float]:
        """Each drafter's drafting time per token of depth in its last call (0 when it drafted
        nothing): a tree's levels cost what a chain's tokens do, whatever their width."""
        return [side.seconds / max(tree.depths) if len(tree) else 0.0 for side, tree in zip(self.sides, trees)]

    def overhead(self, wall: float, budgets: list[int]) -> float:
        """What a drafting round took beyond the drafting the pools measured: the calls'
        round trips, their threads, trees (de)serialised."""
        asked = [side.seconds for side, budget in zip(self.sides, budgets) if budget > 0]
        return max(0.0, wall - max(asked, default=0.0))

    def merge(self, proposals: list[DraftTree], budgets: list[int]) -> DraftTree:
        """The tree to verify: one drafter's, cut to its node budget; several fused, each cut
        to its own, into at most `tree_budget` nodes."""
        if not proposals:
            return DraftTree()
        nodes = [self.job.tree_nodes(budget) for budget in budgets]
        if self._threads is None:
            return proposals[0].truncated(nodes[0])
        budget = max(min(self.job.tree_budget, sum(nodes)), 1)
        if self.calibrations is None:
            # a sampled fused tree keeps its draws in fuse's order: the verifier tests them in it;
            # a keyed one is fused as greedy trees are, uncalibrated (greedy verdicts teach those)
            return fuse([(tree.truncated(n), reliability) for tree, n, (_, reliability)
                         in zip(proposals, nodes, self.job.drafters)], budget, self.job.params.deterministic)
        # greedy: a calibrated confidence is already the drafter's acceptance rate at it
        return fuse([(cal.calibrated(tree.truncated(n)), 1.0)
                     for tree, n, cal in zip(proposals, nodes, self.calibrations)], budget, greedy=True)

    def learn(self, proposals: list[DraftTree], continuation: list[int]) -> None:
        """Teach the calibrations a verdict: the target's tokens after this round's context."""
        for tree, cal in zip(proposals, self.calibrations or ()):
            cal.learn(tree, continuation)

    def reuse(self, ahead: list[DraftTree], guess: list[int], accepted: list[int],
              bonus: int) -> list[DraftTree] | None:
        """The next round's trees out of those drafted ahead, or None: draft afresh."""
        kept = [reuse_ahead(tree, guess, accepted, bonus) or DraftTree() for tree in ahead]
        return kept if any(len(tree) for tree in kept) else None

    def count(self, trees: list[DraftTree], accepted: Sequence[int], stats: RoundStats) -> None:
        """Credit each drafter with its own tree's nodes and its share of the accepted path."""
        for side, tree in zip(self.sides, trees):
            stats.record_drafter(side.drafter, len(tree.tokens), tree.path_prefix(accepted))

    def take_features(self, resp: pb.VerifyResponse | pb.VerifierPrefillResponse) -> None:
        """The target's features a verifier answer carries, for a pool's eagle drafter."""
        if self.features is not None:
            self.features.add(resp)

    def observe(self, tokens: list[int], resp: pb.VerifyResponse | pb.VerifierPrefillResponse) -> None:
        """The target's candidates at the positions it scored (`tokens`: a verify's root, then
        the tree's nodes; a prefill's last tokens), kept for the drafters that learn from them
        until they next draft."""
        if not resp.candidate_ids or len(resp.candidate_ids) % len(tokens):
            return  # a verifier that did not report them: nothing to learn this round
        for side in self.sides:
            if side.services.learns_from_target(side.drafter):
                side.observe(tokens, resp.candidate_ids, resp.candidate_probs)

    def give_output(self, context: list[int]) -> None:
        """A finished request's whole context, to the drafters that learn from every output,
        however little they drafted (a drafter skipped while its length was 0 lags behind)."""
        for side in self.sides:
            if abilities(side.drafter).learns_from_outputs and side.synced < len(context):
                try:
                    side.propose(context, 0)
                except (grpc.RpcError, DeadlineExceeded):
                    pass  # best effort: the index misses one output

    def prefill_ahead(self, context: list[int]) -> None:
        """Prefill each drafter's pool with `context` from another thread, while the verifier
        prefills it: a model drafter's prefill costs about what the verifier's does, and the
        first drafted round would otherwise wait for the two one after the other."""
        for side in self.sides:
            side.prefill_ahead(context)

    def release(self) -> None:
        if self._threads is not None:
            self._threads.shutdown()  # wait: a drafter still connecting must not prefill after its release
        for side in self.sides:
            side.release()


class DraftSide(Side):
    """The drafter pool serving one drafter of a request, replaced when it fails."""

    kind = "drafter"

    def __init__(self, services: Services, job: Job, drafter: str, stream: int, request_id: str,
                 features: FeatureLog | None = None):
        super().__init__(services, job, request_id)
        self.drafter, self.stream = drafter, stream
        # the request's target features (an eagle drafter's), and how many positions' its pool holds
        self.features, self.fed = features, 0
        self.synced = 0  # context length the drafter holds
        self.seconds = 0.0  # drafting time of the last Propose, as the pool measured it
        self.disabled = drafter == "none"
        # the target's candidates since the last Propose: scored tokens, ids and probs (row-major)
        self.observed: tuple[list[int], list[int], list[float]] = ([], [], [])
        self.prefilling: Future | None = None  # a prefill sent ahead (`prefill_ahead`)

    def observe(self, tokens: Sequence[int], ids: Sequence[int], probs: Sequence[float]) -> None:
        own_tokens, own_ids, own_probs = self.observed
        own_tokens += tokens
        own_ids += ids
        own_probs += probs
        if len(own_tokens) > MAX_OBSERVED:
            k = len(own_ids) // len(own_tokens)
            cut = len(own_tokens) - MAX_OBSERVED
            self.observed = (own_tokens[cut:], own_ids[cut * k:], own_probs[cut * k:])

    def prefill_ahead(self, context: list[int]) -> None:
        """Prefill a pool with `context` from one of the coordinator's threads; the next
        `propose` (or `release`) waits for it."""
        if not self.disabled and self.stub is None and self.prefilling is None:
            self.prefilling = self.services.pool_prefills.submit(self._connect, list(context))

    def _prefilled(self) -> None:
        """Wait for the prefill sent ahead, if any; one not started yet is dropped (the caller
        prefills now). Its error, if it failed, is raised as `_connect`'s own would be."""
        pending, self.prefilling = self.prefilling, None
        if pending is not None and not pending.cancel():
            pending.result()

    def release(self) -> None:
        try:
            self._prefilled()  # a pool still prefilling must not hold the request after its release
        except (grpc.RpcError, DeadlineExceeded):
            pass  # it holds nothing then
        super().release()

    def _connect(self, context: list[int]) -> bool:
        """Prefill a pool with `context`; False when none is left."""
        for address in self.services.holdings.fewest_first(self.services.drafters()):
            if address in self.failed:
                continue
            stub = pb_grpc.DrafterStub(self.services.channels.get(address))
            req = pb.DrafterPrefillRequest(request_id=self.request_id, drafter=self.drafter, token_ids=context,
                                           sampling=params_to_pb(self.job.params), stream=self.stream,
                                           resumed=self.prefills, namespace=self.job.namespace,
                                           domain=self.job.domain or "")
            self.prefills += 1
            try:
                stub.Prefill(req, timeout=self.job.timeout())
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:  # the pool may have taken it before failing
                    self.services.release_later(stub, self.request_id)
                if e.code() not in RETRYABLE:
                    raise
                self._fail(address, e)
                continue
            self._hold(address, stub)
            self.synced = len(context)
            self.fed = 0  # a pool prefilled (again, after a failover) is sent every position's features
            return True
        return False

    def propose(self, context: list[int], budget: int, speculative: list[int] = (),
                max_nodes: int | None = None) -> pb.DraftTree:
        """A draft tree `budget` deep and at most `max_nodes` wide (None: a chain's worth) for
        `context` (and past `speculative`, drafting ahead), or an empty one (plain decoding)
        if no drafter can help."""
        for _ in range(PROPOSE_ATTEMPTS):
            self._prefilled()
            if self.disabled:
                return pb.DraftTree()
            if self.stub is None and not self._connect(context):
                self.disabled = True  # no pool left: finish with plain decoding
                return pb.DraftTree()
            req = pb.ProposeRequest(
                request_id=self.request_id, context_length=self.synced, new_tokens=context[self.synced:],
                max_tokens=budget, speculative_tokens=speculative, min_confidence=self.job.stop_confidence,
                max_nodes=max_nodes, observed_tokens=self.observed[0], observed_ids=self.observed[1],
                observed_probs=self.observed[2])
            fed = self.fed
            if self.features is not None:
                req.features_start, req.features_count, req.features = self.features.since(fed)
                fed = req.features_start + req.features_count
            try:
                resp = self.stub.Propose(req, timeout=self.job.timeout())
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE:
                    raise
                self._fail(self.address, e)
                continue
            if resp.state_lost:  # e.g. the pool restarted: prefill it again (it holds nothing now)
                self._hold(None, None)
                continue
            self.synced, self.fed = len(context), fed
            self.seconds = resp.seconds
            self.observed = ([], [], [])
            return resp.tree
        return pb.DraftTree()
