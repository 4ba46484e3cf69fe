"""`specserve train-drafter`: distil a small drafter from a target model (`--kind small`), or
train a feature-level head on the target's own features (`--kind eagle`)."""

from __future__ import annotations


def add_parser(sub) -> None:
    t = sub.add_parser("train-drafter", help="distil a small drafter from a target model (see docs/DRAFTERS.md)")
    t.add_argument("--kind", choices=("small", "eagle"), default="small",
                   help="small: a small causal LM; eagle: an EAGLE-3 head over the target's features")
    t.add_argument("--target", default=None, help="target model: Hugging Face directory or .gguf (default smollm2)")
    t.add_argument("--corpus", nargs="+", required=True, metavar="PATH",
                   help="question/prompt .jsonl files (answered by the target) and text files or directories")
    t.add_argument("--out", required=True, help="directory to write the drafter (and its work/ cache) to")
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--hidden", type=int, default=None, help="hidden size (default: the target's, weights copied)")
    t.add_argument("--intermediate", type=int, default=None, help="MLP width per layer (default 512; eagle 768)")
    t.add_argument("--vocab-trim", type=int, default=6144, help="tokens the drafter can propose (0: all)")
    t.add_argument("--minutes", type=float, default=None,
                   help="training time budget, data preparation excluded (default 30; eagle 10)")
    t.add_argument("--init", default=None, metavar="DIR", help="continue from this drafter (e.g. specialise one)")
    t.add_argument("--answer-tokens", type=int, default=128, help="length of the target's answers to prompts")
    t.add_argument("--domains", nargs="+", default=[], metavar="DOMAIN",
                   help="the domains it specialises in (router.domains): the router tries it first there")
    t.add_argument("--seed", type=int, default=0)
    e = t.add_argument_group("--kind eagle")
    e.add_argument("--exclude", nargs="+", default=[], metavar="FILE",
                   help="question .jsonl files: corpus prompts sharing an 8-word span with any of their turns "
                        "are dropped (e.g. the Spec-Bench questions)")
    e.add_argument("--data-minutes", type=float, default=6.0, help="budget for the target's answers (the data)")
    e.add_argument("--max-prompts", type=int, default=2000, help="most corpus prompts to answer")
    e.add_argument("--draft-vocab", type=int, default=4096, help="tokens the head can propose")
    e.add_argument("--ttt-steps", type=int, default=3, help="training-time test steps (1: none)")


def run(args) -> int:
    from cluster.env import cache_dir_from_env, cpu_tuning_from_env
    from cluster.local import set_cpu_threads
    from drafter_service.corpus import corpus_files
    from drafter_service.training import TrainConfig, train

    if args.kind == "eagle":
        return _run_eagle(args)
    args.minutes = 30.0 if args.minutes is None else args.minutes
    args.intermediate = args.intermediate or 512
    cfg = TrainConfig(target=args.target, corpus=args.corpus, out=args.out, layers=args.layers, hidden=args.hidden,
                      intermediate=args.intermediate, vocab_trim=args.vocab_trim, minutes=args.minutes,
                      init=args.init, answer_tokens=args.answer_tokens, seed=args.seed, domains=args.domains,
                      extra={"command": "specserve " + " ".join(args.argv)})
    cfg.validate()
    corpus_files(cfg.corpus)  # a missing file fails now, not after loading the target
    set_cpu_threads()
    train(cfg, cache_dir=cache_dir_from_env(), cpu_tuning=cpu_tuning_from_env())
    return 0



def _run_eagle(args) -> int:
    from cluster.env import cache_dir_from_env, cpu_tuning_from_env
    from cluster.local import set_cpu_threads
    from drafter_service.corpus import corpus_files
    from drafter_service.eagle_training import EagleTrainConfig, train_eagle

    cfg = EagleTrainConfig(target=args.target, corpus=args.corpus, out=args.out, exclude=args.exclude,
                           minutes=10.0 if args.minutes is None else args.minutes, data_minutes=args.data_minutes,
                           max_prompts=args.max_prompts, answer_tokens=args.answer_tokens,
                           draft_vocab=args.draft_vocab, intermediate=args.intermediate or 768, ttt_steps=args.ttt_steps, seed=args.seed,
                           extra={"command": "specserve " + " ".join(args.argv)})
    cfg.validate()
    corpus_files(cfg.corpus)
    for f in cfg.exclude:
        open(f).close()  # a missing file fails now, not after loading the target
    set_cpu_threads()
    train_eagle(cfg, cache_dir=cache_dir_from_env(), cpu_tuning=cpu_tuning_from_env())
    return 0
