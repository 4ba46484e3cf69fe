"""Confidence calibration: verdicts label a proposal's nodes, learned rates replace
drafters' confidences, and a fused drafter learns to rank an overconfident member
below a reliable one (greedy, where any tree is lossless)."""

from __future__ import annotations

import pytest
import torch

from speculative.fused_drafter import FusedDrafter
from speculative.calibration import MIDPOINTS, Calibration
from speculative.decoding import DraftRequest
from speculative.drafter_kinds import Abilities
from speculative.sampling import SamplingParams
from speculative.tree import DraftTree


def test_a_verdict_labels_the_nodes_whose_path_the_target_took():
    tree = DraftTree.chain([5, 6, 7], confidence=[0.95, 0.95, 0.95])
    tree.add_chain([5, 8, 9], confidence=[0.95, 0.15, 0.15])  # 9 lies below a rejected node
    tree.add_chain([4], confidence=[0.45])
    cal = Calibration()
    # the target took 5 and 6, then 3 (its bonus): 5, 6, 8, 4 and 7 are labelled; 9 is not
    assert cal.learn(tree, [5, 6, 3]) == 5
    top, low, mid = Calibration.bucket(0.95), Calibration.bucket(0.15), Calibration.bucket(0.45)
    assert (cal.hits[top], cal.labels[top]) == pytest.approx((2.0, 3.0), rel=1e-2)  # 5, 6 hit; 7 missed
    assert (cal.hits[low], cal.labels[low]) == pytest.approx((0.0, 1.0), rel=1e-2)  # 8
    assert (cal.hits[mid], cal.labels[mid]) == pytest.approx((0.0, 1.0), rel=1e-2)  # 4
    # a continuation shorter than the tree labels no deeper than it goes
    assert Calibration().learn(tree, [5]) == 2  # depth 1: 5 and 4
    assert Calibration().learn(DraftTree(), [5]) == 0 and Calibration().learn(tree, []) == 0


def test_rates_start_at_the_confidence_and_follow_the_evidence():
    cal = Calibration()
    assert cal.rate(0.97) == pytest.approx(MIDPOINTS[-1])
    for i in range(400):  # an overconfident drafter: 0.95, right 3 times in 10
        cal.learn(DraftTree.chain([1], confidence=[0.95]), [1 if i % 10 < 3 else 2])
    assert cal.rate(0.97) == pytest.approx(0.3, abs=0.05)
    assert cal.rate(0.2) == pytest.approx(MIDPOINTS[1])  # other buckets untouched
    calibrated = cal.calibrated(DraftTree.chain([1, 2], confidence=[0.95, 0.2]))
    assert calibrated.tokens == [1, 2] and calibrated.confidence == pytest.approx([cal.rate(0.95), MIDPOINTS[1]])
    assert cal.calibrated(DraftTree.chain([3])).confidence == pytest.approx([cal.rate(1.0)])  # no confidence: 1.0


class Fixed:
    """A drafter that always proposes the same chain at the same confidence."""

    abilities = Abilities()

    def __init__(self, tokens, confidence):
        self.tokens, self.confidence, self.name = tokens, confidence, f"fixed{tokens}"

    def propose(self, request):
        depth = request.depth
        return DraftTree.chain(self.tokens[:depth], confidence=[self.confidence] * min(depth, len(self.tokens)))


@pytest.mark.parametrize("calibrated", [True, False])
def test_fused_drafter_learns_which_member_to_trust(calibrated):
    """Member A is sure (1.0) and always wrong; member B is unsure (0.45) and always right.
    The target always continues with B's tokens. Calibrated, B's chain fills the budget
    after a few rounds; without calibration A's keeps it."""
    wrong, right = Fixed([1, 2], 1.0), Fixed([3, 4], 0.45)
    cals = [Calibration(), Calibration()] if calibrated else None
    fused = FusedDrafter([(wrong, 1.0), (right, 1.0)], calibrations=cals)
    params, context, firsts = SamplingParams(max_tokens=100), [0], []
    for _ in range(12):
        tree = fused.propose(DraftRequest(context, 2, params, torch.Generator(), max_nodes=2))
        firsts.append(tree.tokens[0])
        context = context + [3, 4, 9]  # the target's tokens: B's chain, then its bonus token
    assert firsts[0] == 1  # before any evidence the sure member leads
    assert firsts[-1] == (3 if calibrated else 1)


def test_a_draft_ahead_teaches_nothing_and_a_foreign_context_is_ignored():
    cal = Calibration()
    fused = FusedDrafter([(Fixed([3, 4], 0.95), 1.0)], calibrations=[cal])
    params = SamplingParams(max_tokens=100)
    fused.propose(DraftRequest([0], 2, params, torch.Generator(), max_nodes=2))
    fused.propose(DraftRequest([0, 3, 4, 9, 3], 2, params, torch.Generator(), verified=4, max_nodes=2))  # ahead of a guess
    labelled = sum(cal.labels)
    assert labelled == pytest.approx(2.0, rel=1e-2)  # the first round's two nodes, from the verified part
    fused.propose(DraftRequest([7, 7, 7, 7, 7], 2, params, torch.Generator(), max_nodes=2))  # nothing stored to learn from
    assert sum(cal.labels) == pytest.approx(labelled)
