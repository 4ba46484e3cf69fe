"""Start the gRPC server of one of our services, with standard health
checking and server reflection, as every specserve server has; the internal
services (verifier, drafter pools) also check the cluster secret of every call, and with
`MutualTls` speak only TLS to callers holding a certificate of the cluster's CA. A request
that does not parse is refused as INVALID_ARGUMENT."""

from __future__ import annotations

import hmac
import ssl
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Sequence

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


@dataclass(frozen=True, repr=False)
class MutualTls:
    """Mutual TLS of the internal calls: each side presents `cert` (PEM chain, with its PEM
    `key`) and accepts only a peer whose certificate `ca` (PEM) signed. A caller checks the
    service's certificate for the host of the address it dials (an IP its certificate must
    name), or for `server_name` when given (one name every service's certificate holds)."""

    cert: bytes
    key: bytes
    ca: bytes
    server_name: str | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        options = list(options) + ([("grpc.ssl_target_name_override", self.server_name)] if self.server_name else [])
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(self.ca, self.key, self.cert), options)


def internal_channel(address: str, tls: MutualTls | None,
                     options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to an internal service: over mutual TLS when the cluster has it, else plain."""
    return tls.channel(address, options) if tls is not None else grpc.insecure_channel(address, list(options))


def check_mutual_tls(cert: bytes, key: bytes, ca: bytes, server_name: str | None = None) -> None:
    """ValueError, saying what is wrong, unless `cert` and `key` make a pair that `ca` signed
    (in date), and, with `server_name` (a name or an IP address), the certificate names it:
    the handshake of two internal services, made in memory before any server starts."""
    import os
    import tempfile

    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = server_name is not None
    with tempfile.TemporaryDirectory() as tmp:  # ssl loads a chain only from files
        cert_file, key_file = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        with open(cert_file, "wb") as f:
            f.write(cert)
        with open(os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(key)
        try:
            server.load_cert_chain(cert_file, key_file)
            client.load_cert_chain(cert_file, key_file)
        except ssl.SSLError as e:
            raise ValueError(f"the certificate and key do not load as a PEM pair ({_reason(e)})") from None
    try:
        for context in (server, client):
            context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as e:
        raise ValueError(f"the CA file holds no PEM certificate ({_reason(e)})") from None
    server.verify_mode = ssl.CERT_REQUIRED
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    ends = [client.wrap_bio(to_client, to_server, server_hostname=server_name),
            server.wrap_bio(to_server, to_client, server_side=True)]
    done = [False, False]
    try:
        for _ in range(8):
            for i, end in enumerate(ends):
                if not done[i]:
                    try:
                        end.do_handshake()
                        done[i] = True
                    except ssl.SSLWantReadError:
                        pass
            if all(done):
                ends[0].write(b"x")  # TLS 1.3: the server checks the client's certificate by now
                ends[1].read(1)
                return
    except ssl.SSLCertVerificationError as e:
        raise ValueError(f"the certificate is not accepted: {e.verify_message}") from None
    except ssl.SSLError as e:
        raise ValueError(f"a TLS handshake with this certificate fails ({_reason(e)})") from None
    raise ValueError("a TLS handshake with this certificate does not complete")


def _reason(e: ssl.SSLError) -> str:
    return getattr(e, "reason", None) or str(e)


def start_server(register: Callable[[Any, grpc.Server], None], servicer: Any, service: str,
                 host: str, port: int, max_workers: int,
                 thread_init: Callable[[], None] | None = None,
                 secret: str | None = None,
                 tls: tuple[bytes, bytes] | None = None,
                 mutual_tls: MutualTls | None = None) -> tuple[grpc.Server, int]:
    """Serve `servicer` (added by the generated `register` function) on host:port;
    port 0 picks a free one; `thread_init` runs first in each of the server's threads.
    With a `secret`, every call but health checks and reflection must carry it
    (`ClusterSecretCheck`). With `tls` (PEM certificate chain, PEM private key) the port
    speaks only TLS; with `mutual_tls`, only TLS with callers whose certificate the
    cluster's CA signed. Returns the started server and its bound port."""
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
    if mutual_tls is not None:
        bound = server.add_secure_port(address, mutual_tls.server_credentials())
    elif tls is None:
        bound = server.add_insecure_port(address)
    else:
        cert, key = tls
        bound = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    server.start()
    return server, bound
