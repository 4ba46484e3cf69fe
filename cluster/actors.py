"""Ray actors that host the services: each loads what it needs, serves gRPC on
a free port, and keeps its `host:port` registered in the state store with a
heartbeat. Ray restarts an actor that dies; its constructor then serves and
registers again (on a new port), and routers find it through the store.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid

import ray

from .config import RegistrySettings, ServeConfig

log = logging.getLogger(__name__)

STATE_ACTOR = "specserve-state"
NAMESPACE = "specserve"


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
    return _ActorStore(ray.get_actor(STATE_ACTOR, namespace=NAMESPACE))


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


class _ServiceActor:
    kind = ""

    def address(self) -> str:
        return self.registration.address

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.registration.stop()
        self.server.stop(grace=1.0)
        for hook in getattr(self, "close_hooks", ()):
            try:
                hook()
            except Exception:  # shutting down: the store may be gone already
                pass


@ray.remote(num_cpus=0, max_restarts=-1)
class VerifierActor(_ServiceActor):
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
        self.registration = _Registration(store, self.kind, f"{ray.util.get_node_ip_address()}:{port}",
                                          cfg.registry)

    def stats(self) -> dict:
        return self.engine.stats()


@ray.remote(num_cpus=0, max_restarts=-1)
class DrafterPoolActor(_ServiceActor):
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
        self.registration = _Registration(store, self.kind, f"{ray.util.get_node_ip_address()}:{port}",
                                          cfg.registry, meta={"kinds": pools.kinds})


@ray.remote(num_cpus=0, max_restarts=-1)
class RouterActor(_ServiceActor):
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
        coordinator = Coordinator(verifiers=live("verifier"), drafters=live("drafter"), pass_costs=pass_costs)
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
        servicer = RouterServicer(tokenizer, coordinator, config, self.expertise, metrics)
        self.server, port = serve(servicer, host=cfg.host, port=cfg.port)
        self.close_hooks = [servicer.close]  # every namespace's routing outcomes
        host = ray.util.get_node_ip_address() if cfg.host in ("0.0.0.0", "::") else cfg.host
        self.registration = _Registration(store, self.kind, f"{host}:{port}", cfg.registry)
