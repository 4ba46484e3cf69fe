"""A sampled request that is prefilled again keeps the target's distribution.

When a verifier or a drafter pool loses a request (restart, eviction, a
checkpoint a round behind), the coordinator prefills it again with every
verified token and goes on. Served over real gRPC on loopback (tiny models, no
Ray), a verifier or a pool that forgets every request after each call makes
every round a resume; the joint distribution of two tokens drawn after
different prefills is compared (chi-square) with the target's exact one, over
many seeds.

The requests are seeded, so each token is the choice keyed by (seed, position)
(`SamplingParams.keyed`): a resume cannot reuse the draws that chose earlier
tokens, and these tests check that this holds end to end. That the random
streams a resumed request's services make are fresh, not started over, is
checked on its own (`test_a_resumed_stream_is_fresh_and_a_first_one_unchanged`):
with keyed tokens the distribution tests would not see a restarted stream.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from core_workers import seed_shares
from drafter_service.pool import DrafterPool
from loopback import loopback
from router.coordinator import Job
from router.stats import RoundStats
from runtime.model import attention_mask, causal_ancestors
from speculative.sampling import SamplingParams, make_generator, probabilities
from tiny import TINY, tiny_model
from verifier_service.engine import VerifierEngine

V = TINY.vocab_size
PROMPT = [1, 2, 3, 1, 2]
RUNS = 1_500
ALPHA = 1e-3
PARAMS = SamplingParams(temperature=1.0)


class ForgetfulEngine(VerifierEngine):
    """Loses each request right after its prefill answers: every verify finds it gone
    (no checkpoint store), so each round is a prefill again."""

    def _prefill(self, work):
        outcome = super()._prefill(work)
        self._drop(work.request_id)
        return outcome


class ForgetfulPool(DrafterPool):
    """Loses each request right after it drafts: every round prefills the drafter again."""

    def propose(self, request_id, *args, **kwargs):
        tree = super().propose(request_id, *args, **kwargs)
        self.release(request_id)
        return tree


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_model(seed=0, logit_scale=0.5)


def exact_pair(target, i: int, j: int) -> torch.Tensor:
    """P(generated token i = a, generated token j = b) under the target alone, [V, V]."""
    memo: dict[tuple[int, ...], torch.Tensor] = {}

    def next_probs(seq: tuple[int, ...]) -> torch.Tensor:
        if seq not in memo:
            ids = PROMPT + list(seq)
            cache = target.new_cache(len(ids))
            logits = target(torch.tensor([ids]), torch.arange(len(ids))[None], cache,
                            attention_mask(0, causal_ancestors(len(ids))), logits_from=len(ids) - 1)[0, -1]
            memo[seq] = probabilities(logits, PARAMS)
        return memo[seq]

    joint = torch.zeros(V, V)
    with torch.inference_mode():
        for seq in itertools.product(range(V), repeat=j + 1):
            weight = torch.tensor(1.0)
            for n in range(j + 1):
                weight = weight * next_probs(seq[:n])[seq[n]]
            joint[seq[i], seq[j]] += weight
    return joint


def _sampled_pairs_part(forgetful: str, drafter: str, draft_length: int, i: int, j: int,
                        verifier_drafting: bool, seeds: range) -> torch.Tensor:
    """Counts of (generated token i, token j) over `seeds`, in a worker process: the tiny
    target behind loopback gRPC, the verifier or the pool (`forgetful`) losing every request
    after each call."""
    torch.set_num_threads(1)
    target = tiny_model(seed=0, logit_scale=0.5)
    if forgetful == "verifier":
        pool, engine = DrafterPool(target, kinds=["pld"]), ForgetfulEngine(target, max_batch=2, max_len=32)
    else:
        pool, engine = ForgetfulPool(target, kinds=[drafter]), VerifierEngine(target, max_batch=2, max_len=32)
    counts = torch.zeros(V, V)
    with loopback(pool, engine) as coordinator:
        for seed in seeds:
            # one token past j: a round drafts only where a whole draft and its bonus fit
            params = SamplingParams(max_tokens=j + 2, temperature=PARAMS.temperature, seed=seed)
            job = Job(f"r{seed}", PROMPT, params, ((drafter, 1.0),), draft_length, draft_length, V,
                      eos_token_ids=(), verifier_drafting=verifier_drafting)
            tokens = [t for new in coordinator.run(job, RoundStats()) for t in new]
            counts[tokens[i], tokens[j]] += 1
    return counts


def sampled_jobs(forgetful: str, drafter: str, draft_length: int, i: int, j: int,
                 verifier_drafting: bool = False) -> list[tuple]:
    """RUNS seeded requests (each seed is a request of its own), as calls for the worker
    processes: one share of the seeds each."""
    return [(_sampled_pairs_part, forgetful, drafter, draft_length, i, j, verifier_drafting, seeds)
            for seeds in seed_shares(RUNS)]


# each test's runs: (forgetful, drafter, draft length, i, j); the verifier's test adds verifier_drafting
VERIFIER_RUNS = ("verifier", "none", 0, 0, 1)
DRAFTER_RUNS = ("drafter", "layerskip", 1, 1, 3)


def background_jobs(item) -> list[tuple]:
    """The calls this module's tests make of the worker processes."""
    if item.originalname == "test_verifier_prefilled_again_every_round_keeps_the_distribution":
        return sampled_jobs(*VERIFIER_RUNS, item.callspec.params["verifier_drafting"])
    if item.originalname == "test_drafter_prefilled_again_every_round_keeps_the_distribution":
        return sampled_jobs(*DRAFTER_RUNS)
    return []


def sampled_pairs(workers, *runs) -> torch.Tensor:
    """The counts of `sampled_jobs(*runs)`, split over the worker processes."""
    return sum(workers.results(sampled_jobs(*runs)))


def assert_matches(counts: torch.Tensor, exact: torch.Tensor) -> None:
    expected = exact.flatten() * counts.sum()
    big = expected >= 5  # chi-square needs expected counts of 5 or more: pool the rest into one cell
    observed = torch.cat([counts.flatten()[big], counts.flatten()[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    p_value = chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue
    assert p_value > ALPHA, f"sampled pairs differ from the target's (p = {p_value:.2e})"


@pytest.mark.parametrize("verifier_drafting", [False, True], ids=["verify-calls", "decode-call"])
def test_verifier_prefilled_again_every_round_keeps_the_distribution(target, core_workers, verifier_drafting):
    # plain decoding: token 0 comes from the first prefill, token 1 from the second (a Decode
    # call finds the request gone, and the router prefills it again)
    counts = sampled_pairs(core_workers, *VERIFIER_RUNS, verifier_drafting)
    assert_matches(counts, exact_pair(target, 0, 1))


def test_drafter_prefilled_again_every_round_keeps_the_distribution(target, core_workers):
    # the drafter is the target itself, so its one-token drafts are always accepted:
    # token 1 is the first pool's draw, token 3 the second pool's (tokens 2 and 4 are the verifier's)
    counts = sampled_pairs(core_workers, *DRAFTER_RUNS)
    assert_matches(counts, exact_pair(target, 1, 3))


def test_a_resumed_stream_is_fresh_and_a_first_one_unchanged():
    first = make_generator(7, stream=1)
    assert torch.equal(torch.rand(4, generator=first), torch.rand(4, generator=make_generator(7, stream=1, resumed=0)))
    draws = {tuple(torch.rand(4, generator=make_generator(7, stream=s, resumed=r)).tolist())
             for s in (0, 1, 2) for r in (0, 1, 2)}
    assert len(draws) == 9
