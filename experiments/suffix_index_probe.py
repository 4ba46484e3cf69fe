"""What the suffix index (speculative.suffix) costs: feeding a token, drafting a tree, memory.

Feeds the chat-templated prompts of `--prompts` dev questions into a fresh index, each as a
request's verified text grows (`--chunk` tokens at a time, through a SuffixFeed), then
drafts `--drafts` trees (`--nodes` nodes, `--depth` levels) after prefixes of those prompts.
Reports microseconds a fed token and a draft, and the index's Python memory a fed token
(tracemalloc, a second feeding of the same text).

    python experiments/suffix_index_probe.py --questions ../shared/data/spec_bench/dev.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import time
import tracemalloc

from runtime.loading import load_tokenizer
from speculative.suffix import SuffixFeed, SuffixIndex


def feed_all(index: SuffixIndex, texts: list[list[int]], chunk: int) -> None:
    for text in texts:
        feed = SuffixFeed()
        for end in range(chunk, len(text) + chunk, chunk):
            feed.feed(index, text[:end])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", default="../shared/data/spec_bench/dev.jsonl")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--chunk", type=int, default=4, help="tokens fed at a time (a round's)")
    parser.add_argument("--drafts", type=int, default=600)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--model", default=None, help="tokenizer source (default: the default model)")
    args = parser.parse_args()

    tokenizer, _ = load_tokenizer(args.model)
    questions = [json.loads(line) for line in open(args.questions)]
    random.Random(0).shuffle(questions)
    texts = [tokenizer.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in questions[:args.prompts]]
    tokens = sum(map(len, texts))

    index = SuffixIndex()
    started = time.perf_counter()
    feed_all(index, texts, args.chunk)
    feed_s = time.perf_counter() - started

    rng = random.Random(1)
    contexts = []
    for _ in range(args.drafts):
        text = texts[rng.randrange(len(texts))]
        contexts.append(text[:rng.randrange(1, len(text))])
    started = time.perf_counter()
    drafted = sum(len(index.propose(c, args.nodes, max_depth=args.depth)) for c in contexts)
    draft_s = time.perf_counter() - started

    tracemalloc.start()
    measured = SuffixIndex()
    feed_all(measured, texts, args.chunk)
    held, _ = tracemalloc.get_traced_memory()  # while `measured` holds it all
    tracemalloc.stop()

    print(f"{len(texts)} prompts, {tokens} tokens fed {args.chunk} at a time: {feed_s / tokens * 1e6:.1f} us a token")
    print(f"{args.drafts} drafts ({args.nodes} nodes, {args.depth} levels): {draft_s / args.drafts * 1e6:.0f} us each, "
          f"{drafted / args.drafts:.1f} nodes each")
    print(f"memory: {held / tokens:.0f} bytes a fed token")


if __name__ == "__main__":
    main()
