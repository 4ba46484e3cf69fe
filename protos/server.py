"""Start the gRPC server of one of our services, with standard health
checking and server reflection, as every specserve server has."""

from __future__ import annotations

import time
from concurrent import futures
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

NO_DEADLINE_S = 1e7  # time_remaining() above this means the caller set no deadline


def call_deadline(context: grpc.ServicerContext) -> float | None:
    """When the caller stops waiting (time.monotonic()), None if it set no deadline: a call
    without one reports a huge time remaining, which passed downstream overflows."""
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_S:
        return None
    return time.monotonic() + remaining


def start_server(register: Callable[[Any, grpc.Server], None], servicer: Any, service: str,
                 host: str, port: int, max_workers: int,
                 thread_init: Callable[[], None] | None = None) -> tuple[grpc.Server, int]:
    """Serve `servicer` (added by the generated `register` function) on host:port;
    port 0 picks a free one; `thread_init` runs first in each of the server's threads.
    Returns the started server and its bound port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, initializer=thread_init,
                                                    thread_name_prefix=service.rsplit(".", 1)[-1]))
    register(servicer, server)
    health_servicer = health.HealthServicer()
    for name in ("", service):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 literals need brackets
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    server.start()
    return server, bound
