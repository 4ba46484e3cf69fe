"""The external oracle: Hugging Face transformers `generate(do_sample=False)` on the
same GGUF, with its own tokenizer and chat template. A difference from it is
accepted only at a near-tie of HF's own top-two logits."""

from __future__ import annotations

import torch

from conftest import dev_prompts

PROMPTS = dev_prompts(20)  # (category, first turn)
MAX_TOKENS = 64
NEAR_TIE = 1e-3

_cache: dict[int, tuple[list[int], torch.Tensor]] = {}


def oracle(hf_oracle, i: int) -> tuple[list[int], torch.Tensor]:
    """HF's generated ids for PROMPTS[i] and its logits at each step."""
    if i not in _cache:
        model, tok = hf_oracle
        enc = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i][1]}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 return_dict_in_generate=True, output_logits=True)
        ids = out.sequences[0, enc["input_ids"].shape[1]:].tolist()
        _cache[i] = (ids, torch.stack(out.logits)[:, 0])
    return _cache[i]


def near_tie_or_equal(hf_oracle, i: int, got: list[int], label: str) -> str | None:
    """Assert `got` is HF's output for PROMPTS[i], or departs from it only at a near-tie
    (described in the return value, for a warning)."""
    want, logits = oracle(hf_oracle, i)
    if got == want:
        return None
    category = PROMPTS[i][0]
    pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert pos < len(want) and pos < len(got), (
        f"{label}, prompt {i} ({category}): lengths differ with equal prefixes ({len(got)} vs {len(want)})")
    top2 = torch.topk(logits[pos], 2).values
    gap = float(top2[0] - top2[1])
    assert gap <= NEAR_TIE, (
        f"{label}, prompt {i} ({category}): token {pos} is {got[pos]}, HF says {want[pos]} "
        f"and its top-two logits differ by {gap:.2e} (not a near-tie)")
    return f"prompt {i} ({category}) token {pos}: HF top-two gap {gap:.1e}"
