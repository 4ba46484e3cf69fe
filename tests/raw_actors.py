"""The services as plain Ray actors, without Serve: what tests of the hosts themselves
(failover, placement on several nodes, where internal services listen) deploy, each
actor restarted by Ray when it dies. `specserve serve` deploys them through Serve
(deploy/app.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import ray

from cluster.actors import (NAMESPACE, STATE_ACTOR, DrafterPoolHost, RouterHost, StateStoreActor,
                            VerifierHost)
from cluster.config import ServeConfig
from cluster.state import REDIS_URL_ENV


@ray.remote(num_cpus=0, max_restarts=-1)
class VerifierActor(VerifierHost):
    pass


@ray.remote(num_cpus=0, max_restarts=-1)
class DrafterPoolActor(DrafterPoolHost):
    pass


@ray.remote(num_cpus=0, max_restarts=-1)
class RouterActor(RouterHost):
    pass


@dataclass
class Deployment:
    router: "ray.actor.ActorHandle"
    verifiers: list = field(default_factory=list)
    drafters: list = field(default_factory=list)
    state: "ray.actor.ActorHandle | None" = None
    address: str = ""

    def actors(self) -> list:
        return [self.router, *self.verifiers, *self.drafters] + ([self.state] if self.state else [])


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
