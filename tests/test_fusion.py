"""Confidence fusion of several drafters' proposals into one token tree.

Structure: shared prefixes merge, the budget holds, parents are kept, greedy
keeps the best nodes, and the sampled interleaving and cut read no draw's own
token. Losslessness, three ways: the exact output distribution of fused
sampled trees, enumerated over every draw on a 3-token vocabulary (with
controls showing the same computation catches value-ordered draws, pruning
by confidence, and drafters sharing a random stream); a chi-square test of
fused sampling with tiny models through the real verifier; and fused greedy
decoding equal to the target's own.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import speculative.decoding as decoding
from core_workers import seed_shares
from drafter_service.drafters import ModelDrafter, MultiSampleDrafter, PromptLookupDrafter
from speculative.fused_drafter import FusedDrafter
from speculative.batching import VerifyItem, verify_batch
from speculative.decoding import DraftRequest
from speculative.fusion import draw_order, fuse
from runtime.model import attention_mask, causal_ancestors
from speculative.sampling import SamplingParams, make_generator, sample
from speculative.tree import DraftTree
from speculative.verification import residual
from test_sampling_distribution import ALPHA, PROMPT, chi_square_p, exact_joint, target  # noqa: F401 (fixture)
from tiny import TINY, tiny_model
from trees import path_to


def one_hot(tokens, v=8):
    return torch.eye(v, dtype=torch.float64)[list(tokens)]


def tree_of(chains, confidence=None, v=8):
    """A proposal made of chains (each a token list) drawn one after another, with one-hot q."""
    tree = DraftTree()
    for i, chain in enumerate(chains):
        tree.add_chain(chain, one_hot(chain, v), confidence=None if confidence is None else confidence[i])
    return tree


def paths(tree):
    """Each node's token path from the root."""
    return [tuple(tree.tokens[n] for n in path_to(tree, node)) for node in range(len(tree))]


# ---- structure -------------------------------------------------------------------------------

def test_tree_confidence_follows_chains_and_cuts():
    tree = DraftTree.chain([5, 6], confidence=[0.5, 0.25])
    tree.add_chain([5, 7], confidence=[0.75, 0.5])
    assert tree.confidence == [0.75, 0.25, 0.5]  # the merged node keeps the highest
    assert tree.truncated(2).confidence == [0.75, 0.25]
    assert DraftTree(tree.tokens, tree.parents, confidence=tree.confidence).truncated(1).confidence == [0.75]
    with pytest.raises(ValueError, match="confidence"):
        tree.add_chain([9])
    assert DraftTree.chain([1, 2]).confidence is None


def test_truncation_keeps_no_draw_because_it_merged():
    """Two equal chains fill a budget of 2 with the first; the second's draws
    would fit only because they merged, so they go (keeping them biased
    multi-draft sampling; see test_truncated_multi_chain_tree_is_exact)."""
    tree = tree_of([[5, 6], [5, 6]])
    cut = tree.truncated(2)
    assert cut.tokens == [5, 6] and cut.draw_nodes == [0, 1] and len(cut.draw_q) == 2
    assert tree.truncated(3) is tree


@pytest.mark.parametrize("greedy", [True, False])
def test_shared_prefixes_become_one_node(greedy):
    a, b = tree_of([[1, 2, 3]]), tree_of([[1, 2, 4]])
    fused = fuse([(a, 0.9), (b, 0.8)], 10, greedy)
    assert sorted(paths(fused)) == [(1,), (1, 2), (1, 2, 3), (1, 2, 4)]
    if not greedy:  # both drafters' draws land on the shared nodes
        assert sorted(paths(fused)[n] for n in fused.draw_nodes) == [(1,), (1,), (1, 2), (1, 2), (1, 2, 3), (1, 2, 4)]


def random_proposals(rng: random.Random, v=4, confident=True):
    """2-3 proposals of 1-2 chains each over a small vocabulary (so they merge often)."""
    proposals = []
    for _ in range(rng.randint(2, 3)):
        chains = [[rng.randrange(v) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 2))]
        conf = [[rng.random() for _ in chain] for chain in chains] if confident and rng.random() < 0.7 else None
        proposals.append((tree_of(chains, conf, v), round(rng.random(), 2)))
    return proposals


def reference_scores(proposals, default=1.0):
    """Path -> product along it of each step's noisy-OR, 1 - prod(1 - confidence x
    reliability), over the proposals that hold the step's path."""
    miss = {}
    for tree, r in proposals:
        conf = tree.confidence or [default] * len(tree)
        for node, path in enumerate(paths(tree)):
            miss[path] = miss.get(path, 1.0) * (1.0 - conf[node] * r)
    return {path: math.prod(1.0 - miss[path[:i]] for i in range(1, len(path) + 1)) for path in miss}


@pytest.mark.parametrize("greedy", [True, False])
def test_fused_trees_respect_the_budget_and_keep_parents(greedy):
    rng = random.Random(0)
    for _ in range(300):
        proposals, budget = random_proposals(rng), rng.randint(0, 8)
        fused = fuse(proposals, budget, greedy)
        assert len(fused) <= budget and all(-1 <= p < i for i, p in enumerate(fused.parents))
        assert len(set(paths(fused))) == len(fused)  # merged: no path twice
        known = reference_scores(proposals)
        assert set(paths(fused)) <= set(known)
        if greedy:
            assert len(fused) == min(budget, len(known)) and fused.draw_q is None
        else:
            assert len(fused.draw_q) == len(fused.draw_nodes) and set(fused.draw_nodes) == set(range(len(fused)))


def test_greedy_keeps_the_best_nodes_and_their_scores():
    rng = random.Random(1)
    for _ in range(300):
        proposals, budget = random_proposals(rng), rng.randint(1, 8)
        fused = fuse(proposals, budget, greedy=True)
        best = reference_scores(proposals)
        kept = set(paths(fused))
        frontier = [s for path, s in best.items() if path not in kept and (len(path) == 1 or path[:-1] in kept)]
        assert min(best[p] for p in kept) >= max(frontier, default=0.0) - 1e-12
        for node, path in enumerate(paths(fused)):  # confidence along a path multiplies back to its score
            assert math.prod(fused.confidence[n] for n in path_to(fused, node)) == pytest.approx(best[path], abs=1e-12)


def test_drafters_that_agree_outrank_one_more_confident_drafter():
    a, b = tree_of([[1, 5]], confidence=[[0.6, 0.5]]), tree_of([[1, 6]], confidence=[[0.6, 0.5]])
    c = tree_of([[2]], confidence=[[0.8]])
    fused = fuse([(c, 1.0), (a, 1.0), (b, 1.0)], 1, greedy=True)
    assert fused.tokens == [1] and fused.confidence == pytest.approx([1 - 0.4 * 0.4])  # 0.84 > 0.8
    assert fuse([(c, 1.0), (a, 1.0)], 1, greedy=True).tokens == [2]  # alone, 0.6 < 0.8


def test_missing_confidence_counts_as_the_default():
    lookup = tree_of([[3]])  # no confidence: prompt lookup
    model = tree_of([[4]], confidence=[[0.9]])
    assert fuse([(lookup, 0.6), (model, 0.6)], 1, greedy=True).tokens == [3]  # 1.0 x 0.6 > 0.9 x 0.6
    assert fuse([(lookup, 0.6), (model, 0.6)], 1, greedy=True, default_confidence=0.5).tokens == [4]
    assert fuse([(lookup, 0.6), (model, 0.6)], 2, greedy=True).confidence == pytest.approx([0.6, 0.54])


def test_fusion_refuses_bad_input():
    with pytest.raises(ValueError, match="reliability"):
        fuse([(tree_of([[1]]), 1.5)], 4, greedy=True)
    with pytest.raises(ValueError, match="q per draw"):
        fuse([(DraftTree.chain([1, 2]), 0.5)], 4, greedy=False)


def test_sampled_fusion_keeps_each_drafters_draws_in_order_with_their_q():
    rng = random.Random(2)
    for _ in range(100):
        proposals = random_proposals(rng)
        for tree, _ in proposals:  # a distinct q row per draw tells the draws apart
            tree.draw_q = torch.softmax(torch.randn(len(tree.draw_nodes), 4, dtype=torch.float64), -1)
        fused = fuse(proposals, 100, greedy=False)
        assert len(fused.draw_nodes) == sum(len(t.draw_nodes) for t, _ in proposals)
        source = {tuple(q.tolist()): (tree, d) for tree, _ in proposals for d, q in enumerate(tree.draw_q)}
        seen = {}
        for d, node in enumerate(fused.draw_nodes):
            tree, original = source[tuple(fused.draw_q[d].tolist())]
            assert paths(fused)[node] == paths(tree)[tree.draw_nodes[original]]
            assert seen.get(id(tree), -1) < original  # each drafter's own order
            seen[id(tree)] = original


def test_sampled_cut_reads_no_draw_or_later_draw():
    """The interleaving reads no token at all, and whether the draw at fused
    position t is kept does not change when draw t and every later draw
    change their tokens (earlier draws may decide it, through merges)."""
    rng = random.Random(3)
    for _ in range(300):
        shapes = [([rng.randint(1, 4) for _ in range(rng.randint(1, 2))], round(rng.random(), 2))
                  for _ in range(rng.randint(2, 3))]  # per proposal: its chains' lengths, its reliability

        def proposals(tokens):  # tokens[p]: proposal p's drawn tokens, in its draw order
            return [(tree_of(split(ts, lengths), v=3), r) for ts, (lengths, r) in zip(tokens, shapes)]

        def fused_order(tokens):  # (proposal, draw) in fused order
            ranked = sorted(range(len(shapes)), key=lambda p: -shapes[p][1])
            return [(ranked[p], d) for p, d in draw_order([proposals(tokens)[p] for p in ranked])]

        tokens = [[rng.randrange(3) for _ in range(sum(lengths))] for lengths, _ in shapes]
        order = fused_order(tokens)
        budget, t = rng.randint(1, 8), rng.randrange(len(order))
        changed = [list(ts) for ts in tokens]
        for p, d in order[t:]:
            changed[p][d] = rng.randrange(3)
        assert fused_order(changed) == order
        kept = [len(fuse(proposals(ts), budget, greedy=False).draw_nodes) for ts in (tokens, changed)]
        assert min(kept[0], t + 1) == min(kept[1], t + 1)


def split(flat, lengths):
    out, start = [], 0
    for n in lengths:
        out.append(flat[start:start + n])
        start += n
    return out


# ---- exact losslessness on a 3-token vocabulary ----------------------------------------------

V = 3


def dist(seed: int, prefix: tuple[int, ...]) -> torch.Tensor:
    """A fixed random distribution over V tokens for each (model, context)."""
    code = sum((t + 1) * (V + 1) ** i for i, t in enumerate(prefix))
    x = torch.rand(V, generator=torch.Generator().manual_seed(seed * 10_007 + code), dtype=torch.float64)
    return (x + 0.05) / (x + 0.05).sum()


def target_p(prefix):
    return dist(0, prefix)


def chains_drafter(seed: int, n_chains: int, length: int):
    """Every outcome (tree, probability) of n i.i.d. chains drawn from model `seed`."""
    outcomes = []
    for flat in itertools.product(range(V), repeat=n_chains * length):
        chains = [flat[c * length:(c + 1) * length] for c in range(n_chains)]
        tree, prob = DraftTree(), 1.0
        for chain in chains:
            qs = [dist(seed, chain[:i]) for i in range(length)]
            prob *= float(torch.tensor([q[t] for q, t in zip(qs, chain)]).prod())
            tree.add_chain(chain, torch.stack(qs), confidence=[float(q[t]) for q, t in zip(qs, chain)])
        outcomes.append((tree, prob))
    return outcomes


def stopping_drafter(seed: int, length: int, floor: float):
    """One chain that stops after drawing a token its q gave less than `floor` (SpecDec++-like)."""
    outcomes = []

    def grow(chain, qs, prob):
        if len(chain) == length or (chain and qs[-1][chain[-1]] < floor):
            outcomes.append((DraftTree.chain(chain, torch.stack(qs)) if chain else DraftTree(), prob))
            return
        q = dist(seed, tuple(chain))
        for t in range(V):
            grow(chain + [t], qs + [q], prob * float(q[t]))

    grow([], [], 1.0)
    return outcomes


def lookup_drafter(tokens):
    """Deterministic (prompt lookup): its one outcome, one-hot q, no confidence."""
    return [(DraftTree.chain(tokens, one_hot(tokens, V)), 1.0)]


def first_two_exact(tree: DraftTree) -> torch.Tensor:
    """[V, V] P(first two tokens) after one round of `verify_sampling` on `tree`
    (the target's own sampling supplies the second when the round gives one)."""
    joint = torch.zeros(V, V, dtype=torch.float64)

    def walk(node, path, weight):
        if len(path) == 2:
            joint[path] += weight
            return
        r, stay = target_p(path), weight
        for d, landed in enumerate(tree.draw_nodes):
            if tree.parents[landed] != node:
                continue
            q, tok = tree.draw_q[d], tree.tokens[landed]
            accept = min(1.0, float(r[tok] / q[tok]))
            if stay * accept > 0:
                walk(landed, path + (tok,), stay * accept)
            stay *= 1 - accept
            r = residual(r, q)
        for tok in range(V):  # the bonus token, then the target's next if need be
            if not path:
                joint[tok] += stay * r[tok] * target_p((tok,))
            else:
                joint[path + (tok,)] += stay * r[tok]

    walk(-1, (), 1.0)
    return joint


def target_first_two() -> torch.Tensor:
    return torch.stack([target_p(())[a] * target_p((a,)) for a in range(V)])


def fused_error(drafters, reliabilities, budget, transform=lambda tree: tree) -> float:
    """Largest gap between the exact distribution of fused verification and the target's."""
    joint = torch.zeros(V, V, dtype=torch.float64)
    for outcome in itertools.product(*drafters):
        prob = 1.0
        for _, p in outcome:
            prob *= p
        tree = transform(fuse([(tree, r) for (tree, _), r in zip(outcome, reliabilities)], budget, greedy=False))
        joint += prob * first_two_exact(tree)
    return float((joint - target_first_two()).abs().max())


DRAFTERS = {
    "model_x2_and_model": ([chains_drafter(1, 2, 2), chains_drafter(2, 1, 2)], [0.6, 0.8]),
    "model_stopping_lookup": ([chains_drafter(1, 1, 3), stopping_drafter(2, 2, 0.3), lookup_drafter([0, 2])],
                              [0.5, 0.7, 0.9]),
}


@pytest.mark.parametrize("case", list(DRAFTERS))
@pytest.mark.parametrize("budget", [1, 2, 3, 4, 6])
def test_fused_sampling_is_exact(case, budget):
    drafters, reliabilities = DRAFTERS[case]
    assert fused_error(drafters, reliabilities, budget) < 1e-12


@pytest.mark.parametrize("budget", [2, 3, 4])
def test_truncated_multi_chain_tree_is_exact(budget):
    """One drafter of three i.i.d. chains cut by `truncated`: before the cut
    stopped keeping draws that merged into a full tree, this was off by ~1e-3."""
    assert fused_error([chains_drafter(1, 3, 2)], [1.0], budget) < 1e-12


def drop_unlikely(tree: DraftTree, floor: float = 0.3) -> DraftTree:
    """Draws (and what lies below them) dropped for drawing a token their q gave < floor."""
    dropped, draws = set(), []
    for d, node in enumerate(tree.draw_nodes):
        if tree.parents[node] in dropped or tree.draw_q[d][tree.tokens[node]] < floor:
            dropped.add(node)
        else:
            draws.append(d)
    return DraftTree(tree.tokens, tree.parents, [tree.draw_nodes[d] for d in draws], tree.draw_q[draws])


def likeliest_first(tree: DraftTree) -> DraftTree:
    """Each node's draws tested in order of the probability their q gave their token."""
    def key(d):
        node = tree.draw_nodes[d]
        return tree.depths[node], -float(tree.draw_q[d][tree.tokens[node]])

    order = sorted(range(len(tree.draw_nodes)), key=key)
    return DraftTree(tree.tokens, tree.parents, [tree.draw_nodes[d] for d in order], tree.draw_q[order])


@pytest.mark.parametrize("transform", [likeliest_first, drop_unlikely])
def test_exactness_check_catches_draws_ranked_by_value(transform):
    """The same computation, on fused trees whose draws are tested most-likely
    first or dropped for an unlikely token, must see the bias."""
    drafters, reliabilities = DRAFTERS["model_x2_and_model"]
    assert fused_error(drafters, reliabilities, 8, transform) > 1e-4


def test_drafters_sharing_a_random_stream_break_exactness():
    """Two one-token drafters whose draws come from one shared uniform (inverse
    CDF): verified as a fused tree, they are biased; drawn independently, exact.
    So each fused drafter needs its own random stream."""
    qa, qb = dist(1, ()), dist(2, ())
    edges_a, edges_b = torch.cat((torch.zeros(1), qa.cumsum(0))), torch.cat((torch.zeros(1), qb.cumsum(0)))
    errors = {}
    for coupling in ("shared", "independent"):
        joint = torch.zeros(V, V, dtype=torch.float64)
        for a, b in itertools.product(range(V), repeat=2):
            if coupling == "shared":  # P(u falls in both a's and b's interval)
                overlap = torch.minimum(edges_a[a + 1], edges_b[b + 1]) - torch.maximum(edges_a[a], edges_b[b])
                prob = float(overlap.clamp_min(0))
            else:
                prob = float(qa[a] * qb[b])
            proposals = [(DraftTree.chain([a], qa[None]), 0.9), (DraftTree.chain([b], qb[None]), 0.8)]
            joint += prob * first_two_exact(fuse(proposals, 2, greedy=False))
        errors[coupling] = float((joint - target_first_two()).abs().max())
    assert errors["independent"] < 1e-12 and errors["shared"] > 1e-4, errors


# ---- tiny models through the real verifier ---------------------------------------------------

def make_members():
    return [(MultiSampleDrafter(ModelDrafter(tiny_model(seed=1, logit_scale=0.5), max_len=64), branches=2), 0.7),
            (ModelDrafter(tiny_model(seed=2, logit_scale=0.5), max_len=64), 0.5),
            (PromptLookupDrafter(TINY.vocab_size), 0.6)]


@pytest.fixture(scope="module")
def members():
    return make_members()


SAMPLES = 12_000
BUDGET = 4  # nodes per fused tree, from 8 draws: each drafter drafts 2 tokens (the ones the test sees)


def fused_jobs(params) -> list[tuple]:
    """SAMPLES runs of `_fused_first_two` (each draws from its own seed), as calls for the
    worker processes: one share of the seeds each."""
    return [(_fused_first_two, seeds, params) for seeds in seed_shares(SAMPLES)]


def background_jobs(item) -> list[tuple]:
    """The calls this module's tests make of the worker processes."""
    if item.originalname == "test_fused_sampling_matches_target_distribution":
        return fused_jobs(SamplingParams(temperature=1.0))
    return []


def first_two_sampled(workers, params) -> torch.Tensor:
    """Counts of the first two tokens after PROMPT over SAMPLES runs: one round of fused
    drafting verified by `verify_batch` (the target's next token after a lone bonus), split
    over the worker processes."""
    counts, drafted = map(sum, zip(*workers.results(fused_jobs(params))))
    assert drafted > 3 * SAMPLES, "the fused trees were mostly empty: nothing was tested"
    return counts


def _fused_first_two(seeds: range, params) -> tuple[torch.Tensor, int]:
    """`first_two_sampled`'s runs of `seeds` (in a worker process): the `target` fixture's
    model, a FusedDrafter of the `members` fixture's drafters."""
    torch.set_num_threads(1)
    target, drafter = tiny_model(seed=0, logit_scale=0.5), FusedDrafter(make_members(), member_tokens=2)
    expected = exact_joint(target, params)
    conditional = expected / expected.sum(1, keepdim=True)  # the target's second token after the first
    cache = target.new_cache(len(PROMPT) + BUDGET + 1)
    n = len(PROMPT) - 1
    target(torch.tensor([PROMPT[:-1]]), torch.arange(n)[None], cache, attention_mask(0, causal_ancestors(n)))
    counts = torch.zeros(TINY.vocab_size, TINY.vocab_size)
    drafted = 0
    for seed in seeds:
        verifier_rng = make_generator(seed, stream=0)
        cache.rollback(n)
        tree = drafter.propose(DraftRequest(PROMPT, BUDGET, params, make_generator(seed, stream=1)))
        drafted += len(tree)
        [verdict] = verify_batch(target, cache, [VerifyItem(0, PROMPT[-1], tree, params, verifier_rng)])
        path, bonus = verdict.path, verdict.bonus
        out = [tree.tokens[node] for node in path] + [bonus]
        if len(out) == 1:
            out.append(sample(conditional[out[0]], verifier_rng))
        counts[out[0], out[1]] += 1
    return counts, drafted


def test_fused_sampling_matches_target_distribution(target, core_workers):
    params = SamplingParams(temperature=1.0)
    expected = exact_joint(target, params)
    counts = first_two_sampled(core_workers, params)
    pvalue = chi_square_p(counts, expected)
    print(f"fused sampling: p={pvalue:.3g}")
    assert pvalue > ALPHA, f"fused sampling differs from the target's distribution (p={pvalue:.2e})"
    # power: the same counts must reject the target with its likeliest first token 20% more
    # likely (at 64 cells a 10% bias needs ~35k samples; the exact tests above are the sharp check)
    biased = expected.clone()
    biased[int(expected.sum(1).argmax())] *= 1.20
    biased_p = chi_square_p(counts, biased / biased.sum())
    print(f"against a 20% bias: p={biased_p:.3g}")
    assert biased_p < ALPHA, f"a 20% bias would go unnoticed at {SAMPLES} samples (p={biased_p:.3g})"


@pytest.mark.parametrize("prompt", [[1, 2, 3, 1, 2], [5, 6, 7, 5], [0, 3, 3, 3, 3]])
def test_fused_greedy_equals_target_greedy(target, members, prompt):
    params = SamplingParams(max_tokens=24)
    plain = decoding.generate(target, prompt, params).token_ids
    # the target itself among the drafters, so that fused trees really get accepted
    fused = decoding.generate(target, prompt, params, FusedDrafter(members + [(ModelDrafter(target), 0.9)]), 4)
    assert fused.token_ids == plain
    assert fused.accepted_draft_tokens > 0
