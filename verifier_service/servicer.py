"""The verifier engine over gRPC (service specserve.v1.Verifier), with standard
health checking and server reflection so generic tools can probe it."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable, Iterator, TypeVar

import grpc

from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from protos.server import call_deadline, start_server
from protos.convert import features_to_pb, logprobs_to_pb, params_from_pb, tree_from_pb
from runtime.cpu_tuning import own_torch_threads
from speculative.drafter_kinds import VERIFIER_DRAFTERS
from speculative.namespaces import check_namespace
from speculative.sampling import InvalidArgument
from speculative.tree import DraftTree

from .drafting import VerifierDrafting, uses_eagle, verifier_drafter
from .engine import (PrefillOutcome, ResourceExhausted, UnknownRequest, VerifierEngine, VerifyOutcome,
                     check_token_ids)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Verifier"].full_name
MIN_WORKERS, MAX_WORKERS = 16, 512  # the gRPC server's threads (`serve`), made as calls need them

T = TypeVar("T")


def _checked(context: grpc.ServicerContext, call: Callable[[], T]) -> T:
    """Run `call`; a bad field becomes INVALID_ARGUMENT whose details start with the field's name,
    and a full verifier RESOURCE_EXHAUSTED (the caller tries another)."""
    try:
        return call()
    except InvalidArgument as err:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    except ResourceExhausted as err:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))


def _parse_tree(msg: pb.DraftTree, vocab_size: int) -> DraftTree:
    """The wire tree, checked; every problem is an InvalidArgument naming the tree's field."""
    try:
        return tree_from_pb(msg, vocab_size)
    except ValueError as err:
        field, _, problem = str(err).partition(": ")
        raise InvalidArgument(field, problem) from err


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, engine: VerifierEngine):
        self.engine = engine
        self.drafting = VerifierDrafting(engine.vocab_size, target=engine.model)  # what Decode rounds draft with

    def Prefill(self, request: pb.VerifierPrefillRequest,
                context: grpc.ServicerContext) -> pb.VerifierPrefillResponse:
        def prefill() -> PrefillOutcome:
            tokens = list(request.token_ids)
            if request.HasField("max_len") and request.max_len < len(tokens):
                raise InvalidArgument("max_len", f"{request.max_len} is less than the {len(tokens)} token_ids")
            reserve = request.max_len - len(tokens) if request.HasField("max_len") else 0  # unset: reserve nothing
            prompt_length = request.prompt_length if request.HasField("prompt_length") else None
            params = params_from_pb(request.sampling)
            capture = list(request.feature_layers) or None
            if request.verifier_drafter:  # an eagle head drafting here: its layers, kept here
                own = list(self.drafting.eagle_layers(request.verifier_drafter))
                if capture is not None and capture != own:
                    raise InvalidArgument("feature_layers", f"{capture} are not verifier_drafter's layers {own}")
                capture = own
            out = self.engine.prefill(request.request_id, tokens, params, reserve, request.candidates,
                                      request.resumed, prompt_length, request.namespace, capture)
            if request.verifier_drafter:
                self.drafting.start_eagle(request.request_id, request.verifier_drafter, params, request.resumed,
                                          out.features)
            else:
                self.drafting.drop_eagle(request.request_id)  # prefilled again without one: none kept
            return out

        out = _checked(context, prefill)
        resp = pb.VerifierPrefillResponse(next_token=out.next_token, active_requests=self.engine.active_requests(),
                                          logprobs=logprobs_to_pb(out.logprobs))
        if request.feature_layers:  # a pool's eagle drafter: the prompt's features go back
            features_to_pb(resp, *out.features)
        if out.candidate_ids is not None:
            resp.candidate_ids.extend(out.candidate_ids.flatten().tolist())
            resp.candidate_probs.extend(out.candidate_probs.flatten().tolist())
        return resp

    def Verify(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> pb.VerifyResponse:
        def verify() -> pb.VerifyResponse:
            capture = self._capture(request.request_id, request.feature_layers)
            try:
                out = self.engine.verify(request.request_id, _parse_tree(request.tree, self.engine.vocab_size),
                                         request.context_length or None, call_deadline(context), request.candidates,
                                         capture)
            except UnknownRequest:
                return pb.VerifyResponse(state_lost=True)
            self.drafting.take_features(request.request_id, out.features)
            return _verdict(out, bool(request.feature_layers))

        return _checked(context, verify)

    def Decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[pb.VerifyResponse]:
        """Round after round on this verifier, each drafted here from the request's text: no
        hop to a pool or back to the router between them. The engine queues each round as the
        last one's pass ends (`VerifierEngine.verify_rounds`), while its tokens go out."""
        tokens = _checked(context, lambda: self._decode_tokens(request))
        left, eos = request.max_tokens, set(request.eos_token_ids)
        rounds_left = request.max_rounds or math.inf  # 0: no limit
        if uses_eagle(request.drafter) and not self.drafting.has_eagle(request.request_id):
            # its eagle drafter is not here (a restarted verifier, or dropped): prefill again with one
            yield pb.VerifyResponse(state_lost=True)
            return
        capture = _checked(context, lambda: self._capture(request.request_id, request.feature_layers))
        returns_features = bool(request.feature_layers)
        # a round each, oldest first: a fusion's member trees, and the seconds drafting took
        members: deque[tuple[list[DraftTree], float]] = deque()
        drafting_left = request.drafted_rounds or math.inf  # rounds that draft (0: all)

        def tree() -> DraftTree:
            nonlocal drafting_left
            started = time.perf_counter()
            params = self.engine.sampling(request.request_id)  # None until the engine restores a checkpoint
            depth = min(request.draft_length, left - 1) if params and drafting_left > 0 else 0
            drafting_left -= 1
            drafted, own = self.drafting.draft_members(request.drafter, request.request_id, request.namespace,
                                                       tokens, depth, request.max_nodes, params)
            members.append((own, time.perf_counter() - started))  # each tree is one round, its outcome in order
            return drafted

        def next_tree(out: VerifyOutcome) -> DraftTree | None:  # in the engine's worker, as a pass ends
            nonlocal left, rounds_left
            self.drafting.take_features(request.request_id, out.features)  # before it drafts the next round
            new = [*out.accepted, out.bonus]
            tokens.extend(new)
            left, rounds_left = left - len(new), rounds_left - 1
            if left <= 0 or rounds_left <= 0 or eos.intersection(new) or not context.is_active():
                return None
            return tree()

        rounds = self.engine.verify_rounds(request.request_id, tree(), len(tokens), next_tree, call_deadline(context),
                                           request.candidates, capture)  # checked as its first round is sent
        try:
            while (out := _checked(context, lambda: next(rounds, None))) is not None:
                resp = _verdict(out, returns_features)
                resp.drafted, resp.drafted_depth = out.drafted, out.drafted_depth
                own, resp.draft_seconds = members.popleft() if members else ((), 0.0)
                for tree_of in own:  # each member's share of the verdict
                    resp.member_drafted.append(len(tree_of))
                    resp.member_accepted.append(tree_of.path_prefix(out.accepted))
                yield resp
        except UnknownRequest:
            yield pb.VerifyResponse(state_lost=True)
        finally:
            rounds.close()

    def _capture(self, request_id: str, asked) -> list[int] | None:
        """The layers a pass of the request captures: those the caller asks for (a pool's
        eagle drafter), else its eagle drafter's here, if it has one (None: none)."""
        own = self.drafting.eagle_capture(request_id)
        if asked and own is not None and list(asked) != list(own):
            raise InvalidArgument("feature_layers", f"{list(asked)} are not the request's eagle layers {list(own)}")
        return list(asked) or (None if own is None else list(own))

    def _decode_tokens(self, request: pb.DecodeRequest) -> list[int]:
        """Decode's fields checked; its token_ids, to draft from."""
        if not verifier_drafter(request.drafter):
            raise InvalidArgument("drafter", f"Decode drafts with {', '.join(VERIFIER_DRAFTERS[:-1])}, "
                                  f"{VERIFIER_DRAFTERS[-1]}, an eagle head the request was prefilled with, "
                                  f"or several joined by '+', not {request.drafter!r}")
        if not 0 <= request.draft_length < self.engine.max_batch_tokens:
            raise InvalidArgument("draft_length", f"must be in [0, {self.engine.max_batch_tokens - 1}], "
                                  f"got {request.draft_length}")
        if request.max_tokens < 1:
            raise InvalidArgument("max_tokens", f"must be positive, got {request.max_tokens}")
        if not 0 <= request.max_nodes < self.engine.max_batch_tokens:
            raise InvalidArgument("max_nodes", f"must be in [0, {self.engine.max_batch_tokens - 1}], "
                                  f"got {request.max_nodes}")
        check_namespace(request.namespace)
        if request.max_rounds < 0:
            raise InvalidArgument("max_rounds", f"must be >= 0 (0: no limit), got {request.max_rounds}")
        if request.drafted_rounds < 0:
            raise InvalidArgument("drafted_rounds", f"must be >= 0 (0: all), got {request.drafted_rounds}")
        if request.candidates and request.drafter != "none":
            raise InvalidArgument("candidates", "only with drafter 'none': the caller knows no other round's tree")
        return check_token_ids(request.token_ids, self.engine.vocab_size)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        if request.learn_token_ids:
            def learn() -> None:
                tokens = check_token_ids(request.learn_token_ids, self.engine.vocab_size, "learn_token_ids")
                self.drafting.learn(request.request_id, check_namespace(request.namespace), tokens)

            _checked(context, learn)
        self.drafting.release(request.request_id)
        return pb.ReleaseResponse(released=self.engine.release(request.request_id))

    def Stats(self, request: pb.VerifierStatsRequest, context: grpc.ServicerContext) -> pb.VerifierStatsResponse:
        return pb.VerifierStatsResponse(**self.engine.stats())


def _verdict(out: VerifyOutcome, features: bool = False) -> pb.VerifyResponse:
    """A verify outcome on the wire, with the pass it went into and the candidates, if asked,
    and with `features` the target's features at the positions it verified (a pool's eagle)."""
    resp = pb.VerifyResponse(accepted=out.accepted, bonus=out.bonus, batch_size=out.batch_size,
                             queued=out.queued, active_requests=out.active, forced=out.forced,
                             logprobs=logprobs_to_pb(out.logprobs))
    if features and out.features is not None:
        features_to_pb(resp, *out.features)
    if out.pass_shape is not None:
        shape = out.pass_shape
        resp.pass_id, resp.pass_seconds = shape.pass_id, shape.seconds
        resp.pass_tokens, resp.pass_width = shape.tokens, shape.width
    if out.candidate_ids is not None:
        resp.candidate_ids.extend(out.candidate_ids.flatten().tolist())
        resp.candidate_probs.extend(out.candidate_probs.flatten().tolist())
    return resp


def serve(engine: VerifierEngine, host: str = "127.0.0.1", port: int = 0,
          max_workers: int | None = None, secret: str | None = None,
          mutual_tls=None) -> tuple[grpc.Server, int]:
    """Start serving `engine` on host:port (0 picks a free port); returns the server and its port.
    The engine's worker runs the model; the server's threads only convert, on one torch thread.
    `max_workers`: the server's threads (None: MIN_WORKERS, or a thread for each request the
    engine may hold and then some, up to MAX_WORKERS): every request held may have a call
    waiting in the engine at once (a preempted one's round waits there for room), and a call
    that finds no thread waits for one. With a `secret` (the cluster's), calls without it are
    refused (protos.server.ClusterSecretCheck); with `mutual_tls` (protos.server.MutualTls),
    callers without a certificate of the cluster's CA too."""
    if max_workers is None:
        held = engine.max_batch or engine.kv_stats()["blocks"]  # each request holds a block at least
        max_workers = max(MIN_WORKERS, min(MAX_WORKERS, 2 * held))
    return start_server(pb_grpc.add_VerifierServicer_to_server, VerifierServicer(engine), SERVICE_NAME,
                        host, port, max_workers, thread_init=lambda: own_torch_threads(1),
                        secret=secret, mutual_tls=mutual_tls)
