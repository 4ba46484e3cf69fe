"""Token Recycling: the table of the target's own top-k next tokens, and its trees."""

from __future__ import annotations

import pytest
import torch

import speculative.decoding as decoding
from drafter_service.drafters import RecyclingDrafter
from runtime.model import attention_mask, causal_ancestors
from speculative.recycling import RecycledCandidates, top_candidates
from speculative.sampling import SamplingParams
from tiny import TINY, tiny_model


def table_with(rows: dict[int, list[tuple[int, float]]], vocab: int = 50, k: int = 3) -> RecycledCandidates:
    table = RecycledCandidates(vocab, k)
    for token, cands in rows.items():
        table.observe([token], torch.tensor([[t for t, _ in cands]]), torch.tensor([[p for _, p in cands]]))
    return table


def test_tree_grows_best_first_by_path_probability():
    table = table_with({1: [(2, 0.6), (3, 0.3)], 2: [(4, 0.9), (5, 0.05)], 3: [(6, 0.5)], 4: [(7, 0.2)]})
    tree = table.propose(1, max_nodes=5, max_depth=3)
    # path probabilities: 2 .6, 2-4 .54, 3 .3, 3-6 .15, 2-4-7 .108, 2-5 .03
    assert [tree.tokens[i] for i in range(len(tree))] == [2, 4, 3, 6, 7]
    assert [tree.tokens[p] if p >= 0 else None for p in tree.parents] == [None, 2, None, 3, 4]
    assert tree.confidence == pytest.approx([0.6, 0.9, 0.3, 0.5, 0.2])
    assert max(tree.depths) == 3
    assert table.propose(1, max_nodes=10, max_depth=1).tokens == [2, 3]
    assert len(table.propose(9, max_nodes=5, max_depth=3)) == 0  # never seen: nothing to draft


def test_newer_observation_replaces_the_row():
    table = table_with({1: [(2, 0.6), (3, 0.3), (4, 0.1)]})
    table.observe([1], torch.tensor([[5]]), torch.tensor([[0.7]]))
    assert table.propose(1, max_nodes=5, max_depth=1).tokens == [5]
    with pytest.raises(ValueError):
        table.observe([1, 2], torch.tensor([[5]]), torch.tensor([[0.7]]))
    with pytest.raises(ValueError):
        table.observe([50], torch.tensor([[5]]), torch.tensor([[0.7]]))


def next_top(target, seq: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own top-k next tokens after `seq`, and their probabilities."""
    logits = target(torch.tensor([seq]), torch.arange(len(seq))[None], target.new_cache(len(seq) + 4),
                    attention_mask(0, causal_ancestors(len(seq))), logits_from=len(seq) - 1)[0, -1]
    ids, probs = top_candidates(logits[None], k)
    return ids[0], probs[0]


def test_the_decoding_loop_feeds_the_targets_top_k():
    """The prefill seeds the table with the target's predictions after each prompt token,
    and a round (here drafting nothing, so it scores only its root, the first generated
    token) adds the prediction after the root."""
    torch.manual_seed(0)
    target = tiny_model(seed=0, logit_scale=0.5)
    prompt = [1, 2, 3]
    table = RecycledCandidates(TINY.vocab_size, k=3)
    out = decoding.generate(target, prompt, SamplingParams(max_tokens=2), RecyclingDrafter(table), draft_length=0)
    root = out.token_ids[0]
    for i, token in enumerate(prompt):
        if token != root:
            ids, probs = next_top(target, prompt[:i + 1], 3)
            assert table.ids[token].tolist() == ids.tolist(), f"prompt token {token}"
            assert torch.allclose(table.probs[token], probs, atol=1e-5)
    ids, probs = next_top(target, prompt + [root], 3)
    assert table.ids[root].tolist() == ids.tolist()
    assert torch.allclose(table.probs[root], probs, atol=1e-5)
    # and the next request drafts from it
    again = decoding.generate(target, prompt, SamplingParams(max_tokens=8), RecyclingDrafter(table), 3)
    assert again.draft_tokens > 0


def test_only_a_fusion_with_a_learner_asks_for_the_targets_scores():
    from drafter_service.drafters import PromptLookupDrafter
    from speculative.fused_drafter import FusedDrafter

    table = RecycledCandidates(TINY.vocab_size, k=3)
    plain = FusedDrafter([(PromptLookupDrafter(TINY.vocab_size), 1.0)] * 2)
    assert not plain.abilities.learns_from_target  # the decoding loop then computes no candidates
    fused = FusedDrafter([(PromptLookupDrafter(TINY.vocab_size), 1.0), (RecyclingDrafter(table), 1.0)])
    assert fused.abilities.learns_from_target
    fused.observe([1], torch.tensor([[2, 3]]), torch.tensor([[0.6, 0.3]]))
    assert table.ids[1, :2].tolist() == [2, 3]


# ---- served: the verifier reports its candidates, the coordinator passes them to the pool ----

SERVED_PROMPTS = [[1, 2, 3, 1, 2], [5, 6, 7, 5], [0, 3, 3, 3, 3], [4, 4, 1, 2]]


def test_served_recycling_learns_from_the_verifier_and_stays_exact():
    """Each recycling drafter's first Propose carries the target's predictions after the
    prompt (the prefill's seed), each later one those of the round just verified (at least
    its root); the output is the target's own, alone or fused with prompt lookup."""
    from drafter_service.pool import DrafterPool
    from loopback import loopback
    from router.coordinator import Job
    from router.stats import RoundStats
    from verifier_service.engine import VerifierEngine

    class RecordingPool(DrafterPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.observed: dict[str, list[int]] = {}  # request id -> observed positions per Propose

        def propose(self, request_id, *args, observed=None, **kwargs):
            self.observed.setdefault(request_id, []).append(0 if observed is None else len(observed[0]))
            return super().propose(request_id, *args, observed=observed, **kwargs)

    torch.set_num_threads(1)
    target = tiny_model(0)
    pool = RecordingPool(target, kinds=["recycle", "pld"])
    engine = VerifierEngine(target, max_batch=4, max_len=64)
    params = SamplingParams(max_tokens=24)
    drafted = accepted = 0
    with loopback(pool, engine) as coordinator:
        for i, prompt in enumerate(SERVED_PROMPTS):
            for drafters in ((("recycle", 1.0),), (("recycle", 0.8), ("pld", 0.6))):
                stats = RoundStats()
                rid = f"r{i}-{len(drafters)}"
                job = Job(request_id=rid, prompt_ids=prompt, params=params, drafters=drafters,
                          draft_length=4, tree_budget=6, vocab_size=TINY.vocab_size, eos_token_ids=(), service_id=rid)
                tokens = [t for new in coordinator.run(job, stats) for t in new]
                assert tokens == decoding.generate(target, prompt, params).token_ids, (prompt, drafters)
                drafted += stats.draft_tokens
                accepted += stats.accepted_draft_tokens
                first, *later = pool.observed[rid if len(drafters) == 1 else f"{rid}/recycle"]
                assert first == len(prompt), "the prefill's predictions did not reach the drafter"
                assert later and min(later) >= 1, "a round's predictions did not reach the drafter"
                assert not any(pool.observed.get(f"{rid}/pld", [])), "prompt lookup got what it cannot use"
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_the_verifier_reports_the_targets_own_candidates():
    """Prefill: the top-k after each prompt token; verify: after the root and each node."""
    from speculative.tree import DraftTree
    from verifier_service.engine import VerifierEngine

    torch.set_num_threads(1)
    target = tiny_model(0)
    engine = VerifierEngine(target, max_batch=2, max_len=64)
    try:
        prompt = [1, 2, 3, 4]
        out = engine.prefill("a", prompt, SamplingParams(max_tokens=8), candidates=3)
        for i in range(len(prompt)):
            ids, probs = next_top(target, prompt[:i + 1], 3)
            assert out.candidate_ids[i].tolist() == ids.tolist()
            assert torch.allclose(out.candidate_probs[i], probs, atol=1e-5)
        draft = [5, 6]
        verdict = engine.verify("a", DraftTree.chain(draft), candidates=3)
        scored = prompt + [out.next_token] + draft
        for i in range(3):  # root, then each node, whatever was accepted
            ids, _ = next_top(target, scored[:len(prompt) + 1 + i], 3)
            assert verdict.candidate_ids[i].tolist() == ids.tolist()
        assert engine.prefill("b", prompt, SamplingParams(max_tokens=8)).candidate_ids is None
    finally:
        engine.close()


def test_malformed_observations_are_invalid_argument():
    import grpc

    from drafter_service.pool import DrafterPool
    from drafter_service.servicer import serve
    from protos import specserve_pb2 as pb
    from protos import specserve_pb2_grpc as pb_grpc
    from protos.convert import params_to_pb

    pool = DrafterPool(tiny_model(0), kinds=["recycle"])
    server, port = serve(pool)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.DrafterStub(channel)
            stub.Prefill(pb.DrafterPrefillRequest(request_id="a", drafter="recycle", token_ids=[1, 2],
                                                  sampling=params_to_pb(SamplingParams(max_tokens=4))))
            bad = [dict(observed_tokens=[1, 2], observed_ids=[3, 4, 5], observed_probs=[0.5, 0.3, 0.2]),
                   dict(observed_tokens=[1], observed_ids=[3, 99], observed_probs=[0.5, 0.3]),
                   dict(observed_tokens=[1], observed_ids=[3, 4], observed_probs=[0.5, 2.0])]
            for fields, name in zip(bad, ["observed_ids", "observed_ids", "observed_probs"]):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Propose(pb.ProposeRequest(request_id="a", context_length=2, max_tokens=3, **fields))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith(name), err.value.details()
            ok = stub.Propose(pb.ProposeRequest(request_id="a", context_length=2, max_tokens=3, observed_tokens=[2],
                                                observed_ids=[5, 6], observed_probs=[0.7, 0.2]))
            assert list(ok.tree.tokens)[:1] == [5]  # drafted from what it was just told
    finally:
        server.stop(None)
