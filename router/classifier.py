"""A light, offline classifier of a prompt's domain (the cold start of routing).

    clf = DomainClassifier.load()          # the shipped router/classifier.json
    clf.predict("Translate German to English: ...")   # -> "translation"
    clf.scores(text)                       # -> {domain: probability} over DOMAINS

Features: hashed word unigrams and bigrams plus a few cheap prompt features
(length bucket, first and last word, digits, non-ASCII, newlines), present or
not, L2-normalised. Two softmax regressions over them, because Spec-Bench
has about 45 questions for each large category but only 3 to 7 for each
MT-bench one (none for `writing` in the training part):
  - a group model over the six bench groups (MT-bench pooled into one group
    with enough examples to learn what an MT-bench prompt looks like),
  - an MT-bench model over the MT-bench categories seen in training,
and P(category) = P(group) * P(category | mt_bench) for MT-bench categories.
A category with no training example gets probability 0.

Trained only on the training part of `split_dev` (each question's first
turn); the bench part is held out and only measured on:

    python -m router.classifier train --questions ../shared/data/spec_bench/dev.jsonl

rewrites router/classifier.json and prints the held-out accuracy. Weights
are stored as float16 (base64), and the trained model is rounded the same way,
so the model `train` returns is the one `load` gives back.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import re
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .domains import BENCH_GROUPS, DOMAINS, MT_BENCH, bench_group, read_questions, split_dev

DEFAULT_PATH = Path(__file__).with_name("classifier.json")
FEATURE_DIM = 4096
# Chosen by 5-fold cross-validation on the training part, not on the bench part.
L2 = 1e-3
STEPS = 600
LEARNING_RATE = 2.0

_WORD = re.compile(r"\w+|[^\w\s]")


def features(text: str) -> np.ndarray:
    """Sorted hashed feature indices present in `text`."""
    words = _WORD.findall(text.lower())
    tokens = words + [f"{a} {b}" for a, b in zip(words, words[1:])]
    tokens += [f"#len{int(math.log2(1 + len(words)))}",  # length separates rag/summarization from qa
               f"#first:{words[0] if words else ''}", f"#last:{words[-1] if words else ''}"]
    tokens += [name for name, present in (("#digit", any(c.isdigit() for c in text)),
                                          ("#nonascii", any(ord(c) > 127 for c in text)),
                                          ("#newline", "\n" in text)) if present]
    # crc32, not hash(): Python salts str hashes per process.
    return np.unique([zlib.crc32(t.encode()) % FEATURE_DIM for t in tokens])


class _Softmax:
    """Multinomial logistic regression over binary hashed features."""

    def __init__(self, classes: Sequence[str], weights: np.ndarray, bias: np.ndarray):
        self.classes, self.weights, self.bias = tuple(classes), weights, bias

    def probs(self, feats: np.ndarray) -> np.ndarray:
        logits = self.weights[feats].sum(0) / math.sqrt(max(len(feats), 1)) + self.bias
        p = np.exp(logits - logits.max())
        return p / p.sum()

    @classmethod
    def fit(cls, docs: list[np.ndarray], labels: list[str]) -> _Softmax:
        classes = sorted(set(labels))
        x = np.zeros((len(docs), FEATURE_DIM))
        for row, feats in zip(x, docs):
            row[feats] = 1 / math.sqrt(len(feats))
        y = np.array([classes.index(label) for label in labels])
        onehot = np.eye(len(classes))[y]
        # Balanced class weights: each class counts as much as any other,
        # however few examples it has.
        sample_w = (len(y) / (len(classes) * np.bincount(y)))[y][:, None] / len(y)
        w, b = np.zeros((FEATURE_DIM, len(classes))), np.zeros(len(classes))
        for _ in range(STEPS):  # full-batch gradient descent: deterministic
            logits = x @ w + b
            p = np.exp(logits - logits.max(1, keepdims=True))
            grad = (p / p.sum(1, keepdims=True) - onehot) * sample_w
            w -= LEARNING_RATE * (x.T @ grad + L2 * w)
            b -= LEARNING_RATE * grad.sum(0)
        return cls(classes, _round16(w), _round16(b))

    def to_json(self) -> dict:
        return {"classes": list(self.classes), "bias": self.bias.tolist(),
                "weights_float16_base64": base64.b64encode(self.weights.astype("<f2").tobytes()).decode()}

    @classmethod
    def from_json(cls, d: dict) -> _Softmax:
        raw = np.frombuffer(base64.b64decode(d["weights_float16_base64"]), dtype="<f2")
        return cls(d["classes"], raw.astype(np.float64).reshape(FEATURE_DIM, -1), np.array(d["bias"]))


def _round16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float64)


class DomainClassifier:
    """The group model and the MT-bench model; see the module docstring."""

    def __init__(self, groups: _Softmax, mt_bench: _Softmax):
        self.groups, self.mt_bench = groups, mt_bench

    @classmethod
    def load(cls, path: str | Path | None = None) -> DomainClassifier:
        path = Path(path or DEFAULT_PATH)
        d = json.loads(path.read_text())
        if d["feature_dim"] != FEATURE_DIM:
            raise ValueError(f"{path}: feature_dim {d['feature_dim']}, this code hashes into {FEATURE_DIM}")
        return cls(_Softmax.from_json(d["groups"]), _Softmax.from_json(d["mt_bench"]))

    def save(self, path: str | Path | None = None) -> None:
        d = {"feature_dim": FEATURE_DIM, "groups": self.groups.to_json(), "mt_bench": self.mt_bench.to_json()}
        Path(path or DEFAULT_PATH).write_text(json.dumps(d) + "\n")

    @classmethod
    def train(cls, questions: list[dict]) -> DomainClassifier:
        """Fit on `questions` (first turns); pass only training questions."""
        docs = [features(q["turns"][0]) for q in questions]
        cats = [q["category"] for q in questions]
        mt = [i for i, c in enumerate(cats) if c in MT_BENCH]
        return cls(_Softmax.fit(docs, [bench_group(c) for c in cats]),
                   _Softmax.fit([docs[i] for i in mt], [cats[i] for i in mt]))

    def scores(self, text: str) -> dict[str, float]:
        """Probability of each domain in DOMAINS (summing to 1)."""
        feats = features(text)
        p_group = dict(zip(self.groups.classes, self.groups.probs(feats)))
        p_mt = dict(zip(self.mt_bench.classes, self.mt_bench.probs(feats)))
        return {d: float(p_group.get("mt_bench", 0.0) * p_mt.get(d, 0.0) if d in MT_BENCH else p_group.get(d, 0.0))
                for d in DOMAINS}

    def predict(self, text: str) -> str:
        """The most likely group, then within MT-bench the most likely category.

        Not the argmax of `scores`: that splits MT-bench's probability over
        its categories and so would rarely pick any of them.
        """
        feats = features(text)
        group = self.groups.classes[int(np.argmax(self.groups.probs(feats)))]
        return self.mt_bench.classes[int(np.argmax(self.mt_bench.probs(feats)))] if group == "mt_bench" else group


def evaluate(clf: DomainClassifier, questions: list[dict]) -> dict[str, tuple[float, float, int]]:
    """Per bench group and "overall": (category accuracy, group accuracy, questions)."""
    hits: dict[str, list[tuple[bool, bool]]] = {}
    for q in questions:
        guess, group = clf.predict(q["turns"][0]), bench_group(q["category"])
        for key in (group, "overall"):
            hits.setdefault(key, []).append((guess == q["category"], bench_group(guess) == group))
    return {key: (sum(c for c, _ in h) / len(h), sum(g for _, g in h) / len(h), len(h))
            for key in (*BENCH_GROUPS, "overall") if (h := hits.get(key))}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m router.classifier", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train on the dev questions' training part, report on the bench part")
    train.add_argument("--questions", required=True, help="Spec-Bench dev.jsonl")
    train.add_argument("--out", default=str(DEFAULT_PATH))
    args = parser.parse_args(argv)

    bench, training = split_dev(read_questions(args.questions))
    clf = DomainClassifier.train(training)
    clf.save(args.out)
    print(f"trained on {len(training)} questions, wrote {args.out}")
    print(f"held-out bench part: {'group':<16}{'category acc':>14}{'group acc':>11}{'n':>5}")
    for key, (cat, grp, n) in evaluate(clf, bench).items():
        print(f"{'':20}{key:<16}{cat:>14.3f}{grp:>11.3f}{n:>5}")


if __name__ == "__main__":
    main()
