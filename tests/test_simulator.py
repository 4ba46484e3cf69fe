"""bench/simulator.py: the cluster simulator against what can be worked out by hand
(closed-form throughput, a saturated verifier or pool, pipelining, Poisson arrivals,
seeds), the cost fit, and the `specserve simulate` command. No model, no cluster."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bench.simulator import (Costs, DrafterProfile, Question, SimConfig, costs_from_dict, fit_linear, grid,
                             load_costs, replicate, saturation_points, simulate)
from commands.cli import main as cli_main

DOMAIN = "qa"


def costs(*, rounds=((4, 2),), reuse=0.0, output=31, prompt=20, base=10.0, row=2.0, token=1.0, prefill_base=5.0,
          prefill_token=0.1, call=1.0, draft=2.0, batch_wait=2.0) -> Costs:
    return Costs(pass_base_ms=base, pass_row_ms=row, pass_token_ms=token, prefill_base_ms=prefill_base,
                 prefill_token_ms=prefill_token, call_ms=call, draft_token_ms={"d": draft},
                 profiles={"d": {DOMAIN: DrafterProfile(tuple(rounds), reuse)}},
                 questions=(Question(DOMAIN, prompt, output),), batch_wait_ms=batch_wait)


def config(**kw) -> SimConfig:
    return SimConfig(**{"drafter": "d", "draft_length": 4, "requests": 5, "max_tokens": 1000, **kw})


def test_one_client_matches_the_closed_form():
    # 31 tokens: the prefill's, 9 full rounds (4 drafted, 2 accepted + bonus: 3 tokens) reach
    # 28, and a last round may draft only 2 (the bonus always comes) and keeps both
    full_round = 1 + 4 * 2 + 1 + (10 + 2 * 1 + 1 * 5)  # call, draft 4, call, pass of 1 row x 5 tokens (ms)
    last_round = 1 + 2 * 2 + 1 + (10 + 2 * 1 + 1 * 3)
    latency = (1 + (5 + 0.1 * 20) + 9 * full_round + last_round) / 1000
    r = simulate(costs(), config())
    assert r.requests == 5 and r.generated_tokens == 5 * 31
    assert r.p50_s == pytest.approx(latency) and r.p99_s == pytest.approx(latency)
    assert r.tokens_per_s == pytest.approx(31 / latency)
    assert r.tokens_per_pass == pytest.approx(3.0)
    busy = (5 + 0.1 * 20 + 9 * 17 + 15) / 1000  # prefill and passes of one request
    assert r.verifier_idle == pytest.approx(1 - busy / latency)
    assert r.drafter_idle == pytest.approx(1 - (9 * 8 + 4) / 1000 / latency)
    assert r.passes == 5 * 10 and r.mean_batch_rows == 1.0  # prefills are not verification passes
    assert r.pass_ms == pytest.approx((9 * 17 + 15) / 10)


def test_plain_decoding_is_one_token_per_pass():
    r = simulate(costs(), config(drafter="none", requests=2))
    latency = (1 + 7 + 30 * (1 + 10 + 2 + 1)) / 1000  # 30 rounds of a call and a 1-row, 1-token pass
    assert r.p50_s == pytest.approx(latency) and r.tokens_per_pass == 1.0 and r.drafter_idle == 1.0


def test_a_saturated_verifier_is_never_idle_and_caps_throughput():
    # 8 clients fill the 8 rows; drafts are nearly free on 8 pools: the verifier is the bottleneck
    c = costs(rounds=((4, 4),), output=201, draft=0.001, call=0.0, prefill_base=0.1, prefill_token=0.0)
    r = simulate(c, config(clients=8, requests=32, pools=8))
    # every pass: 8 rows of a root and 4 accepted nodes, 5 tokens each; and each request's prefill token
    capacity = 8 * 5 / c.pass_s(8, 8 * 5) * 201 / 200
    assert r.verifier_idle < 0.02
    assert 0.95 * capacity <= r.tokens_per_s <= capacity
    assert r.mean_batch_rows == pytest.approx(8, abs=0.2)
    # twice the clients wait for rows: no more throughput, longer latency
    more = simulate(c, config(clients=16, requests=32, pools=8))
    assert more.tokens_per_s <= capacity and more.p50_s > 1.5 * r.p50_s


def test_a_saturated_pool_caps_throughput_and_a_second_doubles_it():
    # 40 ms a draft against a 0.5 ms pass: one pool core drafts a request's 40 rounds (200
    # tokens, and the prefill's) in 1.6 s
    c = costs(rounds=((4, 4),), output=201, draft=10.0, call=0.0, base=0.5, row=0.0, token=0.0, prefill_base=0.1,
              prefill_token=0.0)
    one = simulate(c, config(clients=8, requests=16, pools=1))
    assert one.drafter_idle < 0.02
    assert 0.95 * 201 / 1.6 <= one.tokens_per_s <= 201 / 1.6
    two = simulate(c, config(clients=8, requests=16, pools=2))
    assert two.tokens_per_s == pytest.approx(2 * one.tokens_per_s, rel=0.05)
    cores = simulate(c, config(clients=8, requests=16, pools=1, pool_workers=2))
    assert cores.tokens_per_s == pytest.approx(two.tokens_per_s, rel=0.05)


@pytest.mark.parametrize("clients,pools", [(1, 1), (4, 4)])
def test_pipelining_is_never_slower_with_the_same_costs(clients, pools):
    c = costs(rounds=((4, 4), (4, 1), (4, 0), (4, 3)), reuse=0.8, output=101)
    seq = simulate(c, config(clients=clients, pools=pools, requests=40, seed=3))
    pip = simulate(c, config(clients=clients, pools=pools, requests=40, seed=3, pipelined=True))
    assert pip.generated_tokens == seq.generated_tokens and pip.tokens_per_pass == seq.tokens_per_pass
    assert pip.tokens_per_s > seq.tokens_per_s and pip.mean_s < seq.mean_s
    # nothing ahead is ever kept: the same time as in sequence (a draft is shorter than a pass)
    never = simulate(dataclasses.replace(c, profiles={"d": {DOMAIN: DrafterProfile(c.profiles["d"][DOMAIN].rounds,
                                                                                   0.0)}}),
                     config(clients=clients, pools=pools, requests=40, seed=3, pipelined=True))
    assert never.tokens_per_s == pytest.approx(seq.tokens_per_s, rel=0.02)
    assert never.drafter_idle < seq.drafter_idle  # the ahead drafts still cost the pool


def test_a_pool_link_delay_costs_each_sequential_round_its_round_trip():
    # 31 tokens of (4 drafted, 4 accepted) rounds: 6 rounds after the prefill, each asking the pool once
    near = simulate(costs(rounds=((4, 4),)), config())
    far = simulate(costs(rounds=((4, 4),)), config(pool_link_ms=1.0))
    assert near.passes == far.passes == 5 * 6
    assert far.p50_s - near.p50_s == pytest.approx(6 * 2 * 1.0 / 1000)  # there and back, every round
    assert far.pass_ms == pytest.approx(near.pass_ms)  # the verifier's side does not cross that link
    with pytest.raises(ValueError, match="pool_link_ms"):
        simulate(costs(), config(pool_link_ms=-1.0))


def test_pipelining_hides_the_pool_link_when_the_ahead_draft_is_kept():
    # every draft wholly accepted and kept: only the first round waits for the pool; the ahead
    # drafts (a call, 2 x 1 ms of link, 8 ms of drafting) finish within a verify (a call, an 17 ms pass)
    c = costs(rounds=((4, 4),), reuse=1.0)
    near = simulate(c, config(pipelined=True))
    far = simulate(c, config(pipelined=True, pool_link_ms=1.0))
    assert far.p50_s - near.p50_s == pytest.approx(2 * 1.0 / 1000)
    # none kept: every round pays the round trip again, as in sequence
    never = dataclasses.replace(c, profiles={"d": {DOMAIN: DrafterProfile(((4, 4),), 0.0)}})
    gap = simulate(never, config(pipelined=True, pool_link_ms=1.0)).p50_s - simulate(never, config(pipelined=True)).p50_s
    assert gap == pytest.approx(6 * 2 * 1.0 / 1000)


def test_poisson_arrivals_at_the_rate_asked_for():
    # light load (a request takes ~0.3 s, 4 clients at 0.5/s each): served as they arrive
    r = simulate(costs(), config(clients=4, rate=0.5, requests=2000))
    assert r.requests_per_s == pytest.approx(4 * 0.5, rel=0.1)
    assert r.p50_s < 0.4 and r.verifier_idle > 0.5


def test_a_seed_makes_a_run_repeatable():
    c = costs(rounds=((4, 4), (4, 1), (2, 0)), reuse=0.5)
    cfg = config(clients=3, rate=2.0, requests=30, pipelined=True, seed=7)
    assert dataclasses.asdict(simulate(c, cfg)) == dataclasses.asdict(simulate(c, cfg))
    assert simulate(c, cfg).p99_s != simulate(c, dataclasses.replace(cfg, seed=8)).p99_s


def test_more_verifiers_and_pools_in_the_grid():
    c = costs(rounds=((4, 3),), output=61, draft=3.0)
    rows = grid(c, config(), verifiers=[1, 2], pools=[1, 2, 4], requests_per_client=2)
    by = {(r["verifiers"], r["pools"]): r for r in rows}
    assert by[(2, 4)]["tokens_per_s"] > by[(1, 4)]["tokens_per_s"]
    assert by[(1, 2)]["tokens_per_s"] >= by[(1, 1)]["tokens_per_s"]
    points = {p["verifiers"]: p for p in saturation_points(rows)}
    assert points[1]["pools"] <= points[2]["pools"]  # twice the verifiers need at least as many pools


def test_settings_the_costs_cannot_simulate_are_named():
    with pytest.raises(ValueError, match="drafter 'other'"):
        simulate(costs(), config(drafter="other"))
    with pytest.raises(ValueError, match="pools must be at least 1"):
        simulate(costs(), config(pools=0))
    with pytest.raises(ValueError, match="missing field 'call_ms'"):
        costs_from_dict({k: v for k, v in COSTS_FILE.items() if k != "call_ms"})


def test_cost_fit_recovers_a_linear_cost():
    samples = [([r, t], 3.0 + 0.5 * r + 0.25 * t) for r in (1, 2, 4, 8) for t in (1, 6, 20)]
    assert fit_linear(samples) == pytest.approx([3.0, 0.5, 0.25])


def test_call_overhead_is_what_a_served_request_took_beyond_prefill_and_passes():
    from bench.costs import call_ms

    costs = {"verify_pass": {"base_ms": 10.0, "row_ms": 2.0, "token_ms": 1.0}, "prefill": {"base_ms": 5.0,
                                                                                          "token_ms": 0.1}}
    # a prefill of 50 tokens (10 ms) and 9 passes of 13 ms, 10 calls of 4 ms
    served = [{"ms": 10 + 9 * 13 + 10 * 4, "passes": 10, "prompt_tokens": 50}] * 3
    assert call_ms(served, costs) == pytest.approx(4.0)
    # a one-row, one-token pass measured off the fit (its own path): the measurement counts
    costs["verify_pass"]["measured"] = [{"rows": 1, "tokens": 1, "ms": 9.0}, {"rows": 2, "tokens": 2, "ms": 16.0}]
    served = [{"ms": 10 + 9 * 9 + 10 * 4, "passes": 10, "prompt_tokens": 50}] * 3
    assert call_ms(served, costs) == pytest.approx(4.0)


COSTS_FILE = {
    "verify_pass": {"base_ms": 10.0, "row_ms": 2.0, "token_ms": 1.0},
    "prefill": {"base_ms": 5.0, "token_ms": 0.1}, "call_ms": 1.0, "draft_token_ms": {"pld": 0.1},
    "acceptance": {"pld": {DOMAIN: {"rounds": [[4, 2], [0, 0]], "reuse_rate": 0.5}}},
    "questions": [{"domain": DOMAIN, "prompt_tokens": 20, "output_tokens": 31}],
}


def test_simulate_command(tmp_path, capsys):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(COSTS_FILE))
    assert load_costs(path).profiles["pld"][DOMAIN].rounds == ((4, 2), (0, 0))
    out = tmp_path / "sim.json"
    assert cli_main(["simulate", "--costs", str(path), "--drafter", "pld", "--clients", "1", "2", "--requests", "4",
                     "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["config"]["clients"] for r in report["results"]] == [1, 2]
    assert "| verifiers |" in capsys.readouterr().out
    assert cli_main(["simulate", "--costs", str(path), "--drafter", "pld", "--grid", "--verifiers", "1", "2",
                     "--pools", "1", "2", "--requests-per-client", "1", "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())["grid"]) == 4
    assert cli_main(["simulate", "--costs", str(path), "--drafter", "pld", "--clients", "1", "--requests", "2",
                     "--repeats", "1", "--pool-link-ms", "5", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["config"]["pool_link_ms"] == 5.0


def test_simulate_command_errors(tmp_path, capsys):
    assert cli_main(["simulate"]) == 2
    assert "--costs" in capsys.readouterr().err
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(COSTS_FILE))
    assert cli_main(["simulate", "--costs", str(path), "--drafter", "small-general"]) == 2
    assert "no measured acceptance" in capsys.readouterr().err
    assert cli_main(["simulate", "--costs", str(path), "--pools", "0"]) == 2
    assert "--pools" in capsys.readouterr().err
    assert cli_main(["simulate", "--costs", str(path), "--drafter", "pld", "--pool-link-ms", "-1"]) == 2
    assert "--pool-link-ms" in capsys.readouterr().err


def test_validation_reads_what_the_served_sides_did_between_two_scrapes():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from validate_simulator import COUNTERS, served_sides

    before = dict.fromkeys(COUNTERS, 0.0) | {"passes": 4, "pass_s": 0.5, "rows": 4}
    after = {"passes": 14, "pass_s": 1.7, "rows": 36, "tokens": 72, "proposals": 20, "propose_s": 0.3}
    assert served_sides(before, after) == {"passes": 10, "mean_batch_rows": 3.2, "row_tokens": 2.25,
                                           "pass_ms": 120.0, "propose_ms": 15.0}
    # services that do not count their tokens: no tokens a row, not zero
    assert served_sides(before, after | {"tokens": 0.0})["row_tokens"] is None
    assert served_sides(before, before)["mean_batch_rows"] is None  # no pass: nothing to divide


def test_validation_fits_the_costs_the_served_sides_showed_in_an_earlier_run():
    """--fit-served: the pass cost fitted to the served passes, a draft token from the lone
    client's proposals, and the call overhead that makes the lone client as fast as measured."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from validate_simulator import DRAFT_LENGTH, fitted_to_served

    in_process = {"verify_pass": {"base_ms": 10.0, "row_ms": 2.0, "token_ms": 1.0},
                  "prefill": {"base_ms": 5.0, "token_ms": 0.1}, "call_ms": 1.0, "draft_token_ms": {"d": 2.0},
                  "acceptance": {"d": {DOMAIN: {"rounds": [[5, 3]]}}},
                  "questions": [{"domain": DOMAIN, "prompt_tokens": 20, "output_tokens": 64}]}
    served = {**in_process, "verify_pass": {"base_ms": 40.0, "row_ms": 12.0, "token_ms": 1.0}, "call_ms": 3.0,
              "draft_token_ms": {"d": 4.0}}

    def cfg(level: dict) -> SimConfig:
        return config(pools=level["pools"], clients=level["clients"], draft_length=DRAFT_LENGTH, rate=0.5,
                      requests=6, max_tokens=64)

    def level(clients: int, rows: float, row_tokens: float | None = None) -> dict:
        tokens = 1 + DRAFT_LENGTH if row_tokens is None else row_tokens  # without the count: a full chain
        return {"pools": 1, "clients": clients, "measured_mean_batch_rows": rows, "measured_row_tokens": row_tokens,
                "measured_pass_ms": 40.0 + 12.0 * rows + 1.0 * tokens * rows,
                "measured_propose_ms": 4.0 * DRAFT_LENGTH,
                "measured_tokens_per_s": replicate(costs_from_dict(served), cfg({"pools": 1, "clients": clients}),
                                                   3)["tokens_per_s"]}

    earlier = {"command": "earlier", "rows": [level(1, 1.0), level(8, 2.5)]}
    fitted = fitted_to_served(in_process, earlier, "d", cfg, 3)
    assert fitted["verify_pass"]["base_ms"] == pytest.approx(40.0)
    assert fitted["verify_pass"]["row_ms"] == pytest.approx(12.0)
    # rows of a lookup drafter score fewer tokens (often the root alone): the verifier's count of
    # them, not a full chain, comes out of the fit
    short = fitted_to_served(in_process, {"command": "x", "rows": [level(1, 1.0, 1.2), level(8, 2.5, 1.5)]},
                             "d", cfg, 3)
    assert short["verify_pass"]["base_ms"] == pytest.approx(40.0)
    assert short["verify_pass"]["row_ms"] == pytest.approx(12.0)
    assert fitted["draft_token_ms"] == {"d": 4.0}
    assert fitted["call_ms"] == pytest.approx(3.0, abs=0.1)
    assert fitted["fitted_to_served"]["call_ms_in_process"] == 1.0
    with pytest.raises(SystemExit, match="two load levels"):
        fitted_to_served(in_process, {"command": "x", "rows": [level(1, 1.0)]}, "d", cfg, 3)


def test_netns_validation_simulates_each_level_behind_its_own_delay():
    """scripts/netns_validate.py: the served configuration drafts every round on the pool, and each
    delay's measured levels are set beside a simulation whose pool link is that delay."""
    import sys
    from argparse import Namespace
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from netns_validate import rows_at_delays, sections

    tree = sections(2, "small-general", [0, 1])
    assert tree["router"]["verifier_drafting"] is False and tree["router"]["adaptive"] is False
    assert tree["drafter_pools"] == {"count": 2, "kinds": ["small-general"], "threads": 1, "cores": [1]}

    args = Namespace(drafter="d", rate=None, requests=4, max_tokens=64, sim_repeats=2)
    level = {"clients": 1, "tokens_per_s": 10.0, "errors": 0, "p50_s": 1.0, "p99_s": 1.0, "tokens_per_pass": 3.0,
             "served": {"passes": 1, "mean_batch_rows": 1.0, "pass_ms": 20.0, "propose_ms": 8.0}}
    loads = {(0.0, 1): {1: {"results": [level]}}, (5.0, 1): {1: {"results": [level]}},
             (0.0, 2): {1: {"results": [level | {"clients": 2}]}}}
    rows = rows_at_delays(args, costs(rounds=((4, 2),), output=64), loads, {0.0: (0.1, 0.1), 5.0: (10.2, 10.1)})
    assert [(r["delay_ms"], r["rtt_ms"], r["verifiers"]) for r in rows] == [(0.0, 0.1, 1), (0.0, 0.1, 2),
                                                                           (5.0, 10.2, 1)]
    near, two, far = rows
    # two verifiers: two clients' requests each on its own (a row a pass), as the router spreads them
    assert two["simulated_mean_batch_rows"] == pytest.approx(1.0)
    two_tree = sections(1, "pld", [0, 1], verifiers=2)
    assert two_tree["verifiers"]["count"] == 2 and two_tree["verifiers"]["cores"] == [0, 1]
    # one client, closed loop, rounds in sequence: each round (one pool call) 2 x 5 ms longer
    rounds_a_request = near["simulated_passes"] / args.requests
    assert far["simulated_p50_s"] - near["simulated_p50_s"] == pytest.approx(rounds_a_request * 0.010, abs=1e-3)
    assert far["simulated_tokens_per_s"] < near["simulated_tokens_per_s"] and far["error"] < near["error"]
