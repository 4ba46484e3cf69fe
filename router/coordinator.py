"""Drive one request through draft/verify rounds over gRPC (sequential rounds).

The verifier owns the request's KV cache and the pending (last verified)
token; each drafter keeps its own context, which the coordinator keeps in
step by sending only the tokens verified since the last round.

`Coordinator.run` is the loop, shaped as the in-process one
(`speculative.decoding.generate`): a round prefills (the first, or to
resume) or drafts, verifies and learns, each a step of the request's
`_Request`; `speculative.stopping.clip` ends the output where the in-process
loop would.

A request drafted by prompt lookup or the suffix drafter, or decoded plainly,
can run its rounds on the verifier itself (`Job.verifier_drafting`, the Decode
call): the verifier drafts from the request's text (prompt lookup) or from a
suffix index of the texts of its requests in the request's memory namespace,
this one's included (verifier_service.drafting), and streams each round's
verdict back, with no hop to a pool or back to the router between rounds; the
router clips, counts and forwards the rounds as they come. Any other request
that is not pipelined runs its rounds on the verifier the same way while
adaptive lengths give none of its pool drafters (all but those two) a draft:
drafted there by the first of its drafters the verifier runs, if any (at the
length its control chooses for a draft that asks no pool), else plain (the
target's candidates come back each round for a drafter that learns from them).

A request has one drafter or several. One drafter's tree goes to the
verifier as it is. Several drafters are all asked each round (at the same
time, from a small thread pool), and their trees are fused into one
(`speculative.fusion.fuse`: shared prefixes merged, nodes weighted by each
drafter's reliability on the request's domain, at most `tree_budget` nodes)
that the verifier checks in one pass. Each of them is a request of its own
in its pool, with its own id (`request_id/kind`) and its own random stream
(drafter i draws from stream 1 + i): fused sampling is exact only when the
drafters draw independently (docs/DESIGN-NOTES.md, invariant 5). Every
drafter's own proposed and accepted tokens are counted, so that routing
learns which drafter earned the accepted tokens.

Pipelined (`Job.pipelined`, PEARL's post-verify across processes): while the
verifier checks a round's tree, the drafters already draft the next round
past the tree's likeliest path (`speculative.pipeline`); when the verdict
keeps that path, the next round's tree is ready at once, else the work is
dropped and the round drafts as usual. With adaptive speculation
(`router.adaptive`) the draft length follows each request's acceptance and the
verifier's load; a length of 1 when acceptance is poor is pre-verify: the
first draft token goes to the verifier while the rest is drafted ahead. Every
draft and verify call is timed into the request's trace, which shows the
overlap and gives each side's idle fraction.

Failures degrade, never corrupt: a drafter that dies or lost its state is
replaced (another pool, or no drafting at all: an empty tree, also inside a
fusion), and a verifier that lost the request is prefilled again with every
verified token. Both keep the output exactly the target's, because only the
verifier decides tokens and a request prefilled again draws from a fresh
random stream (`resumed`; docs/DESIGN-NOTES.md, invariant 5).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterator, Sequence

import grpc

from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from protos.convert import params_to_pb, tree_from_pb, tree_to_pb
from protos.server import CLUSTER_SECRET_METADATA
from speculative.calibration import Calibration, enabled as calibration_enabled
from speculative.drafter_kinds import VERIFIER_DRAFTERS, abilities
from speculative.fusion import fuse
from speculative.namespaces import DEFAULT_NAMESPACE, Namespaces
from speculative.pipeline import likeliest_path, reuse_ahead
from speculative.recycling import CANDIDATES
from speculative.sampling import SamplingParams
from speculative.stopping import clip
from speculative.tree import DraftTree, nodes_for_depth

from .adaptive import DraftCostMemory, PassCostModel, SpeculationControl
from .row_line import Place, RowLine
from .stats import RoundStats

log = logging.getLogger(__name__)

# KV slots a request reserves at the verifier past its prompt, its whole output and its
# largest tree: a small margin (a round's root token needs one); the router's context limit
# leaves the same room (cluster/actors.py)
SPARE_SLOTS = 4
# how often a request waiting for a verifier looks at the registry again
SERVICE_POLL_S = 0.2
# rounds of one Decode call: then the router chooses the draft length again, for the load then
DECODE_ROUNDS = 16
MAX_OBSERVED = 4096  # positions kept for a drafter not asked to draft for a while (newest kept)
# tries of one Propose (another pool after a failure, a prefill after lost state); then the
# round goes undrafted rather than wait on failing pools
PROPOSE_ATTEMPTS = 3
# pipelined rounds' verify calls: one in flight per request, with room to spare over the
# requests a router serves at once (router.servicer.serve's threads)
VERIFY_CALL_THREADS = 64
# pools' prefills sent ahead: one per drafter of a request just starting; a prefill not
# started when the request first drafts is sent then instead
POOL_PREFILL_THREADS = 16

# gRPC failures after which another replica (or no drafting) is the answer
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.RESOURCE_EXHAUSTED}


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                             "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _WithSecret(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the cluster secret to the metadata of every call on a channel."""

    def __init__(self, secret: str):
        self._entry = (CLUSTER_SECRET_METADATA, secret)

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(details.method, details.timeout, [*(details.metadata or ()), self._entry],
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


class Channels:
    """One cached gRPC channel per address; with the cluster's `secret`, every call on them
    carries it (the verifiers and drafter pools of `specserve serve` refuse calls without)."""

    def __init__(self, secret: str | None = None):
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()  # requests, and the drafters of one request, share the channels
        self._secret = _WithSecret(secret) if secret is not None else None

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                # a subchannel of its own: gRPC shares one per address between channels by default,
                # with its reconnect backoff, so a channel made after `drop` would fail at once for a
                # service restarted at the same address (or a new one on a reused port)
                channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                if self._secret is not None:
                    channel = grpc.intercept_channel(channel, self._secret)
                self._channels[address] = channel
            return self._channels[address]

    def drop(self, address: str) -> None:
        """Forget the address's channel, so that the next `get` dials afresh. Not closed:
        other requests, or other drafters of the same one, may still have calls on it
        (closing would cancel them); it is freed when its last stub goes."""
        with self._lock:
            self._channels.pop(address, None)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()


class DeadlineExceeded(Exception):
    pass


class Cancelled(Exception):
    pass


class NoService(Exception):
    """No live service of a kind is left to try."""


@dataclass
class Job:
    request_id: str  # the client's (or a new) id, echoed in the answer
    prompt_ids: list[int]
    params: SamplingParams
    # (kind, reliability on the request's domain in [0, 1]) of each drafter, best first;
    # (("none", 1.0),) for plain decoding. Reliability weighs a drafter's nodes in fusion.
    drafters: tuple[tuple[str, float], ...]
    draft_length: int  # most tokens a drafter drafts per round
    tree_budget: int  # most nodes of a round's tree (fused, or one tree drafter's) at full draft length
    vocab_size: int  # the target's: fusion reads the drafters' trees back from the wire
    eos_token_ids: Sequence[int]
    deadline: float | None = None  # time.monotonic() value
    domain: str | None = None  # the request's domain, when the router knows it
    is_cancelled: Callable[[], bool] = lambda: False
    pipelined: bool = False  # draft each next round while this one is verified
    speculation: SpeculationControl | None = None  # adaptive draft length; None: always draft_length
    stop_confidence: float = 0.0  # model drafters stop after a token drafted with less confidence
    namespace: str = DEFAULT_NAMESPACE  # the memory its drafters learn in (speculative.namespaces)
    # rounds only drafters the verifier runs draft (prompt lookup, suffix, none): the verifier
    # may run them itself (Decode)
    verifier_drafting: bool = False
    # prefill the drafters' pools while the verifier prefills (pools with hardware of their own)
    prefill_pools_ahead: bool = False
    # the request's key at the verifiers, pools and checkpoints: unique, whatever id clients send
    service_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def max_tree_nodes(self) -> int:
        """The most nodes a round's tree can have."""
        return max(self.tree_budget, self.draft_length)

    def tree_nodes(self, length: int) -> int:
        """Most nodes of a drafter's tree `length` deep: the tree budget in proportion to the
        length (adaptive speculation shortens both), and at least a chain's worth."""
        return nodes_for_depth(length, self.draft_length, self.tree_budget)


class Coordinator:
    """Runs jobs against the services that `verifiers()` and `drafters()` list."""

    def __init__(self, verifiers: Callable[[], list[str]], drafters: Callable[[], list[str]],
                 channels: Channels | None = None, pass_costs: PassCostModel | None = None,
                 service_wait_s: float = 0.0, learning_drafters: Collection[str] = ()):
        """`learning_drafters`: drafter kinds the pools train online (`[drafter_pools.learner]`),
        sent the target's scores after each pass as the kinds that learn from them are."""
        self.verifiers, self.drafters = verifiers, drafters
        self.learning_drafters = frozenset(learning_drafters)
        # how long a request waits for a verifier to be listed before it fails UNAVAILABLE
        self.service_wait_s = service_wait_s
        self.channels = channels or Channels()
        # what verification passes cost, learned from every verdict here (adaptive lengths read it)
        self.pass_costs = pass_costs
        # what drafting cost lately at each load: requests whose plain rounds run on the
        # verifier start from it (`_Request.prefill`)
        self.draft_costs = DraftCostMemory()
        # each namespace's confidence calibration of each drafter kind (greedy fusion), learned
        # from every request of that namespace here
        self._calibrations: Namespaces[dict[str, Calibration]] = Namespaces(lambda _: {})
        self._calibrations_lock = threading.Lock()
        # pipelined rounds send their verify calls from here while their own thread drafts ahead
        self.calls = ThreadPoolExecutor(max_workers=VERIFY_CALL_THREADS, thread_name_prefix="verify-call")
        # pools' prefills sent while the verifier prefills (`Job.prefill_pools_ahead`)
        self.pool_prefills = ThreadPoolExecutor(max_workers=POOL_PREFILL_THREADS, thread_name_prefix="pool-prefill")
        self.row_line = RowLine(SERVICE_POLL_S)  # prefills waiting for a verifier row, in arrival order
        self._running = 0  # jobs running here now (`load`)
        self._running_lock = threading.Lock()

    def load(self) -> int:
        """Requests sharing each verifier if a job started now: the jobs running here and the
        new one, over the verifiers listed (the load that `draft_costs` are remembered at)."""
        with self._running_lock:
            running = self._running
        return -(-(running + 1) // max(1, len(self.verifiers())))

    def learns_from_target(self, kind: str) -> bool:
        """Whether drafter `kind`'s pools are sent the target's scores at the positions it scored."""
        return abilities(kind).learns_from_target or kind in self.learning_drafters

    def calibration(self, kind: str, namespace: str = DEFAULT_NAMESPACE) -> Calibration:
        kinds = self._calibrations.get(namespace)
        with self._calibrations_lock:
            return kinds.setdefault(kind, Calibration())

    def timeout(self, job: Job) -> float | None:
        """Seconds left before the job's deadline, for the next downstream call."""
        if job.deadline is None:
            return None
        left = job.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded()
        return left

    def release(self, stub, request_id: str, learn: Sequence[int] = (), namespace: str = DEFAULT_NAMESPACE) -> None:
        """Release a request at a service (best effort); a verifier's suffix index of
        `namespace` learns the text `learn` first, if any."""
        request = pb.ReleaseRequest(request_id=request_id, learn_token_ids=learn, namespace=namespace)
        try:
            stub.Release(request, timeout=2.0)
        except grpc.RpcError:
            pass  # best effort: idle timeouts reclaim what we could not release

    def run(self, job: Job, stats: RoundStats) -> Iterator[list[int]]:
        """Yield each round's newly verified tokens, recording into `stats`."""
        req = _Request(self, job, stats)
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
                        new, finish = clip(new, len(req.verified), job.params.max_tokens, job.eos_token_ids)
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


def _load(resp: pb.VerifyResponse) -> int:
    """Requests sharing the verifier, from a verdict: those of its pass and queued, and those it
    holds between rounds (drafting, on the wire), which the next passes will carry too."""
    return max(1, resp.batch_size + resp.queued, resp.active_requests)


@dataclass
class _Draft:
    """One round's draft, as the steps after drafting need it."""
    room: int  # draft tokens the request has room for before this round's bonus token
    lengths: list[int]  # each drafter's draft length this round
    budgets: list[int]  # ... cut to the room
    proposals: list[DraftTree] = field(default_factory=list)  # each drafter's own tree; none when none drafts
    tree: DraftTree = field(default_factory=DraftTree)  # what the verifier checks
    costs: list[float] | None = None  # each drafter's seconds per token of depth, when drafted this round
    round_cost: float | None = None  # what the drafting call cost beyond the drafters' own time
    verify_seconds: float = 0.0  # the verify call's, once answered


class _Request:
    """One request's rounds, a method per step (prefill, draft, verify, learn), and what
    they carry from one round to the next."""

    def __init__(self, coord: Coordinator, job: Job, stats: RoundStats):
        self.coord, self.job, self.stats = coord, job, stats
        self.verified: list[int] = []  # generated tokens; the last one is pending at the verifier
        self.verifier, self.drafting = _VerifySide(coord, job), _Drafting(coord, job)
        # adaptive speculation: one control per drafter, each learning its own acceptance
        self.controls = None if job.speculation is None else [
            dataclasses.replace(job.speculation, prior=reliability) if len(job.drafters) > 1 else job.speculation
            for _, reliability in job.drafters]
        self.ready: list[DraftTree] | None = None  # each drafter's tree for this round, drafted ahead
        self.candidates = CANDIDATES if any(coord.learns_from_target(kind) for kind, _ in job.drafters) else 0
        self.rnd, self.load = 0, 1  # round; requests sharing the verifier
        # rounds the verifier runs itself (Decode): those that ask no drafter only a pool runs
        # (the load makes none pay, or the request's own draft is one the verifier makes; plain
        # ones bring back the target's candidates for the drafters that learn from them), and
        # every one when each of the request's drafters is one the verifier runs
        self.plain_on_verifier = job.verifier_drafting and not job.pipelined
        self.own_rounds = (self.plain_on_verifier and not self.candidates
                           and all(kind in VERIFIER_DRAFTERS for kind, _ in job.drafters))
        # what those rounds draft with: the request's best drafter that the verifier runs
        self.verifier_drafter = next((kind for kind, _ in job.drafters if kind in VERIFIER_DRAFTERS), "none")

    def rounds(self, context: list[int]) -> Iterator[list[int]]:
        """The next round's new tokens, or the verifier's own rounds' one by one; none when the
        verifier lost the request (the next round prefills it again)."""
        if not self.verified or self.verifier.stub is None:
            yield self.prefill(context)  # the first round, or the verifier lost the request
        elif self.own_rounds:
            yield from self.decode(context)
        else:
            draft = self.plan()
            if self.plain_on_verifier and not self.asks_pools(draft):
                # no pool drafter's draft pays now: rounds on the verifier, drafted there (no
                # pool, no hop) by the request's drafter it runs, if any, else plain
                yield from self.decode(context)
                return
            self.draft(context, draft)
            verdict = self.verify(context, draft)
            if verdict is not None:
                yield self.learn(context, draft, verdict)

    def prefill(self, context: list[int]) -> list[int]:
        """Prefill every verified token; the answer is the next token, exactly as a round
        would give it."""
        if not self.verified and self.job.prefill_pools_ahead and not self.own_rounds:
            self.drafting.prefill_ahead(context)
        with self.stats.span("prefill", self.rnd):
            prefilled = self.verifier.prefill(context, self.candidates)
        self.ready, self.load = None, max(1, self.verifier.active_requests)
        if not self.verified and self.plain_on_verifier:
            # what drafting costs at this load, where a drafted round pays a hop plain rounds do not
            for c, (kind, _) in zip(self.controls or (), self.job.drafters):
                self.coord.draft_costs.start(c, kind, self.load)
        seeded = len(prefilled.candidate_ids) // self.candidates if self.candidates else 0
        if seeded:  # the target's predictions after the prompt's last tokens
            self.drafting.observe(context[len(context) - seeded:], prefilled)
        self.stats.record_prefill()
        return [prefilled.next_token]

    def decode(self, context: list[int]) -> Iterator[list[int]]:
        """Rounds the verifier runs on its own (Decode), up to DECODE_ROUNDS, each round's new
        tokens as it ends, drafted by the request's drafter it runs at the length that
        drafter's control chooses at the start (plain if that is 0). Plain rounds bring back
        the target's candidates at each round's token, for the drafters that learn from them.
        Stops early when the verifier loses the request: the next round prefills it again."""
        job = self.job
        kind = self.verifier_drafter
        control, length = None, 0
        if kind != "none":
            i = [k for k, _ in job.drafters].index(kind)
            control = self.controls[i] if self.controls else None
            length = job.draft_length if control is None else control.length(self.load, drafted_by_verifier=True)
        # a verifier drafter's control that chose no draft: each of the call's rounds after the
        # first, which its choice was for, counts towards its next probe (a probe here pays no hop)
        undrafted = control if length == 0 else None
        if length == 0:
            kind, control = "none", None
        candidates = self.candidates if kind == "none" else 0  # the caller knows no drafted round's tree
        started, root = time.monotonic(), context[-1]
        nodes = job.tree_nodes(length) if kind == "suffix" else 0
        for n, resp in enumerate(self.verifier.decode(context, kind, length, nodes,
                                                      job.params.max_tokens - len(self.verified), candidates)):
            self.stats.record_span("verify", self.rnd, started, started := time.monotonic())
            if candidates:
                self.drafting.observe([root], resp)
                root = resp.bonus
            self.stats.record_draft_length(length)
            self.stats.record_round(resp.drafted, len(resp.accepted), resp.batch_size)
            if kind != "none":
                self.stats.record_drafter(kind, resp.drafted, len(resp.accepted))
            if control is not None:
                control.record(resp.drafted_depth, len(resp.accepted))
                control.observe_tree(resp.drafted, resp.drafted_depth)
            self.load = _load(resp)
            self.rnd += 1
            if undrafted is not None and n:  # rounds after the first
                undrafted.plain_rounds(1)
            yield [*resp.accepted, resp.bonus]

    def plan(self) -> _Draft:
        """This round's draft lengths, as the controls choose them for the load, cut to the room."""
        job = self.job
        room = job.params.max_tokens - len(self.verified) - 1
        lengths = ([job.draft_length] * len(job.drafters) if self.controls is None
                   else [c.length(self.load) for c in self.controls])
        return _Draft(room, lengths, [max(0, min(n, room)) for n in lengths])

    def asks_pools(self, draft: _Draft) -> bool:
        """Whether the planned round asks a drafter that only a pool runs: prompt lookup and the
        suffix drafter are drafted as well by the verifier, without the pool's call and the
        verify call's hop."""
        return any(n and kind not in VERIFIER_DRAFTERS for (kind, _), n in zip(self.job.drafters, draft.budgets))

    def draft(self, context: list[int], draft: _Draft) -> None:
        """Each drafter's tree for the planned round (those drafted ahead, if the last verdict
        kept them), and the tree to verify."""
        self.stats.record_draft_length(max(draft.budgets))
        if not any(draft.budgets):
            # nothing to draft: the round verifies the bonus token alone, and a tree drafted
            # ahead for this round's context would be one token behind the next round's
            self.ready = None
        elif self.ready is not None:
            draft.proposals, self.ready = self.ready, None
            self.stats.record_reuse()
        else:
            with self.stats.span("draft", self.rnd) as span:
                draft.proposals = self.drafting.propose(context, draft.budgets)
            draft.costs = self.drafting.seconds_per_token(draft.proposals)
            draft.round_cost = self.drafting.overhead(span.seconds, draft.budgets)
        draft.tree = self.drafting.merge(draft.proposals, draft.budgets)

    def verify(self, context: list[int], draft: _Draft) -> pb.VerifyResponse | None:
        """The verdict on the round's tree, or None when the request must be prefilled again.
        Pipelined, the drafters draft the next round meanwhile."""
        guess = [draft.tree.tokens[n] for n in likeliest_path(draft.tree)] if self.job.pipelined else []
        ahead = draft.room - len(guess) - 1  # room left past a whole accepted guess and its bonus
        if self.job.pipelined and len(draft.tree) and ahead > 0:
            resp = self._verify_drafting_ahead(context, draft, guess, ahead)
        else:
            with self.stats.span("verify", self.rnd) as span:
                resp = self.verifier.verify(draft.tree, len(context), self.candidates)
            draft.verify_seconds = span.seconds
        if resp is None:
            self.ready = None
        return resp

    def _verify_drafting_ahead(self, context: list[int], draft: _Draft, guess: list[int],
                               ahead: int) -> pb.VerifyResponse | None:
        """Verify from another thread while the drafters draft the next round past `guess`
        (the tree's likeliest path); keep that draft if the verdict allows."""
        call = self.verifier.verify_async(draft.tree, len(context), self.candidates)
        with self.stats.span("ahead", self.rnd):
            drafted_ahead = self.drafting.propose(context, [min(n, ahead) for n in draft.lengths], speculative=guess)
        resp = self.verifier.result(call)
        draft.verify_seconds = self.stats.record_span("verify", self.rnd, call.started, call.ended).seconds
        if resp is not None:
            self.ready = self.drafting.reuse(drafted_ahead, guess, list(resp.accepted), resp.bonus)
            for c in self.controls or ():
                c.reused(self.ready is not None)
        return resp

    def learn(self, context: list[int], draft: _Draft, resp: pb.VerifyResponse) -> list[int]:
        """Teach the verdict to all that learn from it (drafters that learn from the target's
        scores, the fusion's calibrations, the stats, the adaptive controls); returns the
        round's new tokens."""
        if self.candidates:
            self.drafting.observe([context[-1]] + draft.tree.tokens, resp)
        new = list(resp.accepted) + [resp.bonus]
        self.drafting.learn(draft.proposals, new)
        self.stats.record_round(len(draft.tree), len(resp.accepted), resp.batch_size)
        self.drafting.count(draft.proposals, resp.accepted, self.stats)
        self._adapt(draft, resp)
        self.load = _load(resp)
        return new

    def _adapt(self, draft: _Draft, resp: pb.VerifyResponse) -> None:
        """Each drafter's control learns its acceptance and what drafting and verifying cost,
        against a one-row, one-token pass (from the pass the verdict reports). When a round
        with no draft would run on the verifier (Decode), a drafted round also pays its verify
        call's hop: the round trip and the wait for the pass in flight."""
        if not self.controls:
            return
        hop = max(0.0, draft.verify_seconds - resp.pass_seconds) if self.plain_on_verifier else 0.0
        # a one-row, one-token pass's seconds (every control has the same verify costs)
        unit = (resp.pass_seconds / self.controls[0].pass_units(resp.batch_size, resp.pass_tokens, resp.pass_width)
                if resp.pass_seconds > 0 else draft.verify_seconds)
        for i, (c, own) in enumerate(zip(self.controls, draft.proposals)):
            if len(own):  # how deep the accepted path went in the drafter's own tree
                depth = max(own.depths)
                c.record(depth, own.path_prefix(resp.accepted))
                c.observe_tree(len(own), depth)
            if draft.costs and draft.costs[i]:
                c.observe(draft.costs[i], unit)
            if draft.round_cost is not None and draft.budgets[i] > 0:
                c.observe_round(draft.round_cost + hop, unit)
                if self.plain_on_verifier:  # at the load its length was chosen for
                    self.coord.draft_costs.remember(c, self.job.drafters[i][0], self.load)

    def release(self) -> None:
        self.drafting.release()
        # the verifier's suffix index learns every suffix request's text, however its rounds
        # were drafted (through the pools, pipelined), as the pools' index does (give_output)
        learns = any(kind == "suffix" for kind, _ in self.job.drafters)
        self.verifier.release(self.job.prompt_ids + self.verified if learns else ())


class _Side:
    """The service of one kind holding one request; failed replicas are not tried again."""

    kind = ""

    def __init__(self, coord: Coordinator, job: Job, request_id: str | None = None):
        self.coord, self.job = coord, job
        self.request_id = request_id or job.service_id  # the request's id at the service
        self.address: str | None = None
        self.stub = None
        self.failed: set[str] = set()
        self.full: set[str] = set()  # verifiers that answered "every row taken" in this pass over them
        # prefills sent so far: each later one asks for a fresh random stream (`make_generator`'s
        # `resumed`), since the request's tokens so far were chosen by its stream's first draws
        self.prefills = 0

    def _fail(self, address: str, err: grpc.RpcError) -> None:
        log.warning("%s %s failed for %s (%s); trying another", self.kind, address, self.request_id, err.code())
        self.failed.add(address)
        self.coord.channels.drop(address)
        if self.address == address:
            self.address, self.stub = None, None

    def release(self) -> None:
        if self.stub is not None:
            self.coord.release(self.stub, self.request_id)


class _VerifySide(_Side):
    """The verifier holding one request, replaced when it fails."""

    kind = "verifier"
    active_requests = 0  # the verifier's load when it last answered a prefill

    def prefill(self, tokens: list[int], candidates: int = 0) -> pb.VerifierPrefillResponse:
        """The answer holds the target's next token (and, with `candidates`, its top candidates
        after the last tokens)."""
        reserve = len(tokens) + self.job.params.max_tokens + self.job.max_tree_nodes + SPARE_SLOTS
        with self.coord.row_line.place() as place:
            return self._prefill(place, tokens, candidates, reserve)

    def release(self, text: Sequence[int] = ()) -> None:
        """Release the request, its `text` (prompt and output) to the verifier's suffix index."""
        if self.stub is not None:
            self.coord.release(self.stub, self.request_id, text, self.job.namespace)
            self.coord.row_line.freed()

    def _prefill(self, place: Place, tokens: list[int], candidates: int, reserve: int) -> pb.VerifierPrefillResponse:
        for address in self._live_verifiers(place):
            stub = pb_grpc.VerifierStub(self.coord.channels.get(address))
            req = pb.VerifierPrefillRequest(request_id=self.request_id, token_ids=tokens,
                                            sampling=params_to_pb(self.job.params), max_len=reserve,
                                            candidates=candidates, resumed=self.prefills)
            self.prefills += 1
            try:
                resp = stub.Prefill(req, timeout=self.coord.timeout(self.job))
            except grpc.RpcError as e:
                # the verifier may have taken a row before the call failed: give it back
                self.coord.release(stub, self.request_id)
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise DeadlineExceeded() from e
                if e.code() not in RETRYABLE:
                    raise
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # every row taken: nothing was drawn, so this attempt does not count as a prefill;
                    # try the verifier again when a row may have freed
                    self.prefills -= 1
                    self.full.add(address)
                    continue
                self._fail(address, e)
                continue
            self.address, self.stub, self.active_requests = address, stub, resp.active_requests
            return resp
        raise NoService("no verifier is available")

    def _live_verifiers(self, place: Place) -> Iterator[str]:
        """Listed verifiers not yet failed for this request; while there is none (the service is
        starting, or one is restarting) wait for one, up to the coordinator's service wait and
        the request's deadline. While the ones there are full (every row taken), wait in the
        router's line for a row as long as the deadline allows: a burst queues, in arrival
        order, instead of failing."""
        give_up, full = time.monotonic() + self.coord.service_wait_s, False
        while True:
            if full or place.ticket is not None:
                place.wait_turn(self._check, for_row=full)
            self.full.clear()
            fresh = [a for a in self.coord.verifiers() if a not in self.failed]
            yield from fresh
            full = bool(self.full)
            if time.monotonic() >= give_up and not full:
                return
            if not full:  # none listed, or all failed: look at the registry again soon
                self._check()
                time.sleep(min(SERVICE_POLL_S, max(0.0, self.coord.timeout(self.job) or SERVICE_POLL_S)))

    def _check(self) -> None:
        """Raise if the request should stop waiting: cancelled, or past its deadline."""
        if self.job.is_cancelled():
            raise Cancelled()
        self.coord.timeout(self.job)

    def verify(self, tree: DraftTree, context_length: int, candidates: int = 0) -> pb.VerifyResponse | None:
        """The verdict, or None when the request must be prefilled again. The call blocks this
        thread: a `future` call would start a gRPC polling thread every round."""
        req, timeout = self._request(tree, context_length, candidates), self.coord.timeout(self.job)
        return self._verdict(lambda: self.stub.Verify(req, timeout=timeout))

    def decode(self, tokens: list[int], drafter: str, draft_length: int, max_nodes: int, max_tokens: int,
               candidates: int = 0) -> Iterator[pb.VerifyResponse]:
        """The verdicts of up to DECODE_ROUNDS of the verifier's own rounds after `tokens`
        (Decode), as they come; they end early, the request to be prefilled again, when the
        verifier loses it or fails."""
        req = pb.DecodeRequest(request_id=self.request_id, token_ids=tokens, drafter=drafter,
                               draft_length=draft_length, max_tokens=max_tokens,
                               eos_token_ids=self.job.eos_token_ids, max_rounds=DECODE_ROUNDS,
                               candidates=candidates, max_nodes=max_nodes, namespace=self.job.namespace)
        call = self.stub.Decode(req, timeout=self.coord.timeout(self.job))
        try:
            for resp in call:
                verdict = self._verdict(lambda: resp)
                if verdict is None:
                    return
                yield verdict
        except grpc.RpcError as e:
            if e.code() not in RETRYABLE or e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            self._fail(self.address, e)
        finally:
            call.cancel()

    def verify_async(self, tree: DraftTree, context_length: int, candidates: int = 0) -> "_Call":
        """Send the tree from one of the coordinator's threads; `result` waits for the verdict
        (with the target's top `candidates` next tokens at each scored position, if asked)."""
        stub, req, timeout = self.stub, self._request(tree, context_length, candidates), self.coord.timeout(self.job)
        call = _Call()

        def send() -> pb.VerifyResponse:
            call.started = time.monotonic()
            try:
                return stub.Verify(req, timeout=timeout)
            finally:
                call.ended = time.monotonic()

        call.future = self.coord.calls.submit(send)
        return call

    def result(self, call: "_Call") -> pb.VerifyResponse | None:
        """The verdict of `verify_async`, or None when the request must be prefilled again."""
        return self._verdict(call.future.result)

    def _request(self, tree: DraftTree, context_length: int, candidates: int) -> pb.VerifyRequest:
        return pb.VerifyRequest(request_id=self.request_id, tree=tree_to_pb(tree), context_length=context_length,
                                candidates=candidates)

    def _verdict(self, answer: Callable[[], pb.VerifyResponse]) -> pb.VerifyResponse | None:
        try:
            resp = answer()
        except grpc.RpcError as e:
            if e.code() not in RETRYABLE or e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            self._fail(self.address, e)
            return None
        if resp.state_lost:
            self.stub = None
            return None
        if self.coord.pass_costs is not None and resp.pass_id:
            self.coord.pass_costs.observe((self.address, resp.pass_id), resp.batch_size, resp.pass_tokens,
                                          resp.pass_width, resp.pass_seconds)
        return resp


@dataclass
class _Call:
    """A verify call in flight (`_VerifySide.verify_async`), timed from send to answer."""
    future: Future | None = None
    started: float = 0.0
    ended: float = 0.0


class _Drafting:
    """Every drafter of one request; the trees of several are fused into one."""

    def __init__(self, coord: Coordinator, job: Job):
        self.job = job
        several = len(job.drafters) > 1
        # drafters of one request may share a pool: each needs its own id there
        self.sides = [_DraftSide(coord, job, kind, stream=1 + i,
                                 request_id=f"{job.service_id}/{kind}" if several else job.service_id)
                      for i, (kind, _) in enumerate(job.drafters)]
        self._threads = ThreadPoolExecutor(len(self.sides), thread_name_prefix="draft") if several else None
        # greedy fusion ranks nodes by each drafter's calibrated confidence (`speculative.calibration`)
        self.calibrations = ([coord.calibration(kind, job.namespace) for kind, _ in job.drafters]
                             if several and job.params.greedy and calibration_enabled() else None)

    def propose(self, context: list[int], budgets: list[int], speculative: list[int] = ()) -> list[DraftTree]:
        """Each drafter's own tree of up to its budget (empty for one that cannot draft),
        after `context` and, drafting ahead, the unverified `speculative` tokens."""
        def one(side: _DraftSide, budget: int) -> DraftTree:
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

    def observe(self, tokens: list[int], resp: pb.VerifyResponse | pb.VerifierPrefillResponse) -> None:
        """The target's candidates at the positions it scored (`tokens`: a verify's root, then
        the tree's nodes; a prefill's last tokens), kept for the drafters that learn from them
        until they next draft."""
        if not resp.candidate_ids or len(resp.candidate_ids) % len(tokens):
            return  # a verifier that did not report them: nothing to learn this round
        for side in self.sides:
            if side.coord.learns_from_target(side.drafter):
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




class _DraftSide(_Side):
    """The drafter pool serving one drafter of a request, replaced when it fails."""

    kind = "drafter"

    def __init__(self, coord: Coordinator, job: Job, drafter: str, stream: int, request_id: str):
        super().__init__(coord, job, request_id)
        self.drafter, self.stream = drafter, stream
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
            self.prefilling = self.coord.pool_prefills.submit(self._connect, list(context))

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
        for address in self.coord.drafters():
            if address in self.failed:
                continue
            stub = pb_grpc.DrafterStub(self.coord.channels.get(address))
            req = pb.DrafterPrefillRequest(request_id=self.request_id, drafter=self.drafter, token_ids=context,
                                           sampling=params_to_pb(self.job.params), stream=self.stream,
                                           resumed=self.prefills, namespace=self.job.namespace,
                                           domain=self.job.domain or "")
            self.prefills += 1
            try:
                stub.Prefill(req, timeout=self.coord.timeout(self.job))
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE:
                    raise
                self._fail(address, e)
                continue
            self.address, self.stub, self.synced = address, stub, len(context)
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
            try:
                resp = self.stub.Propose(pb.ProposeRequest(
                    request_id=self.request_id, context_length=self.synced, new_tokens=context[self.synced:],
                    max_tokens=budget, speculative_tokens=speculative, min_confidence=self.job.stop_confidence,
                    max_nodes=max_nodes, observed_tokens=self.observed[0], observed_ids=self.observed[1],
                    observed_probs=self.observed[2]),
                    timeout=self.coord.timeout(self.job))
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE:
                    raise
                self._fail(self.address, e)
                continue
            if resp.state_lost:  # e.g. the pool restarted: prefill it again
                self.stub = None
                continue
            self.synced = len(context)
            self.seconds = resp.seconds
            self.observed = ([], [], [])
            return resp.tree
        return pb.DraftTree()
