import json
import os
import sys
from itertools import cycle
from pathlib import Path

import pytest
import torch

# test helpers (tiny.py, ...) import as plain modules
sys.path.insert(0, str(Path(__file__).parent))

# Ray gives a starting GCS 30 s to come up; on a busy 2-core machine, right after another
# test's cluster went down, it once took longer. The tests' clusters (and the servers they
# start, which inherit this) wait up to 120 s, as Ray does for its RocksDB store.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")

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
    from speculative import loading

    set_cpu_threads()
    return loading.load()


@pytest.fixture(scope="session")
def hf_oracle():
    """Hugging Face transformers loading the same GGUF itself: the external oracle."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from speculative.loading import default_gguf_path

    hf_logging.set_verbosity_error()
    gguf = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="module")
def cli_loads_model_once():
    """`specserve generate` run in process (cluster.cli.main) loads the model again on every
    call (LocalEngine.load, ~0.6 s); a module that calls it dozens of times loads it once: the
    load is memoised on its arguments. Each call still begins as a fresh CLI process would:
    threads set, and no drafter memory (the suffix index, the recycling table and fused
    calibrations, which drafter_service.registry keeps per target model) from earlier calls."""
    from cluster.local import LocalEngine, set_cpu_threads
    from drafter_service import registry

    load = LocalEngine.load.__func__
    engines: dict[tuple, LocalEngine] = {}

    def load_once(cls, *args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in engines:
            engines[key] = load(cls, *args, **kwargs)
        engine = engines[key]
        set_cpu_threads()
        with registry._load_lock:
            registry._memories.pop(id(engine.model), None)
        return engine

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LocalEngine, "load", classmethod(load_once))
        yield
    for engine in engines.values():
        engine.close()
