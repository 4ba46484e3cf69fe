"""Greedy decoding is lossless: `specserve generate` gives Hugging Face's tokens.

The oracle is transformers `generate(do_sample=False)` on the same GGUF,
with its own tokenizer and chat template. A difference is accepted only at
a near-tie of HF's own top-two logits, and the test says so.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from cluster.cli import main as cli_main
from conftest import dev_prompts
from drafter_service.registry import DRAFTER_NAMES, SHIPPED_DRAFTERS

PROMPTS = dev_prompts(20)
MAX_TOKENS = 64
NEAR_TIE = 1e-3
# layer-skip drafting costs most of a target pass per token; short drafts keep the test quick
DRAFT_LENGTH = {"layerskip": 2}
# every prompt for each kind of drafter; the specialised small drafters (the
# same kind as small-general) on the first prompts, one per category
PROMPT_COUNT = {name: 8 for name in SHIPPED_DRAFTERS if name != "small-general"}

_oracle_cache: dict[int, tuple[list[int], torch.Tensor]] = {}


def oracle(hf_oracle, i: int) -> tuple[list[int], torch.Tensor]:
    """HF's generated ids for prompt i and its logits at each step."""
    if i not in _oracle_cache:
        model, tok = hf_oracle
        enc = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i][1]}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 return_dict_in_generate=True, output_logits=True)
        ids = out.sequences[0, enc["input_ids"].shape[1]:].tolist()
        _oracle_cache[i] = (ids, torch.stack(out.logits)[:, 0])
    return _oracle_cache[i]


def cli_generate(capsys, prompt: str, drafter: str) -> dict:
    argv = ["generate", "--chat", "--json", "--prompt", prompt, "--max-tokens", str(MAX_TOKENS),
            "--drafter", drafter, "--draft-length", str(DRAFT_LENGTH.get(drafter, 5))]
    assert cli_main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("drafter", DRAFTER_NAMES)
def test_greedy_matches_hf_generate(hf_oracle, smollm2, capsys, drafter):
    ties = []
    for i, (category, prompt) in enumerate(PROMPTS[:PROMPT_COUNT.get(drafter)]):
        want, logits = oracle(hf_oracle, i)
        got = cli_generate(capsys, prompt, drafter)["token_ids"]
        if got == want:
            continue
        pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        assert pos < len(want) and pos < len(got), (
            f"{drafter}, prompt {i} ({category}): lengths differ with equal prefixes ({len(got)} vs {len(want)})")
        top2 = torch.topk(logits[pos], 2).values
        gap = float(top2[0] - top2[1])
        assert gap <= NEAR_TIE, (
            f"{drafter}, prompt {i} ({category}): token {pos} is {got[pos]}, HF says {want[pos]} "
            f"and its top-two logits differ by {gap:.2e} (not a near-tie)")
        ties.append(f"prompt {i} ({category}) token {pos}: HF top-two gap {gap:.1e}")
    if ties:
        warnings.warn(f"{drafter}: differs from HF only at near-ties: " + "; ".join(ties))
