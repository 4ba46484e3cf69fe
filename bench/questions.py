"""The bench's questions: Spec-Bench's dev questions, a few per category, in the bench's
categories. Light to import (no torch): the load benchmark reads them too."""

from __future__ import annotations

from collections import defaultdict

from router.domains import BENCH_GROUPS, BENCH_PROMPTS_PER_GROUP, bench_group, read_questions

CATEGORIES = list(BENCH_GROUPS)


def load_questions(path: str, limit_per_category: int) -> list[dict]:
    if limit_per_category > BENCH_PROMPTS_PER_GROUP:
        raise ValueError(f"--limit-per-category must be at most {BENCH_PROMPTS_PER_GROUP}: later dev questions "
                         "are training data for the classifier and the shipped drafters")
    picked: dict[str, list[dict]] = defaultdict(list)
    for q in read_questions(path):
        cat = bench_group(q["category"])
        if len(picked[cat]) < limit_per_category:
            picked[cat].append({**q, "bench_category": cat})
    return [q for cat in CATEGORIES for q in picked.get(cat, [])]
