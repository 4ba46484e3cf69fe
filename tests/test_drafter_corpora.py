"""The drafter training corpora never contain what the bench measures on.

The bench scores on the first questions of each group (router.domains.split_dev);
the shipped drafters are trained on data/drafter-corpora/*. A leak (a bench
article cut into a synthetic summary prompt, a bench sentence into a translation
prompt) would inflate every acceptance number, so it is checked here, on text
spans, not whole prompts.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

from conftest import DEV_QUESTIONS
from router.domains import read_questions, split_dev

REPO = Path(__file__).resolve().parents[1]
CORPORA = REPO / "data" / "drafter-corpora"


def _spans(text: str, words: int = 8) -> set[str]:
    """Every run of `words` consecutive words, lower-cased: what a cut-out passage would share."""
    w = re.findall(r"\w+", text.lower())
    return {" ".join(w[i:i + words]) for i in range(max(len(w) - words + 1, 0))}


def _corpus_text() -> str:
    parts = []
    for f in sorted(CORPORA.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            record = json.loads(line)
            parts.append(record.get("prompt") or (record.get("turns") or [""])[0])
    return "\n".join(parts)


def test_no_bench_text_in_any_training_corpus():
    bench, _ = split_dev(read_questions(DEV_QUESTIONS))
    corpus = _spans(_corpus_text())
    leaks = []
    for q in bench:
        # the instruction words every prompt of a category shares are not a leak: drop them
        body = q["turns"][0].split(":", 1)[1] if q["category"] in ("translation", "summarization") else q["turns"][0]
        shared = _spans(body) & corpus
        if shared:
            leaks.append((q["question_id"], q["category"], sorted(shared)[:2]))
    assert not leaks, f"bench text found in the drafter corpora: {leaks[:5]}"


def test_synthetic_prompts_are_reproducible(tmp_path):
    # the committed corpora are exactly what the script writes (deterministic, offline)
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_synthetic_prompts.py"), str(DEV_QUESTIONS),
                    str(tmp_path)], check=True, capture_output=True)
    made = sorted(p.name for p in tmp_path.glob("*.jsonl"))
    assert made == ["synthetic-extraction.jsonl", "synthetic-language.jsonl", "synthetic-math.jsonl"]
    for name in made:
        assert (tmp_path / name).read_text() == (CORPORA / name).read_text(), name
