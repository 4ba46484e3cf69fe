"""A drafter pool and a verifier engine behind real gRPC servers on loopback, and a
coordinator that uses them: the served path without Ray."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from drafter_service.pool import DrafterPool
from drafter_service.servicer import serve as serve_drafters
from router.adaptive import PassCostModel
from router.coordinator import Channels, Coordinator
from verifier_service.engine import VerifierEngine
from verifier_service.servicer import serve as serve_verifier


@contextmanager
def loopback(pool: DrafterPool, engine: VerifierEngine, pass_costs: PassCostModel | None = None,
             secret: str | None = None) -> Iterator[Coordinator]:
    """Serve `pool` and `engine` (refusing calls without `secret`, when given, as the served
    ones do); stop both (and close the engine) on exit."""
    (pool_server, pool_port), (verifier_server, verifier_port) = (serve_drafters(pool, secret=secret),
                                                                  serve_verifier(engine, secret=secret))
    coordinator = Coordinator(verifiers=lambda: [f"127.0.0.1:{verifier_port}"],
                              drafters=lambda: [f"127.0.0.1:{pool_port}"], pass_costs=pass_costs,
                              channels=Channels(secret=secret))
    try:
        yield coordinator
    finally:
        coordinator.services.channels.close()
        pool_server.stop(None)
        verifier_server.stop(None)
        engine.close()
