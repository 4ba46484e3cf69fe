"""What `tokenizers`' per-thread BPE cache costs and saves (docs/RELIABILITY.md, the router's
memory): encoding the dev prompts' chats with the cache and without it (as specserve runs,
`runtime.tokenizer.BPE_CACHE_WORDS`), rendering a chat, and the memory 8 threads keep
after encoding 5,000 words no vocabulary holds, with the cache and without.

    python experiments/tokenizer_probe.py
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from runtime.loading import load_tokenizer  # noqa: E402
from runtime.tokenizer import BPE_CACHE_WORDS  # noqa: E402

DEV = ROOT.parent / "shared" / "data" / "spec_bench" / "dev.jsonl"
LIBRARY_DEFAULT_WORDS = 10_000  # tokenizers' own cache size, a thread


def tokenizer(cache_words: int):
    tok, _ = load_tokenizer()
    tok._tok.model._resize_cache(cache_words)  # before its first encode: the cache starts empty
    return tok


def encode_us(tok, texts: list[str]) -> float:
    start = time.perf_counter()
    for text in texts:
        tok.encode(text, add_special_tokens=False)
    return (time.perf_counter() - start) / len(texts) * 1e6


def thread_memory_mb(cache_words: int, threads: int = 8, words: int = 5000) -> float:
    tok = tokenizer(cache_words)
    rng = random.Random(0)
    unknown = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(40, 120)))
               for _ in range(words)]
    tok.encode("warm up")
    before = psutil.Process().memory_info().rss
    measured = threading.Barrier(threads + 1)

    def work() -> None:
        for w in unknown:
            tok.encode(w)
        measured.wait()  # alive until measured: a thread's cache goes with it
        measured.wait()

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    measured.wait()
    grown = (psutil.Process().memory_info().rss - before) / 1e6
    measured.wait()
    for t in pool:
        t.join()
    return grown


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--memory":  # one measurement in a fresh process
        print(thread_memory_mb(int(sys.argv[2])))
        return
    questions = [json.loads(line)["turns"][0] for line in DEV.open()]
    cached, uncached = tokenizer(LIBRARY_DEFAULT_WORDS), tokenizer(BPE_CACHE_WORDS)
    chats = [cached.render_chat([{"role": "user", "content": q}]) for q in questions]
    tokens = statistics.mean(len(cached.encode(c, add_special_tokens=False)) for c in chats)
    encode_us(cached, chats)  # fill the cache
    times = {"cache": [], "none": []}
    for _ in range(15):
        times["cache"].append(encode_us(cached, chats))
        times["none"].append(encode_us(uncached, chats))
    start = time.perf_counter()
    for q in questions:
        cached.render_chat([{"role": "user", "content": q}])
    render_us = (time.perf_counter() - start) / len(questions) * 1e6
    print(f"{len(chats)} dev chats, {tokens:.0f} tokens on average; medians of 15 passes")
    print(f"encode, the cache filled: {statistics.median(times['cache']):.0f} us a chat")
    print(f"encode, no cache ({BPE_CACHE_WORDS} words): {statistics.median(times['none']):.0f} us a chat")
    print(f"render a chat (template compiled once): {render_us:.0f} us")
    for words in (LIBRARY_DEFAULT_WORDS, BPE_CACHE_WORDS):
        out = subprocess.run([sys.executable, __file__, "--memory", str(words)], capture_output=True, text=True,
                             check=True).stdout
        print(f"8 threads after 5,000 unknown words, cache of {words} words a thread: {float(out):.1f} MB")


if __name__ == "__main__":
    main()
