"""The specserve Ray Serve application: the OpenAI-compatible HTTP ingress, the
router, the verifiers and the drafter pools, each a Serve deployment.

Serve starts, health-checks, restarts and scales the replicas. The services still
talk gRPC to each other, found through the state store, as cluster/actors.py's
hosts do (each replica is one of those hosts); the ingress calls the router
through a Serve handle, into the same `RouterServicer.chunks` that gRPC clients
reach on the router's own port. Each replica reports its load for the autoscaling
policies (deploy/autoscaling.py); a replica that goes away drains first.
"""

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram
from ray import serve
from ray.exceptions import RayError
from starlette.exceptions import HTTPException

from cluster.actors import DrafterPoolHost, RouterHost, VerifierHost, host_node, router_resources
from cluster.config import ServeConfig, load_config, open_access_warning
from cluster.state import REDIS_URL_ENV
from protos import specserve_pb2 as pb
from router.auth import bearer

from . import autoscaling
from . import metrics as service_metrics
from . import openai_api as oa

APP_NAME = "specserve"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# requests one replica takes at once (Serve's default, 5, would queue streams in the proxy):
# the ingress only relays; a router runs each request on a thread of its own
INGRESS_MAX_ONGOING = 256
ROUTER_MAX_ONGOING = 64
# how often a replica being stopped checks whether its requests are done (Serve's default, 2 s,
# made every stop of an idle application take 8 s)
SHUTDOWN_POLL_S = 0.5
READY_POLL_S = 0.5  # how often a starting application is asked whether it would serve a request
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# bodies at least this large are parsed on a thread, not on the ingress's event loop
PARSE_OFF_LOOP_BYTES = 64 * 1024


def served_model_name(cfg: ServeConfig) -> str:
    if cfg.http.served_model_name:
        return cfg.http.served_model_name
    if cfg.model in (None, "smollm2"):
        return DEFAULT_MODEL_NAME
    return Path(cfg.model.rstrip("/")).stem


# -- the services ---------------------------------------------------------------------
class _DrainsWhenStopped:
    """Serve calls __del__ when it stops a replica (scaling down, a new version): leave the
    registry and let the requests held finish first (cluster.actors._ServiceHost.drain)."""

    def __del__(self):
        if hasattr(self, "cfg"):  # else the constructor failed: nothing to drain
            self.drain(self.cfg.autoscaling.graceful_shutdown_s)


class _StartsInBackground:
    """Builds the host (loads the model, serves, registers) in a thread, so the replica is up
    at once: Serve routes HTTP while the model loads, requests wait in the router for a
    verifier to register, and /health says not ready until one has."""

    def __init__(self, cfg_dict: dict, redis_url: str | None):
        self.cfg = ServeConfig.model_validate(cfg_dict)
        self._start_error: BaseException | None = None
        threading.Thread(target=self._start, args=(cfg_dict, redis_url), name="start", daemon=True).start()

    def _start(self, cfg_dict: dict, redis_url: str | None) -> None:
        try:
            super().__init__(cfg_dict, redis_url)
        except BaseException as e:  # noqa: BLE001 - check_health reports it and Serve restarts us
            self._start_error = e

    def started(self) -> bool:
        return hasattr(self, "registration")

    def check_health(self) -> None:
        if self._start_error is not None:
            raise RuntimeError(f"the service failed to start: {self._start_error!r}")


@serve.deployment(name="Verifier")
class Verifier(_DrainsWhenStopped, _StartsInBackground, VerifierHost):
    def record_autoscaling_stats(self) -> dict[str, float]:
        v = self.cfg.verifiers
        occupancy = self.engine.occupancy() if self.started() else 0.0  # [verifiers] max_batch may be unset
        return {autoscaling.VERIFIER_LOAD: occupancy / v.target_occupancy}


@serve.deployment(name="DrafterPool")
class DrafterPool(_DrainsWhenStopped, _StartsInBackground, DrafterPoolHost):
    def __init__(self, cfg_dict: dict, redis_url: str | None):
        super().__init__(cfg_dict, redis_url)
        self._busy_mark = (time.monotonic(), 0.0)

    def record_autoscaling_stats(self) -> dict[str, float]:
        # the share of the time since the last report the pool spent drafting
        now, busy = time.monotonic(), self.pool.busy_seconds() if self.started() else 0.0
        then, busy_then = self._busy_mark
        self._busy_mark = (now, busy)
        share = (busy - busy_then) / max(now - then, 1e-6)
        return {autoscaling.DRAFTER_LOAD: share / self.cfg.drafter_pools.target_busy}


@serve.deployment(name="Router")
class Router(_DrainsWhenStopped, RouterHost):
    """Serves gRPC clients on its own port and the HTTP ingress through `generate`."""

    def __init__(self, cfg_dict: dict, redis_url: str | None, *services):
        super().__init__(cfg_dict, redis_url)  # `services`: bound so Serve deploys them

    async def generate(self, request: bytes, api_key: str | None = None) -> AsyncIterator[bytes | dict]:
        """Serialised `GenerateChunk`s of the request, or one error record
        ({"status", "message", "field", "too_long", "retry_after_s"}) where it stops."""
        from router.servicer import Call, RequestFailed

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()  # the caller went away: the coordinator stops the request

        def put(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            try:
                call = Call(is_active=lambda: not gone.is_set(), api_key=api_key)
                for chunk in self.servicer.chunks(pb.GenerateRequest.FromString(request), call):
                    put(chunk.SerializeToString())
            except RequestFailed as e:
                put(_error_record(e))
            except Exception as e:  # noqa: BLE001 - the caller gets it as an error record, not a hang
                put({"status": "INTERNAL", "message": f"{type(e).__name__}: {e}"})
            finally:
                put(None)

        threading.Thread(target=work, name="http-request", daemon=True).start()
        try:
            while (item := await queue.get()) is not None:
                yield item
        finally:
            gone.set()

    def authenticate(self, api_key: str | None) -> dict | None:
        """None when the key may call the API, else an error record."""
        from router.auth import Denied

        try:
            self.servicer.gatekeeper.authenticate(api_key)
        except Denied as e:
            return {"status": e.status, "message": e.message}
        return None

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {autoscaling.ROUTER_LOAD: self.servicer.ongoing / self.cfg.routers.target_ongoing}


def _error_record(e) -> dict:
    """A router.servicer.RequestFailed as the ingress receives it."""
    return {"status": e.code.name, "message": e.message, "field": e.field, "too_long": e.too_long,
            "retry_after_s": e.retry_after_s}


# -- the HTTP ingress ---------------------------------------------------------------------
api = FastAPI(title="specserve", description="OpenAI-compatible API of specserve")


@api.exception_handler(oa.OpenAIError)
async def _openai_error(_: Request, e: oa.OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


@api.exception_handler(HTTPException)
async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
    return await _openai_error(_, oa.OpenAIError(e.status_code, str(e.detail)))


class _Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("specserve_http_requests", "HTTP API requests", ["route", "status"], registry=r)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Time to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specserve_inter_token_latency_seconds", "Time between streamed chunks per token",
                             buckets=LATENCY_BUCKETS, registry=r)


# the ingress's helpers come first: serve.ingress serialises the class where it is defined
async def _body(request: Request, limit: int) -> bytes:
    """The body, refused (413) once it is known to be over `limit` bytes: by its Content-Length
    before any of it is read, else counted as it comes (chunked)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(limit)
        parts.append(part)
    return b"".join(parts)


def _too_large(limit: int) -> oa.OpenAIError:
    return oa.OpenAIError(413, f"the body is over {limit} bytes ([http] max_body_bytes)", None, "request_too_large")


async def _parsed(kind: type, raw: bytes):
    """The request in `raw`; a large body parses on a thread, so the loop serves the others."""
    if len(raw) < PARSE_OFF_LOOP_BYTES:
        return oa.parse(kind, oa.loads(raw))
    return await asyncio.to_thread(lambda: oa.parse(kind, oa.loads(raw)))


def _router_lost(e: Exception) -> oa.OpenAIError:
    """The router replica serving a request went away (it died, or was stopped past its
    drain time): the client may send the request again."""
    return oa.OpenAIError(503, f"the router serving this request went away ({type(e).__name__}); "
                               "send the request again", code="unavailable")


def _chunk_or_raise(item: bytes | dict) -> pb.GenerateChunk:
    if isinstance(item, dict):
        raise oa.router_error(**item)
    return pb.GenerateChunk.FromString(item)


async def _first(stream) -> pb.GenerateChunk | None:
    try:
        return _chunk_or_raise(await stream.__anext__())
    except StopAsyncIteration:  # cancelled before anything was generated
        return None


async def _rest(stream, first: pb.GenerateChunk | None) -> AsyncIterator[pb.GenerateChunk]:
    if first is None:
        return
    yield first
    async for item in stream:
        yield _chunk_or_raise(item)


async def _whole(out: oa.Responses, streams: list, firsts: list) -> dict[str, Any]:
    async def collect(stream, first):
        text, ids, reason, usage, calls, logprobs = [], [], "length", pb.Usage(), [], []
        async for chunk in _rest(stream, first):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            calls.extend(chunk.tool_calls)
            logprobs.extend(chunk.logprobs)
            if chunk.finish_reason:
                reason, usage = chunk.finish_reason, chunk.usage
        return "".join(text), ids, reason, usage, calls, logprobs

    results = await asyncio.gather(*(collect(s, f) for s, f in zip(streams, firsts)))
    return out.whole(*(list(column) for column in zip(*results)))


async def _merged(streams: list, firsts: list) -> AsyncIterator[tuple[int, pb.GenerateChunk]]:
    """(choice, chunk) from every choice's stream as they arrive."""
    if len(streams) == 1:
        async for chunk in _rest(streams[0], firsts[0]):
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for chunk in _rest(streams[i], firsts[i]):
                await queue.put((i, chunk))
            await queue.put((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        running = len(streams)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


@serve.deployment(name="OpenAIIngress")
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, cfg_dict: dict, router):
        self.cfg = ServeConfig.model_validate(cfg_dict)
        self.model = served_model_name(self.cfg)
        self.router = router
        self.metrics = _Metrics()

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 only when a request would succeed now (a verifier and the configured drafters
        registered and answering); 503 with the reason otherwise."""
        reason = await self.router.ready.remote()
        if reason:
            raise oa.OpenAIError(503, reason, code="not_ready")
        return JSONResponse({"status": "ok"})

    @api.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        """This ingress's metrics and every registered service's, each service's samples
        labelled with its `service` (kind) and `instance` (service id): deploy/metrics.py."""
        scraper = self.__dict__.setdefault("_scraper", service_metrics.ServiceScraper())
        try:  # any router lists the services: they all read the one store
            targets = await asyncio.wait_for(self.router.metrics_targets.remote(), scraper.timeout_s)
        except Exception:  # noqa: BLE001 - no router answering: this ingress's own metrics still
            scraper.router_failed()
            targets = []
        text = await scraper.exposition([self.metrics.registry], targets)
        return PlainTextResponse(text, media_type=service_metrics.CONTENT_TYPE)

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        denied = await self.router.authenticate.remote(bearer(request.headers.get("authorization")))
        if denied:
            raise oa.router_error(**denied)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "specserve"}]})

    @api.post("/v1/chat/completions", openapi_extra=oa.openapi_body(oa.ChatCompletionRequest))
    async def chat_completions(self, request: Request):
        return await self._complete(request, oa.ChatCompletionRequest, "/v1/chat/completions")

    @api.post("/v1/completions", openapi_extra=oa.openapi_body(oa.CompletionRequest))
    async def completions(self, request: Request):
        return await self._complete(request, oa.CompletionRequest, "/v1/completions")

    async def _complete(self, request: Request, kind: type, route: str):
        status, req = 500, None
        try:
            req = await _parsed(kind, await _body(request, self.cfg.http.max_body_bytes))
            if req.model != self.model:
                raise oa.OpenAIError(404, f"model {req.model!r} does not exist; this server serves {self.model!r}",
                                     "model", "model_not_found")
            rid = uuid.uuid4().hex
            out = oa.Responses(kind is oa.ChatCompletionRequest, rid, self.model, req.return_token_ids,
                               logprobs=req.top_logprob_count() is not None)
            started = time.monotonic()
            key = bearer(request.headers.get("authorization"))
            streams = [self.router.options(stream=True).generate.remote(g.SerializeToString(), key)
                       for g in req.generate_requests(rid)]
            # the first chunk of each choice before answering: a refused request gets its own status
            firsts = await asyncio.gather(*(_first(s) for s in streams))
            status = 200
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                return StreamingResponse(self._events(out, streams, firsts, include_usage, started),
                                         media_type="text/event-stream")
            return JSONResponse(await _whole(out, streams, firsts))
        except RayError as e:
            status = 503
            raise _router_lost(e) from None
        except oa.OpenAIError as e:
            status = e.status
            if req is not None:  # the router's field, as the request spelt it
                req.rename(e)
            raise
        finally:
            self.metrics.requests.labels(route, str(status)).inc()

    async def _events(self, out: oa.Responses, streams: list, firsts: list[pb.GenerateChunk],
                      include_usage: bool, started: float) -> AsyncIterator[str]:
        """Server-sent events: each choice's chunks as they come, the usage last if asked, [DONE]."""
        usages: dict[int, pb.Usage] = {}
        last = time.monotonic()
        seen_first = False
        if out.chat:  # OpenAI opens each choice with its role
            for i in range(len(streams)):
                yield _event(out.chunk(i, "", [], None, first=True, with_usage_field=include_usage))
        try:
            async for i, chunk in _merged(streams, firsts):
                now = time.monotonic()
                if not seen_first:
                    self.metrics.ttft.observe(now - started)
                    seen_first = True
                elif chunk.token_ids:
                    self.metrics.itl.observe((now - last) / len(chunk.token_ids))
                last = now
                if chunk.finish_reason:
                    usages[i] = chunk.usage
                if chunk.text or chunk.finish_reason or chunk.tool_calls or (out.logprobs and chunk.logprobs) or (
                        out.return_token_ids and chunk.token_ids):
                    yield _event(out.chunk(i, chunk.text, list(chunk.token_ids), chunk.finish_reason or None,
                                           with_usage_field=include_usage, calls=list(chunk.tool_calls),
                                           logprobs=list(chunk.logprobs)))
            if include_usage:
                yield _event(out.usage_chunk([usages[i] for i in sorted(usages)]))
        except oa.OpenAIError as e:
            yield _event(e.body())
        except RayError as e:
            yield _event(_router_lost(e).body())
        yield "data: [DONE]\n\n"


# -- the application -----------------------------------------------------------------------
def _replicas(count: int, max_count: int | None, policy: str | None, cfg: ServeConfig) -> dict[str, Any]:
    """Fixed replicas, or autoscaling between count and max_count on `policy`."""
    if max_count is None or max_count <= count:
        return {"num_replicas": count}
    a = cfg.autoscaling
    config: dict[str, Any] = {"min_replicas": count, "max_replicas": max_count,
                              "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s,
                              "metrics_interval_s": a.metrics_interval_s, "look_back_period_s": a.look_back_period_s}
    if policy:
        config["policy"] = {"policy_function": f"deploy.autoscaling:{policy}"}
    return {"autoscaling_config": config}


def _tensor_parallel_placement(cfg: ServeConfig) -> dict:
    """A tensor-parallel verifier replica and its ranks: one bundle each, all on one node."""
    if cfg.verifiers.tensor_parallel == 1:
        return {}
    from cluster.tp_ranks import placement_bundles

    return {"placement_group_bundles": placement_bundles(cfg), "placement_group_strategy": "STRICT_PACK"}


def build(cfg: ServeConfig, redis_url: str | None = None):
    """The application, with the config's replica counts, resources and autoscaling."""
    redis_url = redis_url or os.environ.get(REDIS_URL_ENV)
    spec = cfg.model_dump()
    shutdown = {"graceful_shutdown_timeout_s": cfg.autoscaling.graceful_shutdown_s,
                "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S}
    services = [Verifier.options(ray_actor_options={"num_cpus": 0, "resources": cfg.verifiers.resources},
                                 **_replicas(cfg.verifiers.count, cfg.verifiers.max_count, "verifier_policy", cfg),
                                 **_tensor_parallel_placement(cfg), **shutdown).bind(spec, redis_url)]
    if cfg.drafter_pools.count or cfg.drafter_pools.max_count:
        pools = cfg.drafter_pools
        services.append(DrafterPool.options(ray_actor_options={"num_cpus": 0, "resources": pools.resources},
                                            **_replicas(pools.count, pools.max_count, "drafter_policy", cfg),
                                            **shutdown).bind(spec, redis_url))
    # on a router `host` that is one node's address, the routers and the ingress run on that node
    on_host = {"num_cpus": 0, "resources": router_resources(cfg)}
    router = Router.options(ray_actor_options=on_host, max_ongoing_requests=ROUTER_MAX_ONGOING,
                            **_replicas(cfg.routers.count, cfg.routers.max_count, "router_policy", cfg),
                            **shutdown).bind(spec, redis_url, *services)
    return OpenAIIngress.options(ray_actor_options=on_host,
                                 max_ongoing_requests=INGRESS_MAX_ONGOING,
                                 graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S).bind(spec, router)


def config_from_args(args: dict[str, Any] | None) -> ServeConfig:
    """The config deploy/serve.yaml's `args` name: `config`, a specserve TOML file (None: the
    defaults), with `settings` (a table like the file's) over it, section by section."""
    args = args or {}
    spec = load_config(args.get("config")).model_dump()
    for key, value in (args.get("settings") or {}).items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) and isinstance(spec.get(key), dict) else value
    return ServeConfig.model_validate(spec)


def build_app(args: dict[str, Any]):
    """Serve's application builder (deploy/serve.yaml)."""
    cfg = config_from_args(args)
    warning = open_access_warning(cfg)
    if warning:
        logging.getLogger(__name__).warning(warning)
    return build(cfg)


def start_app(cfg: ServeConfig, redis_url: str | None = None, progress=print):
    """Deploy the application on the Ray cluster (initialised) and return the router's handle
    once a request would succeed (`progress` hears why not yet)."""
    http = {"host": cfg.host, "port": cfg.http.port}
    if cfg.security.tls() is not None:
        http.update(ssl_certfile=cfg.security.tls_cert_file, ssl_keyfile=cfg.security.tls_key_file)
    node = host_node(cfg)
    # the proxy listens on `host`: when that is the head's address, on the head only (on the
    # other nodes it could not bind it)
    on_head = node is not None and "node:__internal_head__" in node["Resources"]
    serve.start(http_options=http, **({"proxy_location": "HeadOnly"} if on_head else {}))
    serve.run(build(cfg, redis_url), name=APP_NAME, route_prefix="/", blocking=False)
    router = serve.get_deployment_handle("Router", app_name=APP_NAME)
    said = None
    while (reason := router.ready.remote().result()) is not None:
        if reason != said:
            progress(f"specserve: waiting: {reason}")
            said = reason
        time.sleep(READY_POLL_S)
    return router
