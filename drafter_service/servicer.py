"""The drafter pool over gRPC (service specserve.v1.Drafter), with standard
health checking and server reflection so generic tools can probe it."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import grpc
import torch

from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from protos.server import start_server
from protos.convert import features_from_pb, params_from_pb, tree_to_pb
from runtime.cpu_tuning import own_torch_threads
from speculative.sampling import InvalidArgument

from .pool import DrafterPool, Observed
from .settings import DrafterPoolSettings

_SETTINGS = DrafterPoolSettings()  # the server's defaults are the served pools'
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name

T = TypeVar("T")


def _checked(context: grpc.ServicerContext, call: Callable[[], T]) -> T:
    """Run `call`; a bad field becomes INVALID_ARGUMENT whose details start with the field's name."""
    try:
        return call()
    except InvalidArgument as err:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))


def _observed(request: pb.ProposeRequest) -> Observed | None:
    """The request's observed target predictions as (tokens, ids [N, k], probs [N, k]), or None."""
    n = len(request.observed_tokens)
    if not n and not request.observed_ids:
        return None
    if not n or len(request.observed_ids) % n or len(request.observed_ids) != len(request.observed_probs):
        raise InvalidArgument("observed_ids", f"{len(request.observed_ids)} candidates and "
                                              f"{len(request.observed_probs)} probabilities for {n} observed tokens")
    ids = torch.tensor(list(request.observed_ids), dtype=torch.int32).view(n, -1)
    return list(request.observed_tokens), ids, torch.tensor(list(request.observed_probs)).view(n, -1)


def _features(request: pb.ProposeRequest) -> tuple[int, torch.Tensor] | None:
    """The request's target features as (start, [m, F]), or None."""
    try:
        return features_from_pb(request)
    except ValueError as err:
        field, _, problem = str(err).partition(": ")
        raise InvalidArgument(field, problem) from err


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, pool: DrafterPool):
        self.pool = pool

    def Prefill(self, request: pb.DrafterPrefillRequest, context: grpc.ServicerContext) -> pb.Ack:
        stream = request.stream if request.HasField("stream") else 1  # unset: the default drafter stream
        _checked(context, lambda: self.pool.prefill(request.request_id, request.drafter, list(request.token_ids),
                                                    params_from_pb(request.sampling), stream,
                                                    request.resumed, request.namespace, request.domain))
        return pb.Ack()

    def Propose(self, request: pb.ProposeRequest, context: grpc.ServicerContext) -> pb.ProposeResponse:
        started = time.perf_counter()
        tree = _checked(context, lambda: self.pool.propose(
            request.request_id, request.context_length, list(request.new_tokens), request.max_tokens,
            speculative=list(request.speculative_tokens), min_confidence=request.min_confidence,
            max_nodes=request.max_nodes if request.HasField("max_nodes") else None, observed=_observed(request),
            features=_features(request)))
        if tree is None:
            return pb.ProposeResponse(state_lost=True)
        return pb.ProposeResponse(tree=tree_to_pb(tree), seconds=time.perf_counter() - started)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=self.pool.release(request.request_id))


def serve(pool: DrafterPool, host: str = "127.0.0.1", port: int = 0,
          max_workers: int = 16, threads: int = _SETTINGS.threads,
          secret: str | None = None, mutual_tls=None) -> tuple[grpc.Server, int]:
    """Start serving `pool` on host:port (0 picks a free port); returns the server and its port.
    Drafters run on the server's threads, `threads` torch threads each. With a `secret` (the
    cluster's), calls without it are refused (protos.server.ClusterSecretCheck); with
    `mutual_tls` (protos.server.MutualTls), callers without a certificate of the cluster's CA too."""
    return start_server(pb_grpc.add_DrafterServicer_to_server, DrafterServicer(pool), SERVICE_NAME,
                        host, port, max_workers, thread_init=lambda: own_torch_threads(threads),
                        secret=secret, mutual_tls=mutual_tls)
