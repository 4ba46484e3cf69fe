"""`specserve serve`: start or join a Ray cluster and place the services.

Verifier actors go where the `verifier` custom resource is, drafter pools
where `drafter` is (resource names and amounts come from the config); a
local cluster started here offers both. The router listens for clients.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field

import ray

from .actors import NAMESPACE, STATE_ACTOR, DrafterPoolActor, RouterActor, StateStoreActor, VerifierActor
from .config import ServeConfig
from .state import REDIS_URL_ENV


@dataclass
class Deployment:
    router: "ray.actor.ActorHandle"
    verifiers: list = field(default_factory=list)
    drafters: list = field(default_factory=list)
    state: "ray.actor.ActorHandle | None" = None
    address: str = ""

    def actors(self) -> list:
        return [self.router, *self.verifiers, *self.drafters] + ([self.state] if self.state else [])


def init_ray(cfg: ServeConfig) -> None:
    """Join RAY_ADDRESS, or start a local cluster offering the services' resources."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(namespace=NAMESPACE, log_to_driver=False)
        return
    resources: dict[str, float] = {}
    for part in (cfg.verifiers, cfg.drafter_pools):
        for name, amount in part.resources.items():
            resources[name] = resources.get(name, 0) + amount * part.count
    ray.init(namespace=NAMESPACE, resources=resources, include_dashboard=False, log_to_driver=False)


def deploy(cfg: ServeConfig, redis_url: str | None = None) -> Deployment:
    """Start every actor (Ray must be initialised) and return once the router serves."""
    redis_url = redis_url or os.environ.get(REDIS_URL_ENV)
    state = None
    if not redis_url:
        state = StateStoreActor.options(name=STATE_ACTOR, namespace=NAMESPACE, get_if_exists=True).remote()
    spec = cfg.model_dump()
    verifiers = [VerifierActor.options(resources=cfg.verifiers.resources).remote(spec, redis_url)
                 for _ in range(cfg.verifiers.count)]
    drafters = [DrafterPoolActor.options(resources=cfg.drafter_pools.resources).remote(spec, redis_url)
                for _ in range(cfg.drafter_pools.count)]
    router = RouterActor.remote(spec, redis_url)
    # constructors run on the actors; an address call returns once each is serving
    ray.get([a.address.remote() for a in verifiers + drafters])
    address = ray.get(router.address.remote())
    return Deployment(router, verifiers, drafters, state, address)


def shutdown(dep: Deployment) -> None:
    for actor in dep.actors():
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass


def run(cfg: ServeConfig) -> int:
    """Serve until interrupted (SIGINT or SIGTERM)."""
    init_ray(cfg)
    print(f"specserve: starting {cfg.verifiers.count} verifier(s) and {cfg.drafter_pools.count} drafter pool(s)...",
          flush=True)
    dep = deploy(cfg)
    print(f"specserve: serving on {dep.address} (gRPC, specserve.v1.Specserve)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("specserve: shutting down", flush=True)
    shutdown(dep)
    ray.shutdown()
    return 0
