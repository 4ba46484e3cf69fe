import json
import os
import signal
import sys
from itertools import cycle
from pathlib import Path

import pytest

# test helpers (tiny.py, ...) import as plain modules
sys.path.insert(0, str(Path(__file__).parent))

# Ray gives a starting GCS 30 s to come up; on a busy 2-core machine, right after another
# test's cluster went down, it once took longer. The tests' clusters (and the servers they
# start, which inherit this) wait up to 120 s, as Ray does for its RocksDB store.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")

# A background job of a non-interactive shell starts with SIGINT ignored, and its children
# inherit that: `serve run` would then never see the Ctrl-C a test stops it with. The tests
# run with Ctrl-C as in a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

DEV_QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "dev.jsonl"


def dev_prompts(n: int) -> list[tuple[str, str]]:
    """n (category, first turn) pairs taken round-robin over the categories."""
    if not DEV_QUESTIONS.exists():
        pytest.fail(f"Spec-Bench dev questions not found at {DEV_QUESTIONS} (../shared beside the repo)")
    by_cat: dict[str, list[str]] = {}
    for line in DEV_QUESTIONS.read_text().splitlines():
        q = json.loads(line)
        by_cat.setdefault(q["category"], []).append(q["turns"][0])
    picked, iters = [], {c: iter(qs) for c, qs in by_cat.items()}
    for cat in cycle(sorted(by_cat)):
        if len(picked) == n:
            return picked
        nxt = next(iters[cat], None)
        if nxt is not None:
            picked.append((cat, nxt))


@pytest.fixture(scope="module", autouse=True)
def every_core_for_each_module():
    """Each module starts with torch on every core, as the product's entry points set it:
    modules of tiny models set it to one thread (faster there) and used to leave it so for
    the real model's modules after them."""
    from cluster.local import set_cpu_threads

    set_cpu_threads()


@pytest.fixture(scope="session")
def smollm2():
    """Our model and tokenizer: the default target."""
    from cluster.local import set_cpu_threads
    from runtime import loading

    set_cpu_threads()
    return loading.load()


@pytest.fixture(scope="session")
def core_workers():
    """One worker process per core, pinned to it, at the lowest priority (tests/core_workers.py)."""
    import core_workers

    return core_workers.workers()


@pytest.fixture(scope="session")
def hf_oracle(core_workers):
    """Hugging Face transformers on the same GGUF, the external oracle: it runs in the
    worker processes (tests/oracle.py)."""
    return core_workers


def pytest_collection_finish(session):
    """Start the workers on what the selected tests will ask of them, in the order the tests
    run: the oracle's greedy answers first (tests of servers compare with them), then each
    test module's `background_jobs(item)`, calls as its tests will make them."""
    import core_workers
    import oracle

    if session.config.option.collectonly:
        return
    jobs = [(oracle.hf_greedy, i) for i in range(oracle.GREEDY_PROMPTS)
            if any("hf_oracle" in getattr(item, "fixturenames", ()) for item in session.items)]
    for item in session.items:
        jobs += getattr(getattr(item, "module", None), "background_jobs", lambda _: [])(item)
    for fn, *args in jobs:
        core_workers.workers().submit_ahead(fn, *args)


def pytest_sessionfinish(session):
    import core_workers

    core_workers.stop()
