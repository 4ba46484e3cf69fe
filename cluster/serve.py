"""`specserve serve`: start or join a Ray cluster and place the services.

Verifier actors go where the `verifier` custom resource is, drafter pools
where `drafter` is (resource names and amounts come from the config); a
local cluster started here offers both. The router listens for clients.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import ray

from .actors import NAMESPACE, STATE_ACTOR, DrafterPoolActor, RouterActor, StateStoreActor, VerifierActor
from .config import ServeConfig, open_access_warning
from .ray_start import start_local_ray
from .state import REDIS_URL_ENV

APP_NAME = "specserve"
READY_POLL_S = 0.5


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
        most = max(part.count, part.max_count or 0)  # room for every replica autoscaling may start
        for name, amount in part.resources.items():
            resources[name] = resources.get(name, 0) + amount * most
    start_local_ray(namespace=NAMESPACE, resources=resources, include_dashboard=False, log_to_driver=False)


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


def start_app(cfg: ServeConfig, redis_url: str | None = None, progress=print):
    """Deploy the Serve application (deploy/app.py) on the Ray cluster (initialised) and
    return the router's handle once a request would succeed (`progress` hears why not yet)."""
    from ray import serve

    from deploy.app import build

    http = {"host": cfg.host, "port": cfg.http.port}
    if cfg.security.tls() is not None:
        http.update(ssl_certfile=cfg.security.tls_cert_file, ssl_keyfile=cfg.security.tls_key_file)
    serve.start(http_options=http)
    serve.run(build(cfg, redis_url), name=APP_NAME, route_prefix="/", blocking=False)
    router = serve.get_deployment_handle("Router", app_name=APP_NAME)
    said = None
    while (reason := router.ready.remote().result()) is not None:
        if reason != said:
            progress(f"specserve: waiting: {reason}")
            said = reason
        time.sleep(READY_POLL_S)
    return router


def run(cfg: ServeConfig) -> int:
    """Serve the application until interrupted (SIGINT or SIGTERM)."""
    from ray import serve

    warning = open_access_warning(cfg)
    if warning:
        print(f"specserve: warning: {warning}", flush=True)
    init_ray(cfg)
    print(f"specserve: starting {cfg.verifiers.count} verifier(s) and {cfg.drafter_pools.count} drafter pool(s)...",
          flush=True)
    start_app(cfg, progress=lambda line: print(line, flush=True))
    grpc_address = f"{cfg.host}:{cfg.port}"
    scheme, tls = ("https", ", TLS") if cfg.security.tls() else ("http", "")
    print(f"specserve: serving on {scheme}://{cfg.host}:{cfg.http.port}/v1 (OpenAI HTTP) and {grpc_address} "
          f"(gRPC{tls}, specserve.v1.Specserve)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("specserve: shutting down", flush=True)
    serve.shutdown()
    ray.shutdown()
    return 0
