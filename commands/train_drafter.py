"""`specserve train-drafter`: distil a small drafter from a target model."""

from __future__ import annotations


def add_parser(sub) -> None:
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


def run(args) -> int:
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

