"""The verifier side of a request: the verifier holding its KV cache, found (waiting in the
router's line for a row when all are full), called each round, replaced when it fails."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import grpc

from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from protos.convert import params_to_pb, tree_to_pb
from speculative.tree import DraftTree

from ..row_line import Place
from .channels import RETRYABLE
from .job import Cancelled, DeadlineExceeded, NoService
from .services import SERVICE_POLL_S
from .side import Side

# KV slots a request reserves at the verifier past its prompt, its whole output and its
# largest tree: a small margin (a round's root token needs one); the router's context limit
# leaves the same room (cluster/actors.py)
SPARE_SLOTS = 4
# rounds of one Decode call: then the router chooses the draft length again, for the load then
DECODE_ROUNDS = 16


class VerifySide(Side):
    """The verifier holding one request, replaced when it fails."""

    kind = "verifier"
    active_requests = 0  # the verifier's load when it last answered a prefill

    def prefill(self, tokens: list[int], candidates: int = 0) -> pb.VerifierPrefillResponse:
        """The answer holds the target's next token (and, with `candidates`, its top candidates
        after the last tokens)."""
        reserve = len(tokens) + self.job.params.max_tokens + self.job.max_tree_nodes + SPARE_SLOTS
        with self.services.row_line.place() as place:
            return self._prefill(place, tokens, candidates, reserve)

    def release(self, text: Sequence[int] = ()) -> None:
        """Release the request, its `text` (prompt and output) to the verifier's suffix index."""
        if self.stub is not None:
            self.services.release(self.stub, self.request_id, text, self.job.namespace)
            self.services.row_line.freed()
        self._hold(None, None)

    def _prefill(self, place: Place, tokens: list[int], candidates: int, reserve: int) -> pb.VerifierPrefillResponse:
        for address in self._live_verifiers(place):
            stub = pb_grpc.VerifierStub(self.services.channels.get(address))
            req = pb.VerifierPrefillRequest(request_id=self.request_id, token_ids=tokens,
                                            sampling=params_to_pb(self.job.params), max_len=reserve,
                                            candidates=candidates, resumed=self.prefills,
                                            prompt_length=len(self.job.prompt_ids), namespace=self.job.namespace,
                                            feature_layers=self.job.pool_feature_layers,
                                            verifier_drafter=self.job.verifier_eagle)
            self.prefills += 1
            try:
                resp = stub.Prefill(req, timeout=self.job.timeout())
            except grpc.RpcError as e:
                # the verifier may have taken a row before the call failed: give it back
                self.services.release(stub, self.request_id)
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
            self._hold(address, stub)
            self.active_requests = resp.active_requests
            return resp
        raise NoService("no verifier is available")

    def _live_verifiers(self, place: Place) -> Iterator[str]:
        """Listed verifiers not yet failed for this request; while there is none (the service is
        starting, or one is restarting) wait for one, up to the coordinator's service wait and
        the request's deadline. While the ones there are full (every row taken), wait in the
        router's line for a row as long as the deadline allows: a burst queues, in arrival
        order, instead of failing."""
        give_up, full = time.monotonic() + self.services.service_wait_s, False
        while True:
            if full or place.ticket is not None:
                place.wait_turn(self._check, for_row=full)
            self.full.clear()
            fresh = self.services.holdings.fewest_first(a for a in self.services.verifiers() if a not in self.failed)
            yield from fresh
            full = bool(self.full)
            if time.monotonic() >= give_up and not full:
                return
            if not full:  # none listed, or all failed: look at the registry again soon
                self._check()
                time.sleep(min(SERVICE_POLL_S, max(0.0, self.job.timeout() or SERVICE_POLL_S)))

    def _check(self) -> None:
        """Raise if the request should stop waiting: cancelled, or past its deadline."""
        if self.job.is_cancelled():
            raise Cancelled()
        self.job.timeout()

    def verify(self, tree: DraftTree, context_length: int, candidates: int = 0) -> pb.VerifyResponse | None:
        """The verdict, or None when the request must be prefilled again. The call blocks this
        thread: a `future` call would start a gRPC polling thread every round."""
        req, timeout = self._request(tree, context_length, candidates), self.job.timeout()
        return self._verdict(lambda: self.stub.Verify(req, timeout=timeout))

    def decode(self, tokens: list[int], drafter: str, draft_length: int, max_nodes: int, max_tokens: int,
               candidates: int = 0, drafted_rounds: int = 0) -> Iterator[pb.VerifyResponse]:
        """The verdicts of up to DECODE_ROUNDS of the verifier's own rounds after `tokens`
        (Decode), as they come, the first `drafted_rounds` drafted (0: all); they end early,
        the request to be prefilled again, when the verifier loses it or fails."""
        req = pb.DecodeRequest(request_id=self.request_id, token_ids=tokens, drafter=drafter,
                               draft_length=draft_length, max_tokens=max_tokens,
                               eos_token_ids=self.job.eos_token_ids, max_rounds=DECODE_ROUNDS,
                               candidates=candidates, max_nodes=max_nodes, namespace=self.job.namespace,
                               feature_layers=self.job.pool_feature_layers, drafted_rounds=drafted_rounds)
        call = self.stub.Decode(req, timeout=self.job.timeout())
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
        stub, req, timeout = self.stub, self._request(tree, context_length, candidates), self.job.timeout()
        call = _Call()

        def send() -> pb.VerifyResponse:
            call.started = time.monotonic()
            try:
                return stub.Verify(req, timeout=timeout)
            finally:
                call.ended = time.monotonic()

        call.future = self.services.calls.submit(send)
        return call

    def result(self, call: "_Call") -> pb.VerifyResponse | None:
        """The verdict of `verify_async`, or None when the request must be prefilled again."""
        return self._verdict(call.future.result)

    def _request(self, tree: DraftTree, context_length: int, candidates: int) -> pb.VerifyRequest:
        return pb.VerifyRequest(request_id=self.request_id, tree=tree_to_pb(tree), context_length=context_length,
                                candidates=candidates, feature_layers=self.job.pool_feature_layers)

    def _verdict(self, answer: Callable[[], pb.VerifyResponse]) -> pb.VerifyResponse | None:
        try:
            resp = answer()
        except grpc.RpcError as e:
            if e.code() not in RETRYABLE or e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            self._fail(self.address, e)
            return None
        if resp.state_lost:  # it holds nothing of the request now
            self._hold(None, None)
            return None
        if self.services.pass_costs is not None and resp.pass_id:
            self.services.pass_costs.observe((self.address, resp.pass_id), resp.batch_size, resp.pass_tokens,
                                          resp.pass_width, resp.pass_seconds)
        return resp


@dataclass
class _Call:
    """A verify call in flight (`VerifySide.verify_async`), timed from send to answer."""
    future: Future | None = None
    started: float = 0.0
    ended: float = 0.0
