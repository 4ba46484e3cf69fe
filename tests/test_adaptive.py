"""Adaptive speculation (router.adaptive): the draft length follows acceptance and load."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest

from cluster.state import EmbeddedStateStore
from drafter_service.pool import DrafterPool
from loopback import loopback
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from router.adaptive import DraftCostMemory, PassCostModel, SpeculationControl, expected_tokens
from router.expertise import ExpertiseRouter
from router.servicer import RouterConfig, RouterServicer
from router.servicer import serve as serve_router
from tiny import TINY, DigitTokenizer, tiny_model
from verifier_service.engine import VerifierEngine


def test_expected_tokens_of_a_chain():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def learned(acceptance: float, rounds: int = 30, **kwargs) -> SpeculationControl:
    """A control that saw `rounds` rounds of 5 offered tokens, each accepted with
    probability `acceptance` until the first rejection."""
    rng = random.Random(0)
    control = SpeculationControl(max_length=5, prior=0.5, **kwargs)
    for _ in range(rounds):
        accepted = 0
        while accepted < 5 and rng.random() < acceptance:
            accepted += 1
        control.record(5, accepted)
    return control


def test_length_grows_with_acceptance_and_shrinks_with_load():
    good, poor = learned(0.9), learned(0.1)
    assert good.acceptance > 0.7 and poor.acceptance < 0.3
    assert good.length(batch=1) == 5
    assert poor.length(batch=1) <= 1
    assert good.length(batch=8) < good.length(batch=1)  # a saturated verifier pays for every token of every row
    assert SpeculationControl(max_length=5, prior=0.9).length(batch=64) <= 1


def test_under_load_a_draft_must_pay_for_the_slots_it_pads():
    """A 5-token chain accepted at 0.8 gains 3.7 tokens a pass: alone it pays (1.5 passes of
    time). In a batch of 8 its 5 tokens cost 0.3 passes and their attention, padded into all 8
    rows, 0.4 more: 10.7 tokens in 2.1 passes, where plain decoding gives 8 in 1.4."""
    control = SpeculationControl(max_length=5, prior=0.8, verify_token_cost=0.06, verify_pad_cost=0.01)
    assert control.length(batch=1) == 5
    assert control.length(batch=8) <= 1
    assert SpeculationControl(max_length=5, prior=0.8, verify_pad_cost=0.0).length(batch=8) > 1


def test_under_load_a_good_draft_still_pays_for_its_own_tokens():
    """The verifier packs real tokens, so a draft costs its own tokens, not a row's worth
    of padding in every row: at 0.95 acceptance even 8 requests' batch gains from drafting
    (padding every row to 1 + k slots, k = 2 would cost 2.4 passes for 10.9 tokens)."""
    control = SpeculationControl(max_length=5, prior=0.95, verify_token_cost=0.06, verify_pad_cost=0.01)
    assert control.length(batch=8) >= 2


def test_costly_rows_make_a_draft_relatively_cheaper_in_a_full_batch():
    """Where another request's row costs more than another token in a row (its attention over
    its own context, its cache writes: 0.13 against 0.09 on the Intel dev machine), a batch of 8
    already costs 1.91 passes, and a 2-token draft at 0.7 acceptance (1.19 more tokens for
    0.18 of a pass) is the best there: 9.19 tokens in 2.09 passes against 8 in 1.91. With
    rows priced like tokens (8 in 1.42 passes) one token is all that pays."""
    costs = dict(verify_token_cost=0.09, verify_pad_cost=0.0)
    cheap_rows = SpeculationControl(max_length=5, prior=0.7, verify_row_cost=0.06, **costs)
    costly_rows = SpeculationControl(max_length=5, prior=0.7, verify_row_cost=0.13, **costs)
    assert cheap_rows.length(batch=8) == 1
    assert costly_rows.length(batch=8) == 2
    assert cheap_rows.length(batch=1) == costly_rows.length(batch=1) == 4  # alone, no other row is there


def test_the_cost_of_asking_the_drafters_at_all_stops_one_token_drafts_under_load():
    """A one-token draft pays the round trips to the drafters as a five-token one does:
    at 0.8 acceptance in a batch of 8 a one-token draft barely pays for its tokens, and
    not once asking costs 6% of a pass; alone, a full draft still pays well."""
    control = SpeculationControl(max_length=5, prior=0.8, verify_token_cost=0.06, verify_pad_cost=0.01)
    assert control.length(batch=8) == 1
    for _ in range(20):
        control.observe_round(overhead_seconds=0.005, pass_seconds=0.08)
    assert control.draft_round_cost == pytest.approx(0.0625, rel=0.02)
    assert control.length(batch=8) == 0
    assert control.length(batch=1) == 5


def test_drafting_on_the_verifier_weighs_its_own_time_but_no_round_trip():
    """A Decode round asks no pool, so the round trip's cost does not weigh; the drafting's
    own time does: an eagle head's levels (a fifth of a pass each, in the verifier between
    passes) do not pay in a batch of 8 at this acceptance, prompt lookup's (nothing) does."""
    control = SpeculationControl(max_length=5, prior=0.6, verify_token_cost=0.02)
    control.draft_round_cost = 0.5  # a pool's round trip: drafting through a pool never pays
    assert control.length(batch=8) == 0
    assert control.length(batch=8, drafted_by_verifier=True) > 0  # prompt lookup: its time is nothing
    for _ in range(5):
        control.observe(draft_seconds_per_token=0.01, pass_seconds=0.05)
    assert control.length(batch=8, drafted_by_verifier=True) == 0
    assert control.length(batch=1, drafted_by_verifier=True) > 0  # alone, the gain still pays for it


def test_drafting_cost_shortens_drafts_unless_drafts_made_ahead_are_reused():
    seq = SpeculationControl(max_length=5, prior=0.7)
    piped = SpeculationControl(max_length=5, prior=0.7, pipelined=True)
    for control in (seq, piped):
        for _ in range(5):
            control.observe(draft_seconds_per_token=0.02, pass_seconds=0.05)  # a draft token: 40% of a pass
    assert seq.draft_token_cost == pytest.approx(0.4)
    assert seq.length() == piped.length()  # nothing reused yet: drafting is on the round's path
    for _ in range(10):
        piped.reused(True)
    assert seq.length() < piped.length()


def test_no_speculation_still_probes_now_and_then_unless_nothing_could_pay():
    control = SpeculationControl(max_length=5, prior=0.0, probe_every=4)
    lengths = [control.length() for _ in range(8)]
    assert lengths.count(0) == 6 and lengths.count(1) == 2
    # 64 rows: padding them all costs more than any draft could gain, so a probe is waste
    assert [control.length(batch=64) for _ in range(8)] == [0] * 8


def test_the_plain_rounds_of_one_choice_count_towards_the_next_probe():
    """A verifier's Decode call runs many rounds on one choice of length: when it was 0,
    those rounds count as rounds without a draft, so the next choice probes."""
    control = SpeculationControl(max_length=5, prior=0.0, probe_every=8)
    assert control.length() == 0
    control.plain_rounds(15)  # the call's other rounds
    assert control.length() == 1
    assert [control.length() for _ in range(7)] == [0] * 7  # the probe (rejected or not yet heard) restarts the count


def test_acceptance_recovers_when_the_text_turns_predictable():
    control = learned(0.0, rounds=10)
    assert control.length() == 0 or control.acceptance < 0.1
    for _ in range(6):
        control.record(1, 1)
    assert control.acceptance > 0.5 and control.length() >= 2


def test_a_wide_tree_costs_its_nodes_so_load_stops_it_sooner():
    """Three nodes a level cost three tokens a level: the same acceptance drafts less
    (a 16-node tree 5 deep at batch 8 costs what 16 tokens of 8 rows cost, not 5)."""
    chain, tree = learned(0.7), learned(0.7)
    for _ in range(30):
        tree.observe_tree(nodes=16, depth=5)
    assert tree.width == pytest.approx(3.2, abs=0.01)
    assert chain.length(batch=2) > tree.length(batch=2)
    assert tree.length(batch=1) <= chain.length(batch=1)


def pass_seconds(rows: int, tokens: int, width: int, c0=0.033, row=0.13, token=0.09, pad=0.01) -> float:
    """A pass that costs exactly what the linear model says."""
    return c0 * (1 + row * (rows - 1) + token * (tokens - rows) + pad * (rows * width - tokens))


def random_passes(n: int, rng: random.Random, max_rows: int = 8, noise: float = 0.05, **costs):
    """Passes of 1 to `max_rows` rows, each row 0 to 5 draft tokens, timed with +-`noise`."""
    for i in range(n):
        drafts = [rng.randint(0, 5) for _ in range(rng.randint(1, max_rows))]
        rows, tokens, width = len(drafts), len(drafts) + sum(drafts), 1 + max(drafts)
        yield ("v", i), rows, tokens, width, pass_seconds(rows, tokens, width, **costs) * rng.uniform(1 - noise,
                                                                                                     1 + noise)


def test_pass_costs_are_learned_from_the_verifiers_timings():
    """From the defaults (0.06, 0.06, 0.01), 300 noisy passes of mixed shapes give back the
    costs they were timed with, within 0.02."""
    model = PassCostModel()
    for p in random_passes(300, random.Random(0)):
        model.observe(*p)
    assert model.passes == 300
    assert model.costs() == pytest.approx((0.13, 0.09, 0.01), abs=0.02)


def test_a_cost_the_traffic_never_shows_keeps_its_prior():
    """One client: every pass has one row, so what another row costs stays the setting, while
    the token cost is learned; before `min_passes` passes all three are the settings."""
    model = PassCostModel(row_cost=0.2, token_cost=0.05, pad_cost=0.01, min_passes=20)
    passes = list(random_passes(200, random.Random(1), max_rows=1, token=0.15))
    for p in passes[:19]:
        model.observe(*p)
    assert model.costs() == (0.2, 0.05, 0.01)
    for p in passes[19:]:
        model.observe(*p)
    row, token, _ = model.costs()
    assert row == pytest.approx(0.2, abs=1e-6) and token == pytest.approx(0.15, abs=0.02)


def test_every_request_of_a_batch_reports_its_pass_but_it_counts_once():
    model = PassCostModel(min_passes=1)
    for _ in range(8):  # the 8 requests of one pass
        model.observe(("v", 7), 8, 8, 1, 0.06)
    model.observe(("other verifier", 7), 1, 1, 1, 0.03)
    assert model.passes == 2
    for bad in [(0, 1, 1, 0.03), (2, 1, 1, 0.03), (1, 3, 2, 0.03), (1, 1, 1, 0.0)]:  # impossible shapes, no time
        model.observe(("v", 99), *bad)
    assert model.passes == 2


def test_a_control_drafts_by_the_learned_costs():
    """A verifier where every draft token costs 0.5 of a pass: once that is learned, a
    request at 0.7 acceptance drafts less than the 0.06 setting would have it draft."""
    model = PassCostModel(min_passes=20)
    control = SpeculationControl(max_length=5, prior=0.7, pass_costs=model)
    before = control.length(batch=1)
    assert before == SpeculationControl(max_length=5, prior=0.7).length(batch=1) == 5
    for p in random_passes(100, random.Random(2), token=0.5):
        model.observe(*p)
    assert model.costs()[1] == pytest.approx(0.5, abs=0.05)
    after = control.length(batch=1)
    assert after == SpeculationControl(max_length=5, prior=0.7, verify_token_cost=0.5).length() < before


def test_a_served_router_learns_from_each_verification_pass_once_and_exports_the_costs():
    """Four concurrent requests through a real router, verifier and drafter pool on loopback:
    every verification pass the verifier ran is learned from once, however many requests
    shared it, and /metrics shows the costs the adaptive lengths now use."""
    target = tiny_model(0)
    pool, engine = DrafterPool(target, kinds=["pld"]), VerifierEngine(target, max_batch=4, max_len=64,
                                                                     batch_wait_s=0.02)
    model = PassCostModel(min_passes=1)
    config = RouterConfig(context_length=TINY.max_position_embeddings - 12, eos_token_ids=[],
                          vocab_size=TINY.vocab_size, default_drafter="pld", draft_length=3, adaptive=True)
    with loopback(pool, engine, pass_costs=model) as coordinator:
        servicer = RouterServicer(DigitTokenizer(), coordinator, config)
        router, port = serve_router(servicer, "127.0.0.1", 0)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            stub = pb_grpc.SpecserveStub(channel)

            def ask(i: int) -> pb.GenerateResponse:
                return stub.Generate(pb.GenerateRequest(prompt="1231231" + str(i),
                                                        sampling=pb.SamplingParams(max_tokens=24)), timeout=60)

            with ThreadPoolExecutor(4) as clients:
                responses = list(clients.map(ask, range(4)))
            stats = engine.stats()
        finally:
            channel.close()
            router.stop(None)
    assert all(len(r.token_ids) == 24 for r in responses)
    verification_passes = sum(stats["batch_size_histogram"].values())
    assert stats["max_batch_size"] > 1, "no pass was shared: the once-per-pass count was not exercised"
    assert model.passes == verification_passes
    exported = generate_latest(servicer.metrics.registry).decode()
    assert f"specserve_verify_cost_passes {float(verification_passes)}" in exported
    assert f'specserve_verify_cost{{term="token"}} {model.costs()[1]!r}' in exported


def test_a_reported_pass_is_counted_in_one_row_one_token_passes():
    """Drafting costs are learned against a one-row, one-token pass: a verdict's batched pass
    is turned into those by the verify costs (the settings', or the learned ones)."""
    control = SpeculationControl(5, verify_row_cost=0.1, verify_token_cost=0.05, verify_pad_cost=0.01)
    assert control.pass_units(1, 1, 1) == 1.0
    # 4 rows, 10 scored tokens, the widest row 4: 3 more rows, 6 more tokens, 16 - 10 padded slots
    assert control.pass_units(4, 10, 4) == pytest.approx(1 + 0.3 + 0.3 + 0.06)
    model = PassCostModel(row_cost=0.1, token_cost=0.05, pad_cost=0.01)
    for i in range(400):  # passes whose every extra row costs half a one-token pass
        model.observe(("v", i), 1 + i % 4, 1 + i % 4, 1, 0.02 * (1 + 0.5 * (i % 4)))
    learned = SpeculationControl(5, pass_costs=model)
    assert learned.pass_units(3, 3, 1) == pytest.approx(2.0, rel=0.1)


def test_a_drafter_pays_at_a_load_by_what_it_last_cost_there():
    """`DraftCostMemory.pays`: unknown at a load, a drafter pays (only drafting measures it);
    remembered, it pays if a request's control would draft at all with those costs."""
    now = [0.0]
    memory = DraftCostMemory(max_age_s=120.0, clock=lambda: now[0])
    assert memory.pays(SpeculationControl(5, prior=0.6), "recycle", 8)
    hop = SpeculationControl(5, prior=0.6, draft_round_cost=1.5)  # a drafted round's hop: 1.5 passes
    memory.remember(hop, "recycle", 8)
    assert not memory.pays(SpeculationControl(5, prior=0.6), "recycle", 8)
    assert memory.pays(SpeculationControl(5, prior=0.6), "recycle", 1)  # a lighter load: not known there
    assert not memory.pays(SpeculationControl(5, prior=0.6), "recycle", 9)  # a heavier one: at least that hop
    memory.remember(SpeculationControl(5, draft_round_cost=0.05), "recycle", 1)
    assert memory.pays(SpeculationControl(5, prior=0.6), "recycle", 1)
    assert not memory.pays(SpeculationControl(5, prior=0.01), "recycle", 1)  # cheap, but never right
    assert memory.pays(SpeculationControl(5, prior=0.6), "small-general", 8)  # kept per kind
    now[0] = 121.0  # at load 8 too old: measured again; at load 1 as old, the same
    assert memory.pays(SpeculationControl(5, prior=0.6), "recycle", 8)
    assert memory.pays(SpeculationControl(5, prior=0.01), "recycle", 1)


def test_a_drafter_pays_by_the_acceptance_it_last_had_on_the_domain():
    """`pays(domain=...)`: the acceptance the latest request of a kind had learned on a domain
    (remembered with its costs) stands in for a new request's prior there; other domains keep
    theirs, and after `max_age_s` the prior is back."""
    now = [0.0]
    memory = DraftCostMemory(max_age_s=120.0, clock=lambda: now[0])
    poor = SpeculationControl(5, prior=0.5, draft_token_cost=0.02)
    for _ in range(12):  # a drafter that is never right on writing
        poor.record(2, 0)
    memory.remember(poor, "eagle", 2, "writing")
    assert not memory.pays(SpeculationControl(5, prior=0.6), "eagle", 2, drafted_by_verifier=True, domain="writing")
    assert memory.pays(SpeculationControl(5, prior=0.6), "eagle", 2, drafted_by_verifier=True, domain="math")
    now[0] = 121.0  # too old: costs and acceptance measured again
    assert memory.pays(SpeculationControl(5, prior=0.6), "eagle", 2, drafted_by_verifier=True, domain="writing")


def test_a_probe_is_flagged_as_one():
    """`probing` says the last length was a probe (goodput chose none): a caller running
    many rounds on that choice drafts only the first (router.coordinator.rounds)."""
    control = SpeculationControl(5, prior=0.0, probe_every=3)
    choices = [(control.length(1), control.probing) for _ in range(3)]
    assert choices == [(0, False), (0, False), (1, True)], choices
    sure = SpeculationControl(5, prior=0.9)
    assert sure.length(1) > 0 and not sure.probing


def test_a_head_the_verifier_runs_pays_no_round_cost():
    """`pays(drafted_by_verifier=True)`: an eagle head drafting in the verifier's own rounds asks
    nothing, so only its tokens' cost weighs, not the round trip a pool round's costs hold."""
    memory = DraftCostMemory()
    memory.remember(SpeculationControl(5, draft_token_cost=0.05, draft_round_cost=1.5), "eagle", 2)
    assert not memory.pays(SpeculationControl(5, prior=0.6), "eagle", 2)
    assert memory.pays(SpeculationControl(5, prior=0.6), "eagle", 2, drafted_by_verifier=True)
    memory.remember(SpeculationControl(5, draft_token_cost=3.0), "eagle", 2)  # a level: 3 passes
    assert not memory.pays(SpeculationControl(5, prior=0.6), "eagle", 2, drafted_by_verifier=True)


def test_a_drafter_that_has_not_drafted_here_is_judged_by_its_pools_cost_and_any_kinds_hop():
    """Before a kind drafts at a router, its costs are guessed: the token cost its pools
    measured at start, the round cost (the calls a pool round makes) any other kind's."""
    memory = DraftCostMemory(prior_token_costs=lambda: {"small-general": 0.9, "pld": 0.001})
    assert not memory.pays(SpeculationControl(5, prior=0.5), "small-general", 1)  # a token: 0.9 of a pass
    assert memory.pays(SpeculationControl(5, prior=0.5), "pld", 1)
    memory.remember(SpeculationControl(5, draft_round_cost=1.5), "recycle", 1)  # another kind's round: 1.5 passes
    assert not memory.pays(SpeculationControl(5, prior=0.5), "pld", 1)  # the same calls: the same hop
    assert memory.pays(SpeculationControl(5, prior=0.5), "unmeasured", 1)  # no pool measured it: drafting will
    started = SpeculationControl(5, prior=0.5)
    memory.start(started, "small-general", 1)
    assert (started.draft_token_cost, started.draft_round_cost) == (0.9, 1.5)


def test_auto_routes_no_pool_drafter_that_would_not_draft_at_the_load():
    """Requests one at a time (load 1) through a real router, verifier and pool on loopback,
    routed among prompt lookup (the verifier drafts it) and the recycling drafter (only the
    pool runs it). Until the recycling drafter has drafted at load 1, "auto" may route it;
    once a round there has shown its hop costs more than any draft could gain, it routes
    no route with it: prompt lookup or plain decoding (as their measured goodput has it), both
    on the verifier. Prompt lookup is never left out: it costs no hop."""
    target = tiny_model(0)
    pool, engine = DrafterPool(target, kinds=["pld", "recycle"]), VerifierEngine(target, max_batch=4, max_len=64)
    config = RouterConfig(context_length=TINY.max_position_embeddings - 12, eos_token_ids=[],
                          vocab_size=TINY.vocab_size, default_drafter="auto", routed_drafters=("pld", "recycle"),
                          fused_drafters=1, draft_length=3, adaptive=True, verifier_drafting=True)
    expertise = ExpertiseRouter(EmbeddedStateStore(), refresh_s=0, epsilon=0.0, rng=np.random.default_rng(0))
    with loopback(pool, engine) as coordinator:
        router, port = serve_router(RouterServicer(DigitTokenizer(), coordinator, config, expertise), "127.0.0.1", 0)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            stub = pb_grpc.SpecserveStub(channel)

            def routed(n: int) -> list[str]:
                return [stub.Generate(pb.GenerateRequest(prompt="1231231" + str(i), domain_hint="coding",
                                                         sampling=pb.SamplingParams(max_tokens=8)),
                                      timeout=60).usage.drafter for i in range(n)]

            assert "recycle" in routed(8), "unmeasured, the pool's drafter was never routed"
            coordinator.draft_costs.remember(SpeculationControl(3, draft_round_cost=50.0), "recycle", 1)
            later = routed(8)
            assert set(later) <= {"pld", "none"} and "pld" in later, later
            assert coordinator.load() == 1  # no request running: a new one would be alone
        finally:
            channel.close()
            router.stop(None)
