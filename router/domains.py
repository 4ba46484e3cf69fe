"""The domains requests are routed by: Spec-Bench's categories.

The bench reports six groups: the five large Spec-Bench categories and
MT-bench's eight, together as `mt_bench`. The first `BENCH_PROMPTS_PER_GROUP`
dev questions of each group (file order) are what `specserve bench` measures
on; anything trained on dev questions (the prompt classifier, the shipped
drafters) uses only the rest, so the bench never scores on training data.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from speculative.domains import DOMAINS  # noqa: F401  (re-exported: the router's modules take it from here)

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
BENCH_GROUPS = ("translation", "summarization", "qa", "math_reasoning", "rag", "mt_bench")
BENCH_PROMPTS_PER_GROUP = 10


def bench_group(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


def read_questions(path: str | Path) -> list[dict]:
    """Spec-Bench questions, one JSON object per line."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def split_dev(questions: list[dict]) -> tuple[list[dict], list[dict]]:
    """(bench questions, training questions): the first BENCH_PROMPTS_PER_GROUP
    of each bench group in file order are the bench's, the rest may be trained on."""
    seen: Counter = Counter()
    bench, train = [], []
    for q in questions:
        group = bench_group(q["category"])
        seen[group] += 1
        (bench if seen[group] <= BENCH_PROMPTS_PER_GROUP else train).append(q)
    return bench, train
