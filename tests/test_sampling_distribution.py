"""Speculative sampling keeps the target's distribution.

On a tiny random Llama-shaped model the exact distribution of the second and
third generated tokens (the first ones a draft covers; the first token comes
from the prompt's own pass) is computable; we compare it with many runs of
the real decoding loop (chi-square), check that those runs really drafted,
and show the same test catches a verifier biased by 20% on one token.

Both ways of sampling are tested: unseeded requests (rejection sampling
against each draft's q; each run's random streams still come from its run
number, so the test repeats exactly) and seeded ones (keyed: Gumbel-max keyed
by seed and position, whose output does not depend on the drafts at all).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

import speculative.batching as batching
import speculative.decoding as decoding
import speculative.sampling as sampling
from core_workers import seed_shares
from drafter_service.drafters import (ModelDrafter, MultiSampleDrafter, PromptLookupDrafter, RecyclingDrafter,
                                      SuffixDrafter)
from runtime.model import attention_mask, causal_ancestors
from speculative.sampling import SamplingParams, probabilities
from speculative.recycling import RecycledCandidates
from speculative.suffix import SuffixIndex
from tiny import TINY, tiny_model

PROMPT = [1, 2, 3, 1, 2]  # repeats, so prompt lookup has something to propose
SAMPLES = 8_000
ALPHA = 1e-3


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_model(seed=0, logit_scale=0.5)


@pytest.fixture(scope="module")
def draft_model():
    return tiny_model(seed=1, logit_scale=0.5)


def _next_probs(target, seq: list[int], params: SamplingParams) -> torch.Tensor:
    cache = target.new_cache(len(seq))
    logits = target(torch.tensor([seq]), torch.arange(len(seq))[None], cache,
                    attention_mask(0, causal_ancestors(len(seq))), logits_from=len(seq) - 1)[0, -1]
    return probabilities(logits, params)


def exact_joint(target, params: SamplingParams) -> torch.Tensor:
    """P(first token = a, second token = b) after PROMPT under the target alone, [V, V]."""
    v = TINY.vocab_size
    first = _next_probs(target, PROMPT, params)
    return torch.stack([first[a] * _next_probs(target, PROMPT + [a], params) for a in range(v)])


def exact_drafted_joint(target, params: SamplingParams) -> torch.Tensor:
    """P(second token = b, third token = c) under the target alone, [V, V].

    The first token comes from the prompt's own pass; the second and third are
    the first positions a draft covers, so these are the ones to test."""
    v = TINY.vocab_size
    joint = torch.zeros(v, v)
    first = _next_probs(target, PROMPT, params)
    for a in range(v):
        second = _next_probs(target, PROMPT + [a], params)
        for b in range(v):
            joint[b] += first[a] * second[b] * _next_probs(target, PROMPT + [a, b], params)
    return joint


def exact_pair(target, params: SamplingParams, first: int) -> torch.Tensor:
    """P(token `first` = a, token `first` + 1 = b) under the target alone, [V, V] (token 0
    comes from the prompt's pass), by enumerating every prefix before them."""
    v = TINY.vocab_size
    joint = torch.zeros(v, v)
    prefixes = [([], torch.tensor(1.0))]
    for _ in range(first):
        prefixes = [(seq + [t], w * p[t]) for seq, w in prefixes
                    for p in [_next_probs(target, PROMPT + seq, params)] for t in range(v)]
    for seq, w in prefixes:
        pa = _next_probs(target, PROMPT + seq, params)
        for a in range(v):
            joint[a] += w * pa[a] * _next_probs(target, PROMPT + seq + [a], params)
    return joint


def _sampled_counts(case: str, seeds: range, pipelined: bool = False, first: int = 1,
                    biased_token: int | None = None, keyed: bool = False) -> tuple[torch.Tensor, int, int]:
    """Runs of CASES[case] over `seeds` (in a worker process): counts of (token `first`,
    token `first` + 1), runs whose first round drafted, pipelined runs that reused a draft
    made ahead. With `biased_token`, the verifier's probabilities (only its copies: the
    drafter keeps drawing from the true q) make that token 20% more likely. `keyed`: seeded
    requests; else unseeded ones whose random streams are those of seed `seed` all the same."""
    torch.set_num_threads(1)
    target, draft_model = tiny_model(seed=0, logit_scale=0.5), tiny_model(seed=1, logit_scale=0.5)
    make, params, k = CASES[case]
    draft_length, tree_budget = k if isinstance(k, tuple) else (k, None)
    originals = sampling.probabilities, batching.probabilities, decoding.make_generator
    run = {"seed": 0}
    decoding.make_generator = lambda _, device="cpu", stream=0: sampling.make_generator(run["seed"], device, stream)
    if biased_token is not None:
        def biased_probabilities(logits, params):
            p = probabilities(logits, params).clone()
            p[..., biased_token] *= 1.20
            return p / p.sum(-1, keepdim=True)

        sampling.probabilities = batching.probabilities = biased_probabilities  # first_token's, verify_batch's
    v = TINY.vocab_size
    counts = torch.zeros(v, v)
    drafted = reused = 0
    # room for a whole draft in the first round after the prompt's token (and, pipelined, one ahead of it)
    max_tokens = draft_length + 2 if not pipelined else 2 * draft_length + 3
    try:
        for seed in seeds:
            run["seed"] = seed
            p = SamplingParams(max_tokens=max_tokens, temperature=params.temperature, top_p=params.top_p,
                               top_k=params.top_k, seed=seed if keyed else None)
            assert p.keyed == keyed
            result = decoding.generate(target, PROMPT, p, make(draft_model), draft_length, pipelined=pipelined,
                                       tree_budget=tree_budget)
            counts[result.token_ids[first], result.token_ids[first + 1]] += 1
            drafted += result.draft_tokens > 0
            reused += result.reused_drafts > 0
    finally:
        # the worker serves other tests next
        sampling.probabilities, batching.probabilities, decoding.make_generator = originals
    return counts, drafted, reused


def sampled_jobs(case: str, pipelined: bool = False, first: int = 1, biased_token: int | None = None,
                 keyed: bool = False) -> list[tuple]:
    """SAMPLES runs of CASES[case] (each draws from its own seed), as calls for the worker
    processes: one share of the seeds each."""
    return [(_sampled_counts, case, seeds, pipelined, first, biased_token, keyed) for seeds in seed_shares(SAMPLES)]


def sampled_joint(workers, case: str, pipelined: bool = False, first: int = 1, biased_token: int | None = None,
                  keyed: bool = False) -> torch.Tensor:
    """The counts of `sampled_jobs`' runs, split over the worker processes. A drafter that
    learns across runs (the suffix index, the recycling table) learns in each worker from
    that worker's runs."""
    counts, drafted, reused = map(sum, zip(*workers.results(sampled_jobs(case, pipelined, first, biased_token, keyed))))
    # prompt lookup drafts only after a match; the others always do
    assert drafted >= SAMPLES // 5, f"only {drafted} of {SAMPLES} runs drafted: speculation was barely tested"
    if pipelined:
        assert reused >= SAMPLES // 20, f"only {reused} of {SAMPLES} runs reused a draft made ahead"
    return counts


def chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of counts against expected probabilities, pooling cells expected < 5."""
    counts, expected = counts.flatten().double(), expected_probs.flatten().double() * counts.sum()
    big = expected >= 5
    obs = torch.cat((counts[big], counts[~big].sum().view(1)))
    exp = torch.cat((expected[big], expected[~big].sum().view(1)))
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


# The runs below. "chain" (a 2-token model draft at temperature 1) is the pipelined and
# biased-verifier tests' setup; the parametrized test covers the others.
CASES = {
    "chain": (lambda d: ModelDrafter(d, max_len=64), SamplingParams(temperature=1.0), 2),
    "chain_topk_topp": (lambda d: ModelDrafter(d, max_len=64), SamplingParams(temperature=0.8, top_k=5, top_p=0.9), 2),
    "chain_sparse_q": (lambda d: ModelDrafter(d, max_len=64, draft_top_k=3), SamplingParams(temperature=1.0), 2),
    "tree": (lambda d: MultiSampleDrafter(ModelDrafter(d, max_len=64), branches=3), SamplingParams(temperature=1.0), 2),
    # a model drafter given a tree budget draws 3 chains together, level by level
    "sampled_tree": (lambda d: ModelDrafter(d, max_len=64), SamplingParams(temperature=1.0), (2, 6)),
    # one index across all runs: earlier outputs make its deterministic trees branch
    "suffix_tree": (lambda d, index=SuffixIndex(depth=4, max_draft=4): SuffixDrafter(index, TINY.vocab_size),
                    SamplingParams(temperature=1.0), 3),
    "prompt_lookup": (lambda d: PromptLookupDrafter(TINY.vocab_size), SamplingParams(temperature=1.0), 2),
    # one table across all runs (Token Recycling): the target's top-3 after each token it scored
    "recycled_tree": (lambda d, table=RecycledCandidates(TINY.vocab_size, k=3): RecyclingDrafter(table),
                      SamplingParams(temperature=1.0), (2, 4)),
    # a small drafter with a trimmed vocabulary: 5 of the target's 8 tokens, plus its "other" row
    "trimmed_vocab": (lambda d, m=tiny_model(seed=2, logit_scale=0.5, vocab_size=6): ModelDrafter(
        m, max_len=64, draft_top_k=4, vocab_ids=[0, 2, 3, 5, 7], target_vocab_size=TINY.vocab_size),
        SamplingParams(temperature=1.0), 3),
}


def background_jobs(item) -> list[tuple]:
    """The calls this module's distribution tests make of the worker processes."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return {
        "test_speculative_sampling_matches_target_distribution": lambda: sampled_jobs(params.get("case")),
        "test_pipelined_sampling_matches_target_distribution": lambda: sampled_jobs("chain", pipelined=True, first=3),
        "test_keyed_sampling_matches_target_distribution": lambda: sampled_jobs("chain_topk_topp", keyed=True),
        "test_biased_verifier_is_caught": lambda: sampled_jobs("chain", biased_token=most_likely_second_token(),
                                                               keyed=params.get("keyed")),
    }.get(item.originalname, list)()


@pytest.mark.parametrize("case", [case for case in CASES if case != "chain"])
def test_speculative_sampling_matches_target_distribution(target, core_workers, case):
    _, params, _ = CASES[case]
    expected = exact_drafted_joint(target, params)
    counts = sampled_joint(core_workers, case)
    pvalue = chi_square_p(counts, expected)
    assert pvalue > ALPHA, f"{case}: sampled distribution differs from the target's (p={pvalue:.2e})"


def test_pipelined_sampling_matches_target_distribution(target, core_workers):
    """Pipelined (post-verify): a 2-token draft, and a 2-token draft of the round after
    drafted ahead of the verdict; when the verdict keeps it, its second token covers token 4.
    Tokens 3 (the bonus that decides the reuse) and 4 are tested; sampled_joint checks that
    enough runs reused a draft made ahead."""
    expected = exact_pair(target, CASES["chain"][1], first=3)
    counts = sampled_joint(core_workers, "chain", pipelined=True, first=3)
    pvalue = chi_square_p(counts, expected)
    assert pvalue > ALPHA, f"pipelined: sampled distribution differs from the target's (p={pvalue:.2e})"


def test_keyed_sampling_matches_target_distribution(target, core_workers):
    """Seeded requests: over seeds, the keyed choices follow the target's distribution."""
    expected = exact_drafted_joint(target, CASES["chain_topk_topp"][1])
    counts = sampled_joint(core_workers, "chain_topk_topp", keyed=True)
    pvalue = chi_square_p(counts, expected)
    assert pvalue > ALPHA, f"keyed: sampled distribution differs from the target's (p={pvalue:.2e})"


def most_likely_second_token() -> int:
    """The target's most likely second token after PROMPT (the biased verifier's)."""
    return int(exact_drafted_joint(tiny_model(seed=0, logit_scale=0.5), CASES["chain"][1]).sum(1).argmax())


@pytest.mark.parametrize("keyed", [False, True], ids=["rejection", "keyed"])
def test_biased_verifier_is_caught(target, core_workers, keyed):
    """A verifier that works against the target distribution with its most likely
    second token made 20% more likely: the same statistics must reject it, or the
    tests above prove nothing."""
    expected = exact_drafted_joint(target, CASES["chain"][1])
    counts = sampled_joint(core_workers, "chain", biased_token=most_likely_second_token(), keyed=keyed)
    pvalue = chi_square_p(counts, expected)
    assert pvalue < ALPHA, f"biased verifier not detected (p={pvalue:.3g})"
    print(f"biased verifier: p={pvalue:.3g}")


@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
def test_seeded_output_does_not_depend_on_the_drafter(target, draft_model, pipelined):
    """Keyed sampling: every drafter, tree or chain, gives plain decoding's tokens for the
    same seed (the drafts change only how many passes they take)."""
    for seed in range(20):
        params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=seed)
        plain = decoding.generate(target, PROMPT, params, None, 0).token_ids
        for case, (make, _, k) in CASES.items():
            draft_length, tree_budget = k if isinstance(k, tuple) else (k, None)
            got = decoding.generate(target, PROMPT, params, make(draft_model), draft_length,
                                    pipelined=pipelined, tree_budget=tree_budget)
            assert got.token_ids == plain, f"{case}, seed {seed}: {got.token_ids} != {plain}"
    # a drafter that is the target itself guesses every keyed choice
    result = decoding.generate(target, PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=5),
                               ModelDrafter(target, max_len=64), 3)
    assert result.acceptance_rate == 1.0


def test_seeded_sampling_is_reproducible(target, draft_model):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    runs = [decoding.generate(target, PROMPT, params, ModelDrafter(draft_model, max_len=64), 3).token_ids
            for _ in range(2)]
    assert runs[0] == runs[1]
    other = decoding.generate(target, PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=99),
                              ModelDrafter(draft_model, max_len=64), 3).token_ids
    assert other != runs[0], "different seeds gave the same 12 tokens"
