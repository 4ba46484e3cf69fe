"""The tokenizer in a server's threads: encoding on many threads keeps no memory per thread
(`tokenizers` keeps its BPE cache per thread), and gives the ids one thread gives."""

from __future__ import annotations

import random
import threading

import psutil
import pytest

from runtime.loading import load_tokenizer

THREADS = 8


@pytest.fixture(scope="module")
def tokenizer():
    tok, _ = load_tokenizer()
    return tok


def test_encoding_on_many_threads_keeps_no_cache_per_thread(tokenizer):
    rng = random.Random(0)
    # words no vocabulary holds, so each would be a cache entry of its own: with the per-thread
    # caches `tokenizers` keeps by default these threads hold about 110 MB, without them about 2
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(40, 120)))
             for _ in range(5000)]
    expected = [tokenizer.encode(w) for w in words[:50]]
    process = psutil.Process()
    before = process.memory_info().rss
    measured = threading.Barrier(THREADS + 1)
    got: dict[int, list[list[int]]] = {}

    def work(i: int) -> None:
        got[i] = [tokenizer.encode(w) for w in words[:50]]
        for w in words[50:]:
            tokenizer.encode(w)
        measured.wait()  # the thread lives until the size is read: a thread's cache goes with it
        measured.wait()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    measured.wait()
    grown_mb = (process.memory_info().rss - before) / 1e6
    measured.wait()
    for t in threads:
        t.join()
    assert grown_mb < 30, f"encoding on {THREADS} threads grew the process by {grown_mb:.0f} MB"
    assert all(got[i] == expected for i in range(THREADS))


def test_a_long_prompt_is_tokenized_without_holding_the_gil(tokenizer):
    """A router tokenizes on its request's thread: the other threads (other requests, the
    health check) keep running while a long prompt is tokenized."""
    import time

    text = "hello world, this is a test of many words " * 20000
    stalls, done = [], threading.Event()

    def ticker():
        while not done.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            stalls.append(time.perf_counter() - t)

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.05)
    stalls.clear()
    started = time.perf_counter()
    ids = tokenizer.encode(text)
    seconds = time.perf_counter() - started
    done.set()
    thread.join()
    assert len(ids) > 100_000
    assert max(stalls) < 0.5 * seconds, (max(stalls), seconds)
