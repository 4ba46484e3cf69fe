"""Greedy decoding is lossless: `specserve generate` gives Hugging Face's tokens.

The oracle is transformers `generate(do_sample=False)` on the same GGUF,
with its own tokenizer and chat template. A difference is accepted only at
a near-tie of HF's own top-two logits, and the test says so.
"""

from __future__ import annotations

import json
import warnings

import pytest

from cluster.cli import main as cli_main
from drafter_service.registry import DRAFTER_NAMES, SHIPPED_DRAFTERS
from oracle import MAX_TOKENS, PROMPTS, near_tie_or_equal

# layer-skip drafting costs most of a target pass per token; short drafts keep the test quick
DRAFT_LENGTH = {"layerskip": 2}
# one prompt of each dev category for each kind of drafter (PROMPTS takes the categories
# round-robin, so its first prompts are one per category); the specialised small drafters
# (the same kind as small-general, which has them all) and self-int4 (the same model
# drafter's code, on the target's int4 twin) on the first four; the slow layer-skip drafter
# (that code on the target's own layers) on six
EVERY_CATEGORY = len({category for category, _ in PROMPTS})
PROMPT_COUNT = {name: 4 for name in SHIPPED_DRAFTERS if name != "small-general"} | {"layerskip": 6, "self-int4": 4}


# token trees wider than a chain (--tree-budget): a small drafter's own tree, and fused trees
TREE_CASES = [("small-general", 16), ("pld+suffix+small-general", 16), ("recycle", 16)]


def cli_generate(capsys, prompt: str, drafter: str, *extra: str) -> dict:
    argv = ["generate", "--chat", "--json", "--prompt", prompt, "--max-tokens", str(MAX_TOKENS),
            "--drafter", drafter, "--draft-length", str(DRAFT_LENGTH.get(drafter, 5)), *extra]
    assert cli_main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("drafter", DRAFTER_NAMES)
def test_greedy_matches_hf_generate(hf_oracle, smollm2, cli_loads_model_once, capsys, drafter):
    ties = []
    for i, (_, prompt) in enumerate(PROMPTS[:PROMPT_COUNT.get(drafter, EVERY_CATEGORY)]):
        tie = near_tie_or_equal(hf_oracle, i, cli_generate(capsys, prompt, drafter)["token_ids"], drafter)
        if tie:
            ties.append(tie)
    if ties:
        warnings.warn(f"{drafter}: differs from HF only at near-ties: " + "; ".join(ties))


@pytest.mark.parametrize("drafter,tree_budget", TREE_CASES)
def test_greedy_token_trees_match_hf_generate(hf_oracle, smollm2, cli_loads_model_once, capsys, drafter,
                                              tree_budget):
    ties, drafted = [], 0
    for i, (_, prompt) in enumerate(PROMPTS[:8]):
        out = cli_generate(capsys, prompt, drafter, "--tree-budget", str(tree_budget))
        drafted = max(drafted, out["draft_tokens"] / max(out["target_forward_passes"] - 1, 1))
        tie = near_tie_or_equal(hf_oracle, i, out["token_ids"], f"{drafter} tree {tree_budget}")
        if tie:
            ties.append(tie)
    assert drafted > 5, "the trees were never wider than a chain"
    if ties:
        warnings.warn(f"{drafter} with trees: differs from HF only at near-ties: " + "; ".join(ties))
