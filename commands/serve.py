"""`specserve serve`: start or join a Ray cluster, deploy the application and serve
until interrupted."""

from __future__ import annotations

import errno
import signal
import socket
import threading

from speculative.sampling import InvalidArgument

from .args import prepare_once


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the model (OpenAI HTTP and gRPC) on a Ray cluster (local, or RAY_ADDRESS)")
    s.add_argument("--config", default=None, help="TOML file of settings (see docs/SERVING.md)")
    s.add_argument("--host", default=None, help="router address to listen on (overrides the config)")
    s.add_argument("--port", type=int, default=None, help="router gRPC port (overrides the config)")
    s.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP port (overrides the config)")
    s.add_argument("--allow-open-access", action="store_true",
                   help="serve on a non-loopback --host without API keys (a warning is printed)")


def run(args) -> int:
    return serve(config_of(args))


def config_of(args):
    """The config file with the flags over it, checked before anything starts."""
    from pydantic import ValidationError

    from cluster.config import ServeConfig, load_config

    try:
        cfg = load_config(args.config)
        overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        spec = {**cfg.model_dump(), **overrides}
        if args.http_port is not None:
            spec["http"] = {**spec["http"], "port": args.http_port}
        if args.allow_open_access:
            spec["security"] = {**spec["security"], "allow_open_access": True}
        cfg = ServeConfig.model_validate(spec)
    except ValidationError as e:
        err = e.errors()[0]
        # a section's key is named section.key; an error of the file as a whole, by the file
        raise InvalidArgument(".".join(str(x) for x in err["loc"]) or "config", err["msg"]) from None
    if cfg.verifiers.tensor_parallel > 1:  # a count the model cannot take fails here, not in every verifier
        from cluster.env import cache_dir_from_env
        from runtime.loading import load_tokenizer
        from verifier_service.tp_group import check_precision

        try:
            check_precision(load_tokenizer(cfg.model, cache_dir=cache_dir_from_env())[1],
                            cfg.verifiers.tensor_parallel, cfg.dtype)
        except InvalidArgument as e:
            raise InvalidArgument("verifiers.tensor_parallel", str(e).split(": ", 1)[1]) from None
    from cluster.env import cluster_secret_from_env

    cluster_secret_from_env()  # a bad secret in the environment fails here, not in every service
    return cfg


def serve(cfg) -> int:
    """Serve the application until interrupted (SIGINT or SIGTERM)."""
    import ray
    from ray import serve as ray_serve

    from cluster.config import open_access_warning
    from cluster.ray_start import init_ray
    from deploy.app import APP_NAME, start_app

    warning = open_access_warning(cfg)
    if warning:
        print(f"specserve: warning: {warning}", flush=True)
    check_ports_free(cfg)
    prepare_once(cfg.model, cfg.device)
    quiet_ray()
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
    # the application's replicas drain; then the cluster stops (one this command started goes
    # whole, Serve with it: shutting Serve down first left the controller's pending calls to
    # fail loudly once it was killed)
    ray_serve.delete(APP_NAME)
    ray.shutdown()
    return 0


def quiet_ray() -> None:
    """Ray's and Serve's progress lines are this command's to tell (its `specserve:` lines):
    a start that says it connects to an existing application, on a fresh cluster, reads as a
    fault. Their warnings and errors still show."""
    import logging

    import ray.serve  # noqa: F401 - its logger set up before it is quieted

    logging.getLogger("ray").setLevel(logging.WARNING)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    # that Ray's token authentication is on comes as a warning; it is not one (the token is kept 0600)
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


def check_ports_free(cfg) -> None:
    """Refuse to start on a port another process listens on. The router's gRPC servers and
    Serve's HTTP proxy bind with SO_REUSEPORT, so that replicas of one application share a
    port; a second server would share it too, the kernel splitting connections between two
    clusters. A bind without SO_REUSEPORT fails while anything listens there."""
    ports = [("port", cfg.port), ("http.port", cfg.http.port), ("metrics_port", cfg.metrics_port)]
    for setting, port in ports:
        if not port:  # unset, or 0: a free one is picked
            continue
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
            try:
                probe.bind((cfg.host, port))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                raise ValueError(f"{setting}: {cfg.host}:{port} is in use{_holder(port)}; stop it or choose "
                                 f"another port") from None


def _holder(port: int) -> str:
    """' by <program> (pid N)' of the process listening on `port`, where this user may see it."""
    import psutil

    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
                proc = psutil.Process(conn.pid)
                return f" by {' '.join(proc.cmdline()[:4]) or proc.name()} (pid {conn.pid})"
    except (psutil.Error, OSError):
        pass
    return ""
