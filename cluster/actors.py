"""Ray actors that host the services: each loads what it needs, serves gRPC on
a free port, and keeps its `host:port` registered in the state store with a
heartbeat. Ray restarts an actor that dies; its constructor then serves and
registers again (on a new port), and routers find it through the store.

Internal services (verifiers, drafter pools, their metrics) are no open doors:
they listen on loopback on a one-node cluster and on the node's address
otherwise, never on all interfaces (`internal_host`), and refuse every call
that does not carry the cluster secret (`cluster_secret`), which the routers'
channels add to each call; with `[security] internal_tls_*` they speak only mutual TLS,
with peers holding a certificate of the cluster's CA.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
import uuid

import ray

from .config import RegistrySettings, ServeConfig

log = logging.getLogger(__name__)

STATE_ACTOR = "specserve-state"
LOOPBACK = "127.0.0.1"
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
    So only the threads that serve go wider (`runtime.cpu_tuning.own_torch_threads`)."""
    import torch

    from cluster.env import cache_dir_from_env, cpu_tuning_from_env
    from runtime import loading

    torch.set_num_threads(1)
    return loading.load(cfg.model, cfg.device, cfg.dtype, cache_dir=cache_dir_from_env(),
                        cpu_tuning=cpu_tuning_from_env())


def verifier_slots(cfg: ServeConfig) -> int:
    """KV slots a verifier holds for one request: `[verifiers] max_len`, the most tokens of a
    request's prompt and output, and past it room for a round's largest tree (the tokens a
    grammar forces included) and its root."""
    from router.coordinator import SPARE_SLOTS
    from speculative.processing import MAX_FORCED

    r = cfg.router
    return cfg.verifiers.max_len + max(r.draft_length, r.tree_budget) + MAX_FORCED + SPARE_SLOTS


def target_grammars(cfg: ServeConfig, vocab_size: int):
    """The grammar engine for the target's tokenizer (structured outputs, tool calls)."""
    from cluster.env import cache_dir_from_env
    from runtime import loading
    from speculative.grammar import Grammars

    tokenizer, _ = loading.load_tokenizer(cfg.model, cache_dir=cache_dir_from_env())
    return Grammars.for_tokenizer(tokenizer, vocab_size)


def internal_host(cfg: ServeConfig) -> str:
    """The address a verifier, a drafter pool and their metrics listen on and register
    (`[security] internal_host`): auto is loopback while the Ray cluster is one node (nothing
    off this machine needs to reach them), else the node's address as Ray reports it."""
    choice = cfg.security.internal_host
    if choice == "auto":
        choice = "loopback" if sum(1 for node in ray.nodes() if node["Alive"]) == 1 else "node"
    return LOOPBACK if choice == "loopback" else ray.util.get_node_ip_address()


def host_node(cfg: ServeConfig) -> dict | None:
    """The Ray node whose address is the router's `host`, when it is one (ray.nodes()'s
    entry): the routers and the HTTP proxy must run there to listen on it. None for
    loopback, all interfaces, a name, or an address no live node has (then anywhere)."""
    try:
        address = ipaddress.ip_address(cfg.host)
    except ValueError:
        return None
    if address.is_loopback or address.is_unspecified or not ray.is_initialized():
        return None
    return next((node for node in ray.nodes() if node["Alive"] and node["NodeManagerAddress"] == cfg.host), None)


def router_resources(cfg: ServeConfig) -> dict[str, float]:
    """Ray resources that put a router (and the HTTP ingress) on `host_node`: Ray gives each
    node a `node:<address>` resource (a sliver of it is asked)."""
    node = host_node(cfg)
    return {f"node:{cfg.host}": 0.001} if node is not None else {}


def cluster_secret(cfg: ServeConfig, store) -> str:
    """The secret every call to a verifier or drafter pool carries: the config's, else
    SPECSERVE_CLUSTER_SECRET, else the one the state store keeps (generated by the first
    service to ask)."""
    from cluster.env import cluster_secret_from_env

    return cfg.security.cluster_secret or cluster_secret_from_env() or store.get_or_create_cluster_secret()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name
        return host == "localhost"


def reachable_services(store, kind: str) -> list:
    """The live services of a kind this process can reach: a service listening on loopback
    only from its own node (one registered on a one-node cluster that has grown since)."""
    here = ray.get_runtime_context().get_node_id()
    return [s for s in store.list_services(kind)
            if s.meta.get("node") == here or not _is_loopback(s.address.rsplit(":", 1)[0])]


def serve_metrics(registry, bind_host: str, advertise_host: str, port: int = 0):
    """Serve a Prometheus registry over HTTP on `bind_host` (port 0: a free one). Returns the
    `host:port` to register (`meta["metrics"]`; the HTTP ingress's /metrics gathers them all)
    and a function that stops the server."""
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=bind_host, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return f"{advertise_host}:{server.server_port}", stop


class _ServiceHost:
    """A service's process: what it serves, its gRPC server and its registration. Hosted
    by a Serve replica (deploy/app.py), or by a plain Ray actor in the tests."""

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
        from cluster.local import cpu_cores, pin_to_cores
        from verifier_service.servicer import serve

        cfg = ServeConfig.model_validate(cfg_dict)
        v = cfg.verifiers
        if v.cores:
            pin_to_cores(v.cores, "verifiers.cores")
        threads = v.threads or cpu_cores()
        self.tensor_parallel = None
        if v.tensor_parallel > 1:  # this process is rank 0 (cluster/tp_ranks.py)
            from cluster.tp_ranks import ServedRanks
            from verifier_service.tp_group import threads_per_rank

            threads = v.threads or threads_per_rank(v.tensor_parallel)
            self.tensor_parallel = ServedRanks(cfg, threads)
            model = self.tensor_parallel.target
        else:
            model, _ = load_on_one_thread(cfg)
        store = connect_store(redis_url)
        self.engine = VerifierEngine(model, max_batch=v.max_batch, max_len=verifier_slots(cfg),
                                     max_batch_tokens=v.max_batch_tokens, checkpoints=store, threads=threads,
                                     kv_cache_memory=v.kv_cache_memory, kv_block_size=v.kv_block_size,
                                     checkpoint_interval_s=v.checkpoint_interval_s,
                                     grammars=target_grammars(cfg, model.config.vocab_size),
                                     cuda_graphs=v.cuda_graphs)
        host = internal_host(cfg)
        self.server, port = serve(self.engine, host=host, port=0, secret=cluster_secret(cfg, store),
                                  mutual_tls=cfg.security.internal_tls(check=True, address=host))
        self.cfg, self.store = cfg, store
        metrics, stop_metrics = serve_metrics(self.engine.metrics.registry, host, host)
        self.close_hooks = [stop_metrics] + ([self.tensor_parallel.close] if self.tensor_parallel else [])
        self.registration = _Registration(store, self.kind, f"{host}:{port}", cfg.registry,
                                          meta={"metrics": metrics})

    def stats(self) -> dict:
        return self.engine.stats()

    def held(self) -> int:
        return self.engine.stats()["active_requests"]


def learning_drafters(cfg: ServeConfig) -> list[str]:
    """The pools' drafter kinds that learn online (small drafters with a checkpoint), if any do."""
    from speculative.drafter_kinds import drafter_path

    if not cfg.drafter_pools.learner.enabled:
        return []
    return [kind for kind in cfg.drafter_pools.kinds if drafter_path(kind) is not None]


def online_learning(cfg: ServeConfig, store, target, registry):
    """The pool's online learner, started, when `[drafter_pools.learner]` enables it (else None):
    it publishes under the cache directory (which every pool must share: one node, or a
    shared disk) and records versions in the state store."""
    settings = cfg.drafter_pools.learner
    if not settings.enabled:
        return None
    from cluster.env import cache_dir_from_env
    from drafter_service.learner import OnlineLearning
    from drafter_service.metrics import LearnerMetrics
    from drafter_service.published import PublishedDrafters
    from runtime.cache import cache_root

    published = PublishedDrafters(cache_root(cache_dir_from_env()) / "online-drafters", store,
                                  settings.refresh_s)
    learning = OnlineLearning(settings, published, target.config.vocab_size, LearnerMetrics(registry))
    learning.start()
    return learning


class DrafterPoolHost(_ServiceHost):
    kind = "drafter"

    def __init__(self, cfg_dict: dict, redis_url: str | None):
        from cluster.local import pin_to_cores
        from drafter_service.costs import draft_token_costs
        from drafter_service.metrics import DrafterMetrics
        from drafter_service.pool import DrafterPool
        from drafter_service.servicer import serve

        cfg = ServeConfig.model_validate(cfg_dict)
        pools = cfg.drafter_pools
        if pools.cores:
            pin_to_cores(pools.cores, "drafter_pools.cores")
        model, _ = load_on_one_thread(cfg)
        store = connect_store(redis_url)
        metrics = DrafterMetrics()
        learning = online_learning(cfg, store, model, metrics.registry)
        self.pool = DrafterPool(model, kinds=tuple(pools.kinds), parallel_layers=pools.parallel_layers,
                                metrics=metrics, learning=learning, cuda_graphs=pools.cuda_graphs)
        host = internal_host(cfg)
        self.server, port = serve(self.pool, host=host, port=0, threads=pools.threads,
                                  secret=cluster_secret(cfg, store),
                                  mutual_tls=cfg.security.internal_tls(check=True, address=host))
        self.cfg, self.store = cfg, store
        metrics, stop_metrics = serve_metrics(self.pool.metrics.registry, host, host)
        self.close_hooks = [stop_metrics] + ([learning.stop] if learning is not None else [])
        # what each kind costs a token here, for routers to start from (drafter_service.costs)
        costs = draft_token_costs(model, pools.kinds)
        self.registration = _Registration(store, self.kind, f"{host}:{port}", cfg.registry,
                                          meta={"kinds": pools.kinds, "metrics": metrics, "draft_costs": costs})

    def held(self) -> int:
        return self.pool.active_requests()


class RouterHost(_ServiceHost):
    kind = "router"

    def __init__(self, cfg_dict: dict, redis_url: str | None):
        import torch

        from cluster.env import cache_dir_from_env
        from router.adaptive import PassCostModel
        from router.auth import Gatekeeper
        from router.coordinator import Channels, Coordinator
        from router.expertise import ExpertiseRouter
        from router.metrics import RouterMetrics
        from router.servicer import RouterConfig, RouterServicer, prompt_char_limit, prompt_limit, serve
        from runtime import loading
        from speculative.drafter_kinds import drafter_domains
        from speculative.grammar import Grammars

        # the router's tensor work (trees, fusion) is small and spread over many threads:
        # one torch thread each keeps libgomp from throttling them (load_on_one_thread)
        torch.set_num_threads(1)
        cfg = ServeConfig.model_validate(cfg_dict)
        tokenizer, model_cfg = loading.load_tokenizer(cfg.model, cache_dir=cache_dir_from_env())
        store = connect_store(redis_url)

        def live(kind):
            return LastKnown(lambda: [s.address for s in reachable_services(store, kind)], f"{kind} registry")

        # verify costs, learned from the verifiers' pass timings with the settings as priors
        settings = cfg.router
        pass_costs = (PassCostModel(settings.verify_row_cost, settings.verify_token_cost, settings.verify_pad_cost)
                      if settings.learn_verify_costs else None)
        # every call to a verifier or a pool carries the cluster secret (over mutual TLS, when set)
        channels = Channels(secret=cluster_secret(cfg, store), tls=cfg.security.internal_tls(check=True))
        coordinator = Coordinator(verifiers=live("verifier"), drafters=live("drafter"), pass_costs=pass_costs,
                                  service_wait_s=settings.service_wait_s, channels=channels,
                                  learning_drafters=learning_drafters(cfg), calibrate=settings.calibrate,
                                  prior_draft_costs=Refreshed(LastKnown(lambda: pools_draft_costs(store),
                                                                        "drafter registry", {}),
                                                              settings.routing_refresh_s))
        # one limit: a request's prompt and output together fit [verifiers] max_len (and the
        # model's context); the verifiers hold room for a round's tree past it (verifier_slots)
        context = min(model_cfg.max_position_embeddings, cfg.verifiers.max_len)
        config = RouterConfig.of(settings, context_length=context,
                                 eos_token_ids=tokenizer.eos_token_ids or model_cfg.eos_token_ids,
                                 vocab_size=model_cfg.vocab_size, routed_drafters=tuple(cfg.drafter_pools.kinds),
                                 max_prompt_chars=prompt_char_limit(tokenizer, prompt_limit(settings, context)))
        # expertise statistics live in the shared store: every router replica learns from all traffic
        # a drafter trained for a domain is tried first there before there is any evidence
        specialties = {kind: drafter_domains(kind) for kind in cfg.drafter_pools.kinds}
        self.expertise = ExpertiseRouter(store, refresh_s=settings.routing_refresh_s, specialties=specialties)
        metrics = RouterMetrics()
        host = ray.util.get_node_ip_address() if cfg.host in ("0.0.0.0", "::") else cfg.host
        # on the configured metrics_port (Prometheus may scrape it there), else a free port
        metrics_address, stop_metrics = serve_metrics(metrics.registry, cfg.host, host, cfg.metrics_port or 0)
        gatekeeper = Gatekeeper(store, require_keys=cfg.security.require_api_keys)
        self.servicer = RouterServicer(tokenizer, coordinator, config, self.expertise, metrics, gatekeeper,
                                       grammars=Grammars.for_tokenizer(tokenizer, model_cfg.vocab_size))
        self.server, port = serve(self.servicer, host=cfg.host, port=cfg.port, tls=cfg.security.tls())
        self.store, self.cfg = store, cfg
        self.close_hooks = [self.servicer.close, stop_metrics]  # the servicer: every namespace's routing outcomes
        self.registration = _Registration(store, self.kind, f"{host}:{port}", cfg.registry,
                                          meta={"metrics": metrics_address})

    def held(self) -> int:
        return self.servicer.ongoing

    def ready(self) -> str | None:
        """None when a request would succeed now, else why not (`services_ready`)."""
        try:
            return services_ready(self.store, self.cfg)
        except Exception as e:  # noqa: BLE001 - the store is down: not ready, and say why
            return f"the state store is unreachable ({type(e).__name__})"

    def metrics_targets(self) -> list[tuple[str, str, str]]:
        """(kind, service id, metrics host:port) of every registered service that serves its
        metrics (the HTTP ingress's /metrics gathers them)."""
        return [(kind, s.service_id, s.meta["metrics"]) for kind in ("router", "verifier", "drafter")
                for s in reachable_services(self.store, kind) if s.meta.get("metrics")]


def pools_draft_costs(store) -> dict[str, float]:
    """Each drafter kind's token cost as the registered pools measured it (the highest, when
    pools disagree)."""
    costs: dict[str, float] = {}
    for service in store.list_services("drafter"):
        for kind, cost in (service.meta.get("draft_costs") or {}).items():
            costs[kind] = max(cost, costs.get(kind, 0.0))
    return costs


class LastKnown:
    """A lookup in the state store that answers what it last found while the store is
    unreachable (restarting, a network blip): requests go on with the services they knew."""

    def __init__(self, lookup, what: str, nothing=None):
        """`nothing`: the answer before any lookup succeeded (default: an empty list)."""
        self.lookup, self.what, self.last = lookup, what, [] if nothing is None else nothing

    def __call__(self):
        try:
            self.last = self.lookup()
        except Exception as e:  # noqa: BLE001 - any store failure: keep serving from what we knew
            log.warning("%s unreachable (%s); using the last %d known", self.what, e, len(self.last))
        return self.last


class Refreshed:
    """A lookup asked at most once every `every_s` seconds; its answer kept between."""

    def __init__(self, lookup, every_s: float, clock=time.monotonic):
        self.lookup, self.every_s, self.clock = lookup, every_s, clock
        self._answer, self._next = None, -float("inf")
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            if self.clock() >= self._next:
                self._answer, self._next = self.lookup(), self.clock() + self.every_s
            return self._answer


def services_ready(store, cfg: ServeConfig, timeout_s: float = 1.0) -> str | None:
    """None when a verifier and pools hosting every configured drafter are registered and
    answer their health checks, else what is missing."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from protos.server import internal_channel

    tls = cfg.security.internal_tls()

    def serving(address: str) -> bool:
        with internal_channel(address, tls) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    # health checks need no cluster secret (protos.server.OPEN_SERVICES)
    if not any(serving(s.address) for s in reachable_services(store, "verifier")):
        return "no verifier is serving yet"
    if cfg.drafter_pools.count:
        hosted = set()
        for s in reachable_services(store, "drafter"):
            if serving(s.address):
                hosted.update(s.meta.get("kinds", ()))
        missing = sorted(set(cfg.drafter_pools.kinds) - hosted)
        if missing:
            return f"no drafter pool serving {', '.join(missing)} yet"
    return None
