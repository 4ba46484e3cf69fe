"""Start the gRPC server of one of our services, with standard health
checking and server reflection, as every specserve server has; the internal
services (verifier, drafter pools) also check the cluster secret of every call. A request
that does not parse is refused as INVALID_ARGUMENT."""

from __future__ import annotations

import hmac
import time
from concurrent import futures
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

NO_DEADLINE_S = 1e7  # time_remaining() above this means the caller set no deadline
# the metadata key that carries the cluster secret on every call to an internal service
CLUSTER_SECRET_METADATA = "x-specserve-cluster-secret"
# services answered without the secret: readiness probes (`cluster.actors.services_ready`,
# Kubernetes, grpc_health_probe) and grpcurl hold none, and neither reveals or changes state
OPEN_SERVICES = (health.SERVICE_NAME, reflection.SERVICE_NAME)


def call_deadline(context: grpc.ServicerContext) -> float | None:
    """When the caller stops waiting (time.monotonic()), None if it set no deadline: a call
    without one reports a huge time remaining, which passed downstream overflows."""
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_S:
        return None
    return time.monotonic() + remaining


class ClusterSecretCheck(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call that does not carry `secret` in its
    CLUSTER_SECRET_METADATA, except to OPEN_SERVICES. Compared in constant time."""

    def __init__(self, secret: str):
        if not secret:
            raise ValueError("the cluster secret must not be empty")
        self._secret = secret.encode()

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = continuation(details)
        if handler is None or details.method.split("/")[1] in OPEN_SERVICES:  # "/package.Service/Method"
            return handler
        given = next((value for key, value in details.invocation_metadata or ()
                      if key == CLUSTER_SECRET_METADATA), None)
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._secret):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    def refuse(_request, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "this service needs the cluster secret")

    shape = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}[(handler.request_streaming,
                                                                   handler.response_streaming)]
    return shape(refuse, request_deserializer=handler.request_deserializer,
                 response_serializer=handler.response_serializer)


class _Undecodable:
    """What a request that did not parse becomes, so that its call can be refused."""

    def __init__(self, error: Exception):
        self.error = error


class DecodeCheck(grpc.ServerInterceptor):
    """A request that does not parse (a string field that is not UTF-8, as a lone surrogate's
    bytes; a truncated message) gets INVALID_ARGUMENT: gRPC answers INTERNAL for it."""

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler  # our services take one request a call
        parse, behaviour = handler.request_deserializer, handler.unary_unary or handler.unary_stream

        def lenient(data: bytes):
            try:
                return parse(data)
            except DecodeError as e:
                return _Undecodable(e)

        def checked(request, context: grpc.ServicerContext):
            if isinstance(request, _Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: does not parse: {request.error}")
            return behaviour(request, context)

        shape = grpc.unary_stream_rpc_method_handler if handler.response_streaming else \
            grpc.unary_unary_rpc_method_handler
        return shape(checked, request_deserializer=lenient, response_serializer=handler.response_serializer)


def start_server(register: Callable[[Any, grpc.Server], None], servicer: Any, service: str,
                 host: str, port: int, max_workers: int,
                 thread_init: Callable[[], None] | None = None,
                 secret: str | None = None,
                 tls: tuple[bytes, bytes] | None = None) -> tuple[grpc.Server, int]:
    """Serve `servicer` (added by the generated `register` function) on host:port;
    port 0 picks a free one; `thread_init` runs first in each of the server's threads.
    With a `secret`, every call but health checks and reflection must carry it
    (`ClusterSecretCheck`). With `tls` (PEM certificate chain, PEM private key) the port
    speaks only TLS. Returns the started server and its bound port."""
    # the secret first: a caller without it learns nothing, not even whether its request parsed
    interceptors = ([ClusterSecretCheck(secret)] if secret is not None else []) + [DecodeCheck()]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, initializer=thread_init,
                                                    thread_name_prefix=service.rsplit(".", 1)[-1]),
                         interceptors=interceptors)
    register(servicer, server)
    health_servicer = health.HealthServicer()
    for name in ("", service):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 literals need brackets
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        cert, key = tls
        bound = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    server.start()
    return server, bound
