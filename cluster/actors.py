"""Ray actors that host the services: each loads what it needs, serves gRPC on
a free port, and keeps its `host:port` registered in the state store with a
heartbeat. Ray restarts an actor that dies; its constructor then serves and
registers again (on a new port), and routers find it through the store.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import ray

from .config import RegistrySettings, ServeConfig

log = logging.getLogger(__name__)

STATE_ACTOR = "specserve-state"
NAMESPACE = "specserve"
DRAIN_POLL_S = 0.2  # how often a draining service looks whether its requests are done


@ray.remote(num_cpus=0, max_restarts=-1)
class StateStoreActor:
    """The embedded store, hosted once so every actor process shares it."""

    def __init__(self):
        from .state import EmbeddedStateStore

        self.store = EmbeddedStateStore()

    def call(self, method: str, *args, **kwargs):
        return getattr(self.store, method)(*args, **kwargs)


class _ActorStore:
    """The StateStore interface, forwarded to the state actor."""

    def __init__(self, handle):
        self._handle = handle

    def __getattr__(self, method: str):
        return lambda *args, **kwargs: ray.get(self._handle.call.remote(method, *args, **kwargs))


def connect_store(redis_url: str | None):
    """Redis when a URL is given, else the embedded store in the named state actor."""
    if redis_url:
        from .state import open_state_store

        return open_state_store(redis_url)
    # the first service to start creates it (`specserve serve` and `serve run` alike); detached,
    # so it outlives the replica that created it
    return _ActorStore(StateStoreActor.options(name=STATE_ACTOR, namespace=NAMESPACE, get_if_exists=True,
                                               lifetime="detached").remote())


class _Registration:
    """Keeps one service registered while its process lives."""

    def __init__(self, store, kind: str, address: str, cfg: RegistrySettings, meta: dict | None = None):
        self.store, self.kind, self.address, self.cfg = store, kind, address, cfg
        self.service_id = f"{kind}-{uuid.uuid4().hex[:8]}"
        self.meta = {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), **(meta or {})}
        self.store.register_service(kind, self.service_id, address, cfg.service_ttl_s, self.meta)
        self._stop = threading.Event()
        threading.Thread(target=self._beat, name=f"{kind}-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_s):
            try:
                if not self.store.heartbeat(self.kind, self.service_id, self.cfg.service_ttl_s):
                    self.store.register_service(self.kind, self.service_id, self.address,
                                                self.cfg.service_ttl_s, self.meta)
            except Exception:  # the store may be briefly unreachable; keep trying
                log.exception("heartbeat of %s failed", self.service_id)

    def stop(self) -> None:
        self._stop.set()
        try:
            self.store.deregister_service(self.kind, self.service_id)
        except Exception:
            pass


def load_on_one_thread(cfg: ServeConfig):
    """The target, loaded with torch on one thread, where torch stays.

    libgomp keeps an OpenMP team for every thread that ever ran a parallel region, and
    once its teams hold more threads than there are cores it stops spinning between
    regions: had this (the actor's) thread run one with several threads, every op of the
    thread that serves would pay a wake-up (linear layers 2-3x slower, docs/DESIGN-NOTES.md).
    So only the threads that serve go wider (`speculative.cpu_tuning.own_torch_threads`)."""
    import torch

    from cluster.env import cache_dir_from_env, cpu_tuning_from_env
    from speculative import loading

    torch.set_num_threads(1)
    return loading.load(cfg.model, cfg.device, cfg.dtype, cache_dir=cache_dir_from_env(),
                        cpu_tuning=cpu_tuning_from_env())


class _ServiceHost:
    """A service's process: what it serves, its gRPC server and its registration. Hosted
    by a plain Ray actor (`specserve serve` without Serve, the tests) or a Serve replica
    (deploy/app.py)."""

    kind = ""

    def address(self) -> str:
        return self.registration.address

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    def held(self) -> int:
        """Requests this service holds now (a draining replica waits for none)."""
        return 0

    def drain(self, timeout_s: float) -> None:
        """Leave the registry, so no new request comes, let the requests held finish (for up to
        `timeout_s`; a router resumes any left from its checkpoint elsewhere), then shut down."""
        if not hasattr(self, "registration"):  # the constructor failed: nothing to drain
            return
        self.registration.stop()
        give_up = time.monotonic() + timeout_s
        while self.held() and time.monotonic() < give_up:
            time.sleep(DRAIN_POLL_S)
        self.shutdown()

    def shutdown(self) -> None:
        self.registration.stop()
        self.server.stop(grace=1.0)
        for hook in getattr(self, "close_hooks", ()):
            try:
                hook()
            except Exception:  # shutting down: the store may be gone already
                pass


class VerifierHost(_ServiceHost):
    kind = "verifier"

    def __init__(self, cfg_dict: dict, redis_url: str | None):
        from verifier_service.engine import VerifierEngine
        from cluster.local import cpu_cores
        from verifier_service.servicer import serve

        cfg = ServeConfig.model_validate(cfg_dict)
        model, _ = load_on_one_thread(cfg)
        store = connect_store(redis_url)
        v = cfg.verifiers
        self.engine = VerifierEngine(model, max_batch=v.max_batch, max_len=v.max_len,
                                     max_batch_tokens=v.max_batch_tokens, checkpoints=store,
                                     threads=v.threads or cpu_cores())
        self.server, port = serve(self.engine, host="0.0.0.0", port=0)
        self.cfg, self.store = cfg, store
        self.registration = _Registration(store, self.kind, f"{ray.util.get_node_ip_address()}:{port}",
                                          cfg.registry)

    def stats(self) -> dict:
        return self.engine.stats()

    def held(self) -> int:
        return self.engine.stats()["active_requests"]


class DrafterPoolHost(_ServiceHost):
    kind = "drafter"

    def __init__(self, cfg_dict: dict, redis_url: str | None):
        from drafter_service.pool import DrafterPool
        from drafter_service.servicer import serve

        cfg = ServeConfig.model_validate(cfg_dict)
        model, _ = load_on_one_thread(cfg)
        store = connect_store(redis_url)
        pools = cfg.drafter_pools
        self.pool = DrafterPool(model, kinds=tuple(pools.kinds))
        self.server, port = serve(self.pool, host="0.0.0.0", port=0, threads=pools.threads)
        self.cfg, self.store = cfg, store
        self.registration = _Registration(store, self.kind, f"{ray.util.get_node_ip_address()}:{port}",
                                          cfg.registry, meta={"kinds": pools.kinds})

    def held(self) -> int:
        return self.pool.active_requests()


class RouterHost(_ServiceHost):
    kind = "router"

    def __init__(self, cfg_dict: dict, redis_url: str | None):
        import torch

        from cluster.env import cache_dir_from_env
        from router.adaptive import PassCostModel
        from router.coordinator import SPARE_SLOTS, Coordinator
        from router.expertise import ExpertiseRouter
        from router.metrics import RouterMetrics
        from router.servicer import RouterConfig, RouterServicer, serve
        from speculative import loading
        from speculative.drafter_kinds import drafter_domains

        # the router's tensor work (trees, fusion) is small and spread over many threads:
        # one torch thread each keeps libgomp from throttling them (load_on_one_thread)
        torch.set_num_threads(1)
        cfg = ServeConfig.model_validate(cfg_dict)
        tokenizer, model_cfg = loading.load_tokenizer(cfg.model, cache_dir=cache_dir_from_env())
        store = connect_store(redis_url)

        def live(kind):
            return lambda: [s.address for s in store.list_services(kind)]

        # verify costs, learned from the verifiers' pass timings with the settings as priors
        settings = cfg.router
        pass_costs = (PassCostModel(settings.verify_row_cost, settings.verify_token_cost, settings.verify_pad_cost)
                      if settings.learn_verify_costs else None)
        coordinator = Coordinator(verifiers=live("verifier"), drafters=live("drafter"), pass_costs=pass_costs,
                                  service_wait_s=settings.service_wait_s)
        # a request, and the largest tree a round can send, must fit the verifier's KV slots
        # as well as the model's context
        largest_tree = max(settings.draft_length, settings.tree_budget)
        context = min(model_cfg.max_position_embeddings, cfg.verifiers.max_len - largest_tree - SPARE_SLOTS)
        config = RouterConfig.of(settings, context_length=context,
                                 eos_token_ids=tokenizer.eos_token_ids or model_cfg.eos_token_ids,
                                 vocab_size=model_cfg.vocab_size, routed_drafters=tuple(cfg.drafter_pools.kinds))
        # expertise statistics live in the shared store: every router replica learns from all traffic
        # a drafter trained for a domain is tried first there before there is any evidence
        specialties = {kind: drafter_domains(kind) for kind in cfg.drafter_pools.kinds}
        self.expertise = ExpertiseRouter(store, refresh_s=settings.routing_refresh_s, specialties=specialties)
        metrics = RouterMetrics()
        if cfg.metrics_port is not None:
            metrics.serve(cfg.metrics_port, cfg.host)
        self.servicer = RouterServicer(tokenizer, coordinator, config, self.expertise, metrics)
        self.server, port = serve(self.servicer, host=cfg.host, port=cfg.port)
        self.close_hooks = [self.servicer.close]  # every namespace's routing outcomes
        self.store, self.cfg = store, cfg
        host = ray.util.get_node_ip_address() if cfg.host in ("0.0.0.0", "::") else cfg.host
        self.registration = _Registration(store, self.kind, f"{host}:{port}", cfg.registry)

    def held(self) -> int:
        return self.servicer.ongoing

    def ready(self) -> str | None:
        """None when a request would succeed now, else why not (`services_ready`)."""
        return services_ready(self.store, self.cfg)


def services_ready(store, cfg: ServeConfig, timeout_s: float = 1.0) -> str | None:
    """None when a verifier and pools hosting every configured drafter are registered and
    answer their health checks, else what is missing."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def serving(address: str) -> bool:
        with grpc.insecure_channel(address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    if not any(serving(s.address) for s in store.list_services("verifier")):
        return "no verifier is serving yet"
    if cfg.drafter_pools.count:
        hosted = set()
        for s in store.list_services("drafter"):
            if serving(s.address):
                hosted.update(s.meta.get("kinds", ()))
        missing = sorted(set(cfg.drafter_pools.kinds) - hosted)
        if missing:
            return f"no drafter pool serving {', '.join(missing)} yet"
    return None


@ray.remote(num_cpus=0, max_restarts=-1)
class VerifierActor(VerifierHost):
    pass


@ray.remote(num_cpus=0, max_restarts=-1)
class DrafterPoolActor(DrafterPoolHost):
    pass


@ray.remote(num_cpus=0, max_restarts=-1)
class RouterActor(RouterHost):
    pass
