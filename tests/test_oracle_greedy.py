"""Greedy decoding is lossless: `specserve generate` gives Hugging Face's tokens.

The oracle is transformers `generate(do_sample=False)` on the same GGUF,
with its own tokenizer and chat template. A difference is accepted only at
a near-tie of HF's own top-two logits, and the test says so. The runs are
made in the worker processes, one thread each (tests/core_workers.py); the
last test runs on every core.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from commands.cli import main as cli_main
from core_workers import WORKERS, cli_json
from drafter_service.registry import DRAFTER_NAMES, SHIPPED_DRAFTERS
from oracle import GREEDY_PROMPTS, MAX_TOKENS, PROMPTS, near_tie_or_equal

# layer-skip drafting costs most of a target pass per token; short drafts keep the test quick
DRAFT_LENGTH = {"layerskip": 2}
# one prompt of each dev category for each kind of drafter (PROMPTS takes the categories
# round-robin, so its first prompts are one per category); the specialised small drafters
# (the same kind as small-general, which has them all) and self-int4 (the same model
# drafter's code, on the target's int4 twin) on the first four; the slow layer-skip drafter
# (that code on the target's own layers) on six
PROMPT_COUNT = {name: 4 for name in SHIPPED_DRAFTERS if name != "small-general"} | {"layerskip": 6, "self-int4": 4}


# token trees wider than a chain (--tree-budget): a small drafter's own tree, and fused trees
TREE_CASES = [("small-general", 16), ("pld+suffix+small-general", 16), ("recycle", 16)]


def cli_args(prompt: str, drafter: str, tree_budget: int | None) -> tuple[str, ...]:
    return ("generate", "--chat", "--json", "--prompt", prompt, "--max-tokens", str(MAX_TOKENS), "--drafter",
            drafter, "--draft-length", str(DRAFT_LENGTH.get(drafter, 5))) + (
        ("--tree-budget", str(tree_budget)) if tree_budget else ())


def runs(drafter: str, tree_budget: int | None = None) -> list[tuple]:
    """The `specserve generate` runs a test checks, as calls for the worker processes."""
    count = 8 if tree_budget else PROMPT_COUNT.get(drafter, GREEDY_PROMPTS)
    return [(cli_json, cli_args(prompt, drafter, tree_budget)) for _, prompt in PROMPTS[:count]]


def background_jobs(item) -> list[tuple]:
    params = getattr(item, "callspec", None)
    return runs(params.params["drafter"], params.params.get("tree_budget")) if params else []


@pytest.mark.parametrize("drafter", DRAFTER_NAMES)
def test_greedy_matches_hf_generate(hf_oracle, core_workers, drafter):
    ties = []
    for i, out in enumerate(core_workers.results(runs(drafter))):
        tie = near_tie_or_equal(hf_oracle, i, out["token_ids"], drafter)
        if tie:
            ties.append(tie)
    if ties:
        warnings.warn(f"{drafter}: differs from HF only at near-ties: " + "; ".join(ties))


@pytest.mark.parametrize("drafter,tree_budget", TREE_CASES)
def test_greedy_token_trees_match_hf_generate(hf_oracle, core_workers, drafter, tree_budget):
    ties, drafted = [], 0
    for i, out in enumerate(core_workers.results(runs(drafter, tree_budget))):
        drafted = max(drafted, out["draft_tokens"] / max(out["target_forward_passes"] - 1, 1))
        tie = near_tie_or_equal(hf_oracle, i, out["token_ids"], f"{drafter} tree {tree_budget}")
        if tie:
            ties.append(tie)
    assert drafted > 5, "the trees were never wider than a chain"
    if ties:
        warnings.warn(f"{drafter} with trees: differs from HF only at near-ties: " + "; ".join(ties))


def test_greedy_on_every_core_matches_hf_generate(hf_oracle, capsys):
    """The runs above take one thread each. `specserve generate` started as users start it
    takes every core, whose kernels split the work and round unlike one thread: fused trees
    there, in this process."""
    ties = []
    for i, (_, prompt) in enumerate(PROMPTS[:4]):
        assert cli_main(list(cli_args(prompt, "pld+suffix+small-general", 16))) == 0
        assert torch.get_num_threads() == WORKERS
        tie = near_tie_or_equal(hf_oracle, i, json.loads(capsys.readouterr().out)["token_ids"], "on every core")
        if tie:
            ties.append(tie)
    if ties:
        warnings.warn("on every core: differs from HF only at near-ties: " + "; ".join(ties))
