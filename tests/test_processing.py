"""Processing the target's distribution at every tree node (speculative.processing): penalties,
logit bias, min_tokens and grammars keep speculative decoding exactly constrained decoding
of the target alone.

On the tiny model with a tokenizer of digits (tiny.tiny_grammars): each tree row is
processed as decoding alone would process it at that node; greedy speculative output
equals greedy decoding under the same processing, for every drafter kind and with the
forbidden nodes pruned and the forced ones drafted; sampled output follows the exactly
computed constrained distribution (chi-square), and the test catches a processor that
forgets the path above a node.
"""

from __future__ import annotations

import pytest
import torch

import speculative.processing as processing
from core_workers import seed_shares
from drafter_service.drafters import ModelDrafter, PromptLookupDrafter, SuffixDrafter
from runtime.model import attention_mask, causal_ancestors
from speculative import decoding
from speculative.processing import Processor
from speculative.sampling import SamplingParams, probabilities
from speculative.suffix import SuffixIndex
from speculative.tree import DraftTree
from test_sampling_distribution import ALPHA, chi_square_p
from tiny import TINY, tiny_grammars, tiny_model

V = TINY.vocab_size
EOS = 7
PROMPT = [1, 2, 3, 1, 2]
REGEX = r"(1[0-3]|2[3-6])*(45|5)"  # a small language: several paths, a forced token after each 1
PENALTIES = dict(presence_penalty=1.0, frequency_penalty=1.5, repetition_penalty=1.3, logit_bias=((3, 1.5), (6, -2.0)))
SAMPLES = 6_000


@pytest.fixture(scope="module")
def grammars():
    return tiny_grammars()


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_model(seed=0, logit_scale=0.5)


def last_logits(target, seq: list[int]) -> torch.Tensor:
    cache = target.new_cache(len(seq))
    return target(torch.tensor([seq]), torch.arange(len(seq))[None], cache,
                  attention_mask(0, causal_ancestors(len(seq))), logits_from=len(seq) - 1)[0, -1]


def alone(params, grammars, output: list[int], logits: torch.Tensor) -> torch.Tensor:
    """The processed logits after PROMPT + output, as decoding alone processes them."""
    processor = Processor.resumed(params, PROMPT, output, V, grammars, stops=[EOS])
    return processor.scores(logits[None], DraftTree())[0]


def test_each_tree_row_is_processed_with_its_own_path(grammars):
    params = SamplingParams(grammar=grammars.compile("regex", REGEX, "regex"), min_tokens=3, **PENALTIES)
    tree = DraftTree([1, 2, 0, 3, 2, 5], [-1, -1, 0, 0, 1, 1])  # 1 -> {0, 3}, 2 -> {2, 5}
    processor = Processor.resumed(params, PROMPT, [2, 3], V, grammars, stops=[EOS])
    logits = torch.randn(1 + len(tree), V)
    got = processor.scores(logits, tree)
    paths = [[], [1], [2], [1, 0], [1, 3], [2, 2], [2, 5]]
    for row, path in enumerate(paths):
        if row in (3, 5):  # 1 then 0, 2 then 2: the grammar forbids them, their rows are never read
            continue
        want = alone(params, grammars, [2, 3] + path, logits[row])
        assert torch.equal(got[row], want), (row, path)


def test_forbidden_nodes_are_pruned_and_forced_ones_added(grammars):
    params = SamplingParams(grammar=grammars.compile("regex", REGEX, "regex"))
    processor = Processor(params, PROMPT, V, grammars, stops=[EOS])
    tree = DraftTree([1, 6, 2, 0, 2], [-1, -1, -1, 0, 2])  # 1 ok, 6 no, 2 ok; 1 -> 0 ok, 2 -> 2 no
    pruned, forced = processor.prepare(tree, room=4)
    assert (pruned.tokens, pruned.parents, forced) == ([1, 2, 0], [-1, -1, 0], 0)
    # "1234" is the only way on: drafted for free, merged with the draft's own 1 (its 5 pruned)
    forcing = Processor(SamplingParams(grammar=grammars.compile("regex", "1234[0-6]", "regex")), PROMPT, V,
                        grammars, stops=[EOS])
    tree, forced = forcing.prepare(DraftTree([1, 5], [-1, 0]), room=8)
    assert (tree.tokens, tree.parents, forced) == ([1, 2, 3, 4], [-1, 0, 1, 2], 4)
    assert forcing.prepare(DraftTree(), room=2)[0].tokens == [1, 2]  # no more than the room


def test_a_grammar_ends_the_output_with_the_end_token(grammars, target):
    params = SamplingParams(max_tokens=30, grammar=grammars.compile("regex", REGEX, "regex"))
    out = decoding.generate(target, PROMPT, params, None, 0, [EOS], grammars=grammars)
    text = "".join(map(str, out.token_ids))
    assert out.finish_reason == "stop" and out.token_ids[-1] == EOS
    import re
    assert re.fullmatch(REGEX, text[:-1]), text


DRAFTERS = {
    "model": lambda d: ModelDrafter(d, max_len=64),
    "prompt_lookup": lambda d: PromptLookupDrafter(V),
    "suffix": lambda d: SuffixDrafter(SuffixIndex(depth=4, max_draft=4), V),
}


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
@pytest.mark.parametrize("constraint", ["grammar", "penalties", "both", "min_tokens"])
def test_greedy_speculation_equals_processed_plain_decoding(grammars, target, drafter, constraint):
    draft_model = tiny_model(seed=0, logit_scale=0.5)  # the target itself: drafts are often right
    extra = {"grammar": dict(grammar=grammars.compile("regex", REGEX, "regex")), "penalties": PENALTIES,
             "both": dict(grammar=grammars.compile("regex", REGEX, "regex"), **PENALTIES),
             "min_tokens": dict(min_tokens=12, stop_token_ids=(EOS, 6))}[constraint]
    params = SamplingParams(max_tokens=24, **extra)
    eos = [EOS] if "grammar" in extra else []  # a grammar ends with it; else the output runs to max_tokens
    plain = decoding.generate(target, PROMPT, params, None, 0, eos, grammars=grammars)
    drafted = decoding.generate(target, PROMPT, params, DRAFTERS[drafter](draft_model), 4, eos, tree_budget=8,
                                grammars=grammars)
    assert drafted.token_ids == plain.token_ids
    assert drafted.draft_tokens > 0 or drafter != "model"
    if constraint == "min_tokens":
        assert not {EOS, 6} & set(plain.token_ids[:12])


def exact_pair(target, params, grammars) -> torch.Tensor:
    """P(token 2 = a, token 3 = b) under the processed target alone [V, V]: token 0 comes from
    the prompt's pass, token 3 from the row of a draft's second node, whose processing
    counts the path above it. A path with the end token before them is left out, and a
    path the grammar forbids has probability 0."""
    prefixes = [([], 1.0)]
    for _ in range(2):
        prefixes = [(seq + [t], w * float(p[t])) for seq, w in prefixes
                    for p in [probabilities(alone(params, grammars, seq, last_logits(target, PROMPT + seq)), params)]
                    for t in range(V) if p[t] > 0 and t != EOS]
    joint = torch.zeros(V, V)
    for seq, w in prefixes:
        pa = probabilities(alone(params, grammars, seq, last_logits(target, PROMPT + seq)), params)
        for a in range(V):
            if pa[a] > 0 and a != EOS:
                ctx = seq + [a]
                joint[a] += w * pa[a] * probabilities(alone(params, grammars, ctx, last_logits(target, PROMPT + ctx)),
                                                      params)
    return joint


def _sampled_pairs(constraint: str, seeds: range, forgetful: bool = False) -> tuple[torch.Tensor, int]:
    """Counts of (token 2, token 3) over drafted runs, and the runs that drafted. `forgetful`:
    the processor processes the root's row only (a verifier that forgets that each node
    has a context of its own)."""
    torch.set_num_threads(1)
    grammars = tiny_grammars()
    # the target's own twin drafts: its tokens are often accepted deep, where the path counts
    target, drafter_model = tiny_model(seed=0, logit_scale=0.5), tiny_model(seed=0, logit_scale=0.5)
    params = _params(constraint, grammars)
    original = Processor.scores
    if forgetful:
        def root_only(self, logits, tree):
            out = original(self, logits, tree)
            out[1:] = logits[1:]
            return out

        Processor.scores = root_only
    counts, drafted = torch.zeros(V, V), 0
    try:
        for seed in seeds:
            torch.manual_seed(seed)
            out = decoding.generate(target, PROMPT, params, ModelDrafter(drafter_model, max_len=64), 3, [EOS],
                                    grammars=grammars)
            if len(out.token_ids) >= 4 and EOS not in out.token_ids[:3]:
                counts[out.token_ids[2], out.token_ids[3]] += 1
            drafted += out.draft_tokens > 0
    finally:
        Processor.scores = original
    return counts, drafted


def _params(constraint: str, grammars) -> SamplingParams:
    extra = {"grammar": dict(grammar=grammars.compile("regex", REGEX, "regex")), "penalties": PENALTIES}[constraint]
    return SamplingParams(max_tokens=6, temperature=1.0, **extra)


def pair_jobs(constraint: str, forgetful: bool = False) -> list[tuple]:
    return [(_sampled_pairs, constraint, seeds, forgetful) for seeds in seed_shares(SAMPLES)]


def background_jobs(item) -> list[tuple]:
    """The calls this module's distribution tests make of the worker processes."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return {"test_sampling_follows_the_processed_distribution": lambda: pair_jobs(params.get("constraint")),
            "test_a_processor_that_forgets_the_nodes_is_caught": lambda: pair_jobs("penalties", True),
            }.get(item.originalname, lambda: [])()


def sampled(core_workers, constraint: str, forgetful: bool = False) -> torch.Tensor:
    counts, drafted = map(sum, zip(*core_workers.results(pair_jobs(constraint, forgetful))))
    assert drafted >= SAMPLES // 2, f"only {drafted} runs drafted"
    return counts


@pytest.mark.parametrize("constraint", ["grammar", "penalties"])
def test_sampling_follows_the_processed_distribution(core_workers, target, grammars, constraint):
    expected = exact_pair(target, _params(constraint, grammars), grammars)
    counts = sampled(core_workers, constraint)
    assert chi_square_p(counts, expected / expected.sum()) > ALPHA


def test_a_processor_that_forgets_the_nodes_is_caught(core_workers, target, grammars):
    expected = exact_pair(target, _params("penalties", grammars), grammars)
    counts = sampled(core_workers, "penalties", forgetful=True)
    assert chi_square_p(counts, expected / expected.sum()) < ALPHA
