"""Training data for drafter distillation: token sequences and the target's
next-token distributions over them.

A drafter has to predict what the *target* will say, so question files
become chat prompts followed by the target's own greedy answer (FastDraft,
DistillSpec); plain text files are cut into windows and teacher-forced.

Corpus files:
- `.jsonl`: one object per line with `turns` (Spec-Bench: the first turn is
  the user message), `prompt`, or `messages` (chat) -> prompt + target answer;
  or with `text` -> plain text.
- anything else (`.txt`, `.md`, `.py`, ...): plain UTF-8 text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

import torch

from runtime.model import Transformer, attention_mask, causal_ancestors
from runtime.tokenizer import Tokenizer

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".jsonl"}
MIN_WINDOW_TOKENS = 9  # a text's last window shorter than this teaches too little to keep


def corpus_files(paths: Iterable[str | Path]) -> list[Path]:
    """The files named, directories expanded to the text files under them."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"corpus path {str(p)!r} does not exist")
    return files


def read_corpus(files: list[Path], tokenizer: Tokenizer, window: int
                ) -> tuple[list[list[int]], list[list[int]]]:
    """(chat prompts to answer, plain text windows), as token ids."""
    prompts, texts = [], []
    for f in files:
        if f.suffix == ".jsonl":
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if "text" in record:
                    texts.extend(_windows(tokenizer.encode(record["text"]), window))
                else:
                    prompts.append(tokenizer.encode_chat(_messages(record, f, n)))
        else:
            texts.extend(_windows(tokenizer.encode(f.read_text(errors="replace")), window))
    return prompts, texts


def _messages(record: dict, f: Path, line: int) -> list[dict[str, str]]:
    if "messages" in record:
        return record["messages"]
    if "turns" in record:
        return [{"role": "user", "content": record["turns"][0]}]
    if "prompt" in record:
        return [{"role": "user", "content": record["prompt"]}]
    raise ValueError(f"{f}:{line}: expected a 'turns', 'prompt', 'messages' or 'text' field")


def _windows(ids: list[int], window: int) -> list[list[int]]:
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) >= MIN_WINDOW_TOKENS]


@torch.inference_mode()
def answer_with_teacher(model: Transformer, prompts: list[list[int]], max_tokens: int, eos: set[int], k: int,
                        batch: int = 64, on_done: Callable[[int, dict], None] | None = None) -> None:
    """Answer each prompt greedily with the target and keep its top-k distribution at
    every position of prompt + answer: the decoding pass is the teacher pass.
    `on_done(i, item)` gets each prompt's item as soon as its batch is done (so a
    long run can be cached as it goes). Prompts of similar length share a batch."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch):
        chunk = order[start:start + batch]
        for i, item in zip(chunk, _decode_together(model, [prompts[i] for i in chunk], max_tokens, eos, k)):
            if on_done:
                on_done(i, item)


def _top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.topk(torch.softmax(logits.float(), dim=-1), k)
    return top.indices.to(torch.int32).cpu(), top.values.to(torch.float16).cpu()


def _decode_together(model: Transformer, prompts: list[list[int]], max_tokens: int, eos: set[int], k: int
                     ) -> list[dict]:
    """Greedy decoding of several prompts, one cache row each, one forward per step."""
    device, rows = model.device, len(prompts)
    cache = model.new_cache(max(map(len, prompts)) + max_tokens, batch=rows)
    dists = []  # per row: top-k after each position
    for row, p in enumerate(prompts):
        n = len(p)
        logits = model(torch.tensor([p], device=device), torch.arange(n, device=device)[None],
                       cache.row_view(row), attention_mask(0, causal_ancestors(n, device)))[0]
        dists.append([_top_k(logits, k)])
    answers = [[int(d[0][0][-1, 0])] for d in dists]
    while not all(a[-1] in eos or len(a) >= max_tokens for a in answers):
        lengths = list(cache.lengths)
        span = max(lengths) + 1
        mask = torch.zeros(rows, 1, span, dtype=torch.bool)
        for r, n in enumerate(lengths):
            mask[r, 0, :n + 1] = True  # its own prefix and itself; other rows' padding is hidden
        tokens = torch.tensor([[a[-1]] for a in answers], device=device)
        logits = model(tokens, torch.tensor(lengths, device=device)[:, None], cache, mask.to(device))[:, 0]
        ids, probs = _top_k(logits, k)
        for r, a in enumerate(answers):
            if a[-1] not in eos and len(a) < max_tokens:  # finished rows ride along, ignored
                dists[r].append((ids[r:r + 1], probs[r:r + 1]))
                a.append(int(ids[r, 0]))
    items = []
    for p, a, d in zip(prompts, answers, dists):
        ids = torch.cat([x for x, _ in d])
        probs = torch.cat([y for _, y in d])
        pad = len(p) + len(a) - len(ids)  # the last token's successor was never needed
        items.append({"tokens": torch.tensor(p + a, dtype=torch.int32), "answer_from": len(p),
                      "top_ids": torch.cat((ids, ids[-1:].expand(pad, k))),
                      "top_probs": torch.cat((probs, probs[-1:].expand(pad, k)))})
    return items


@torch.inference_mode()
def teacher_top_k(model: Transformer, tokens: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k next-token ids [T, k] (int32) and probabilities [T, k] (float16)
    after each prefix of `tokens`, teacher-forced in one pass."""
    n = len(tokens)
    cache = model.new_cache(n)
    logits = model(torch.tensor([tokens], device=model.device), torch.arange(n, device=model.device)[None],
                   cache, attention_mask(0, causal_ancestors(n, model.device)))[0]
    return _top_k(logits, k)
