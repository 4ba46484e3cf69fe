"""`specserve bench` and `specserve simulate`: the benchmark harness and the cluster
simulator (bench/), their arguments checked before any work starts."""

from __future__ import annotations

from drafter_service.registry import check_drafter, is_drafter
from speculative.sampling import InvalidArgument

from .args import add_model_args

TEXT_MODES = ["hf-ar", "hf-pld", "ar", "pld", "layerskip"]
STRUCTURED_MODES = ["ar", "pld", "suffix", "pld+suffix"]


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark decoding modes on Spec-Bench questions")
    b.add_argument("--questions", required=True, help="Spec-Bench JSONL file")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--limit-per-category", type=int, default=3)
    b.add_argument("--modes", nargs="+", default=None,
                   help="what to run side by side: hf-ar and hf-pld (Hugging Face generate, plain and prompt "
                        "lookup), llamacpp-ar and llamacpp-pld (llama.cpp on the GGUF, the [llamacpp] extra), ar "
                        "(our plain decoding), any drafter or a+b fusion (in process), served-<drafter>, "
                        "served-auto and pipelined-<drafter> (gRPC, --server; served-<drafter>@verifier or @pool: "
                        "where its eagle drafter runs), http-<drafter> and http-auto (the "
                        "OpenAI API, --http) (default: hf-ar hf-pld ar pld layerskip; with --workload extraction or tools: "
                        "ar pld suffix pld+suffix)")
    b.add_argument("--draft-length", type=int, default=5)
    b.add_argument("--tree-budget", type=int, default=None,
                   help="most draft nodes per round for the in-process modes (default: the draft length)")
    b.add_argument("--repeats", type=int, default=1,
                   help="time each generation this many times and report the median; with --load: run each "
                        "level this many times (own arrivals and prompts each) and judge the median ratio")
    b.add_argument("--micro", action="store_true", help="also time single forwards and model loading")
    b.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto",
                   help="the in-process modes' passes at static shapes from captured CUDA graphs "
                        "(runtime/graphs.py; auto, the default: on CUDA)")
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
    b.add_argument("--no-calibrate", action="store_true",
                   help="fused drafters (a+b) rank their nodes by the drafters' own confidences, not calibrated "
                        "to the rates the target took them at (to measure fusion without it; the in-process modes)")
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
    b.add_argument("--workload", choices=["text", "extraction", "tools"], default="text",
                   help="text (default): free answers; extraction: a JSON schema over each answer; tools: a "
                        "required tool call (bench/structured.py; in-process modes: ar and drafters)")
    add_model_args(b)


def add_simulate_parser(sub) -> None:
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
    m.add_argument("--pool-link-ms", type=float, default=0.0,
                   help="one-way delay of the router<->drafter-pool link, ms: each draft call pays it twice "
                        "(default 0: the pools as near as the verifiers)")
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
    add_model_args(m)


def run(args) -> int:
    if args.load:
        return _bench_load(args)
    if args.workload != "text":
        return _bench_structured(args)
    args.modes = args.modes or TEXT_MODES
    from bench.harness import GRPC, HF_MODES, HTTP, PLACEMENT, REMOTE, run_bench
    from bench.llamacpp import LLAMACPP_MODES
    from speculative.drafter_kinds import EAGLE_PLACEMENTS

    in_process_only = HF_MODES | set(LLAMACPP_MODES)

    def known(mode: str) -> bool:  # hf-*, llamacpp-*, ar, or a drafter (also served-, pipelined-, http-<drafter>)
        local = next((mode.removeprefix(p) for p in REMOTE if mode.startswith(p)), mode)
        if PLACEMENT in local:  # served-eagle@verifier, served-eagle+pld@pool: over gRPC only
            local, _, placement = local.partition(PLACEMENT)
            if placement not in EAGLE_PLACEMENTS or not mode.startswith(GRPC):
                return False
        if local in ("auto", "none"):  # served-auto, http-auto: the server routes; served-none: served-ar
            return mode != local
        return mode in in_process_only | {"ar"} or local == "ar" or (local not in in_process_only and local != "none"
                                                                      and is_drafter(local))

    unknown = [m for m in args.modes if not known(m)]
    if unknown:
        raise InvalidArgument("modes", f"unknown mode(s) {', '.join(unknown)}")
    llama_modes = [m for m in args.modes if m in LLAMACPP_MODES]
    if llama_modes:
        _check_llamacpp(args, llama_modes)
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


def _bench_structured(args) -> int:
    """`bench --workload extraction|tools`: our own decoding modes under a grammar, greedy."""
    args.modes = args.modes or STRUCTURED_MODES
    unknown = [m for m in args.modes if m not in ("ar", "llamacpp-ar") and not (is_drafter(m) and m != "none")]
    if unknown:
        raise InvalidArgument("modes", f"{', '.join(unknown)}: with --workload {args.workload}, ar, llamacpp-ar "
                                       "or drafters (in process) only")
    if "llamacpp-ar" in args.modes:
        _check_llamacpp(args, ["llamacpp-ar"])
    if args.modes == ["llamacpp-ar"]:
        raise InvalidArgument("modes", "llamacpp-ar needs one of our modes beside it (the grammar's cost is "
                                       "measured on our outputs)")
    if args.temperature != 0:
        raise InvalidArgument("temperature", f"must be 0 with --workload {args.workload} (greedy only)")
    for name in ("max_tokens", "limit_per_category", "repeats", "draft_length"):
        if getattr(args, name) <= 0:
            raise InvalidArgument(name, f"must be positive, got {getattr(args, name)}")
    from bench.structured import run_structured

    run_structured(args)
    return 0


def _check_llamacpp(args, llama_modes: list[str]) -> None:
    """Before any work: llama.cpp is an optional extra, greedy only, on a GGUF as it is."""
    from bench.llamacpp import AMX_HINT, INSTALL_HINT, built_with_amx, llama_cpp_missing
    from runtime.loading import resolve_source

    if llama_cpp_missing():
        raise InvalidArgument("modes", f"{', '.join(llama_modes)}: {INSTALL_HINT}")
    if args.temperature != 0:
        raise InvalidArgument("temperature", f"must be 0 with {', '.join(llama_modes)} (greedy only)")
    if resolve_source(args.model).suffix != ".gguf":
        raise InvalidArgument("model", f"must be a .gguf file with {', '.join(llama_modes)} (they run it "
                                       f"as it is), got {args.model}")
    if built_with_amx():
        raise InvalidArgument("modes", f"{', '.join(llama_modes)}: the installed llama-cpp-python {AMX_HINT}")


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


def run_simulate(args) -> int:
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
    if args.pool_link_ms < 0:
        raise InvalidArgument("pool_link_ms", f"must not be negative, got {args.pool_link_ms}")
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

