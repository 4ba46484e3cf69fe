"""What a request's verify and draft sides need of the router: the services listed, the
channels to them, the line for verifier rows, the threads for calls sent ahead, what
passes cost, and who learns from the target."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Collection, Sequence

import grpc

from protos import specserve_pb2 as pb
from speculative.drafter_kinds import abilities
from speculative.namespaces import DEFAULT_NAMESPACE

from ..adaptive import PassCostModel
from ..row_line import RowLine
from .channels import RETRYABLE, Channels
from .holdings import Holdings

log = logging.getLogger(__name__)

# how often a request waiting for a verifier looks at the registry again
SERVICE_POLL_S = 0.2
# pipelined rounds' verify calls: one in flight per request, with room to spare over the
# requests a router serves at once (router.servicer.serve's threads)
VERIFY_CALL_THREADS = 64
# pools' prefills sent ahead: one per drafter of a request just starting; a prefill not
# started when the request first drafts is sent then instead
POOL_PREFILL_THREADS = 16
RELEASE_TIMEOUT_S = 2.0  # a release's first try, on the request's own thread
# a release whose call failed while the service may still hold the request (busy past the
# timeout, a lost answer) is sent again from a thread of its own for this long, so that no
# request stays held until the service's idle eviction
RELEASE_RETRY_S = 60.0
RELEASE_RETRY_PAUSE_S = 1.0
RELEASE_THREADS = 4


class Services:
    """The verifiers and drafter pools that `verifiers()` and `drafters()` list, as every
    request of one coordinator reaches them."""

    def __init__(self, verifiers: Callable[[], list[str]], drafters: Callable[[], list[str]], channels: Channels,
                 pass_costs: PassCostModel | None = None, service_wait_s: float = 0.0,
                 learning_drafters: Collection[str] = ()):
        """`learning_drafters`: drafter kinds the pools train online (`[drafter_pools.learner]`),
        sent the target's scores after each pass as the kinds that learn from them are."""
        self.verifiers, self.drafters = verifiers, drafters
        self.learning_drafters = frozenset(learning_drafters)
        # how long a request waits for a verifier to be listed before it fails UNAVAILABLE
        self.service_wait_s = service_wait_s
        self.channels = channels
        # what verification passes cost, learned from every verdict here (adaptive lengths read it)
        self.pass_costs = pass_costs
        # pipelined rounds send their verify calls from here while their own thread drafts ahead
        self.calls = ThreadPoolExecutor(max_workers=VERIFY_CALL_THREADS, thread_name_prefix="verify-call")
        # pools' prefills sent while the verifier prefills (`Job.prefill_pools_ahead`)
        self.pool_prefills = ThreadPoolExecutor(max_workers=POOL_PREFILL_THREADS, thread_name_prefix="pool-prefill")
        self.holdings = Holdings()  # requests held at each verifier and pool: new ones go to the fewest
        self.row_line = RowLine(SERVICE_POLL_S)  # prefills waiting for a verifier row, in arrival order
        self.releases = ThreadPoolExecutor(max_workers=RELEASE_THREADS, thread_name_prefix="release-retry")

    def learns_from_target(self, kind: str) -> bool:
        """Whether drafter `kind`'s pools are sent the target's scores at the positions it scored."""
        return abilities(kind).learns_from_target or kind in self.learning_drafters

    def release(self, stub, request_id: str, learn: Sequence[int] = (), namespace: str = DEFAULT_NAMESPACE) -> None:
        """Release a request at a service; a verifier's suffix index of `namespace` learns the
        text `learn` first, if any. A call that fails while the service may still hold the
        request is sent again in the background (without `learn`: the first may have landed)."""
        request = pb.ReleaseRequest(request_id=request_id, learn_token_ids=learn, namespace=namespace)
        try:
            stub.Release(request, timeout=RELEASE_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() in RETRYABLE:
                self.release_later(stub, request_id)

    def release_later(self, stub, request_id: str) -> None:
        """Release a request from a background thread, trying again for RELEASE_RETRY_S."""
        self.releases.submit(_release_until_done, stub, pb.ReleaseRequest(request_id=request_id))


def _release_until_done(stub, request: pb.ReleaseRequest) -> None:
    give_up = time.monotonic() + RELEASE_RETRY_S
    while True:
        try:
            stub.Release(request, timeout=RELEASE_TIMEOUT_S)
            return
        except grpc.RpcError as e:
            if e.code() not in RETRYABLE or time.monotonic() >= give_up:
                log.warning("could not release %s (%s); the service's idle eviction will", request.request_id,
                            e.code())
                return
        time.sleep(RELEASE_RETRY_PAUSE_S)
