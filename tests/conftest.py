import json
import sys
from itertools import cycle
from pathlib import Path

import pytest
import torch

# test helpers (tiny.py, ...) import as plain modules
sys.path.insert(0, str(Path(__file__).parent))

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
