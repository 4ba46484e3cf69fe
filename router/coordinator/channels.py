"""The router's gRPC channels to the verifiers and drafter pools: one per address, each
call carrying the cluster secret when there is one, over mutual TLS when the cluster has
it."""

from __future__ import annotations

import collections
import threading

import grpc

from protos.server import CLUSTER_SECRET_METADATA, MutualTls, internal_channel

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
    carries it (the verifiers and drafter pools of `specserve serve` refuse calls without);
    with `tls`, each is a TLS channel presenting the router's certificate."""

    def __init__(self, secret: str | None = None, tls: MutualTls | None = None):
        self._tls = tls
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()  # requests, and the drafters of one request, share the channels
        self._secret = _WithSecret(secret) if secret is not None else None

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                # a subchannel of its own: gRPC shares one per address between channels by default,
                # with its reconnect backoff, so a channel made after `drop` would fail at once for a
                # service restarted at the same address (or a new one on a reused port)
                channel = internal_channel(address, self._tls, options=[("grpc.use_local_subchannel_pool", 1)])
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
