"""The router's channels to verifiers and pools (router.coordinator.Channels)."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.coordinator import Channels


def health_server(port: int = 0) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port


def check(channel: grpc.Channel) -> None:
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


def test_a_dropped_address_is_dialled_afresh():
    """A service that went away and came back at the same address (a restarted pool, or a new
    one on a reused port) answers the channel made after `drop` at once. With gRPC's shared
    subchannels that channel inherited the dead one's reconnect backoff and failed UNAVAILABLE."""
    channels = Channels()
    server, port = health_server()
    address = f"127.0.0.1:{port}"
    try:
        held = channels.get(address)  # as another request's stub still holds it
        check(held)
        server.stop(None).wait()
        try:
            check(held)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
        channels.drop(address)  # as a request does when a call to it fails
        server, _ = health_server(port)
        check(channels.get(address))
        assert channels.get(address) is not held
    finally:
        server.stop(None)
        channels.close()
