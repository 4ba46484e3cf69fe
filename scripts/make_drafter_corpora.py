"""Write the corpora the shipped drafters are trained on (docs/DRAFTERS.md).

Only the training part of the Spec-Bench dev questions (router.domains.split_dev:
the bench's prompts are held out), grouped by the domain each drafter serves.

    python scripts/make_drafter_corpora.py ../shared/data/spec_bench/dev.jsonl data/drafter-corpora
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from router.domains import read_questions, split_dev  # noqa: E402

SPECIALISTS = {
    "math": ("math_reasoning", "math", "reasoning", "coding", "stem"),
    "extraction": ("summarization", "rag", "qa", "extraction"),
    "language": ("translation", "writing", "roleplay", "humanities"),
}


def main(questions: str, out: str) -> None:
    _, train = split_dev(read_questions(questions))
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = {"general": train, **{name: [q for q in train if q["category"] in cats]
                                   for name, cats in SPECIALISTS.items()}}
    for name, qs in groups.items():
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(q) + "\n" for q in qs))
        print(f"{name}: {len(qs)} questions")


if __name__ == "__main__":
    main(*sys.argv[1:3])
