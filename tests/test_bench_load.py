"""`specserve bench --load`: the Poisson schedule, the latency summary, and a
small run against a real router served over gRPC on loopback (drafter pool,
verifier and router in this process, a tiny target, no Ray); over HTTP through
a minimal OpenAI-compatible front to that router (tests/http_front.py: not the
Ray Serve ingress, whose start would cost minutes; the same protocol module)."""

from __future__ import annotations

import json
import random
import statistics

import numpy as np
import pytest

from bench import load
from bench.http_client import REQUEST_FAILED, HttpClient, HttpError
from bench.load import schedule, summarize
from commands.cli import main as cli_main
from conftest import DEV_QUESTIONS
from drafter_service.pool import DrafterPool
from fuzzing import CharTokenizer
from http_front import http_front
from loopback import loopback
from router.servicer import RouterConfig, RouterServicer
from router.servicer import serve as serve_router
from tiny import TINY, tiny_model
from verifier_service.engine import VerifierEngine

V = TINY.vocab_size
PROMPT_CHARS = 16  # the tiny target has 64 positions


@pytest.fixture(scope="module")
def server():
    """HOST:PORT of a real Specserve router whose default drafter is pld."""
    target = tiny_model(0)
    pool, engine = DrafterPool(target, kinds=["pld"]), VerifierEngine(target, max_batch=4, max_len=64)
    config = RouterConfig(context_length=TINY.max_position_embeddings - 12, eos_token_ids=[], vocab_size=V,
                          default_drafter="pld", draft_length=3, adaptive=False)
    with loopback(pool, engine) as coordinator:
        router, port = serve_router(RouterServicer(CharTokenizer(V, PROMPT_CHARS), coordinator, config), "127.0.0.1", 0)
        yield f"127.0.0.1:{port}"
        router.stop(None)


@pytest.fixture(scope="module")
def http_server(server):
    """http://HOST:PORT of an OpenAI-compatible front to `server`."""
    with http_front(server, model="tiny") as url:
        yield url


def test_schedule_is_seeded_and_shared_evenly_over_the_clients():
    arrivals = schedule(10, 4, 0.5, random.Random(3))
    assert arrivals == schedule(10, 4, 0.5, random.Random(3))
    assert arrivals != schedule(10, 4, 0.5, random.Random(4))
    assert [a.index for a in arrivals] == list(range(10))
    assert [a.at for a in arrivals] == sorted(a.at for a in arrivals)
    assert [sum(a.client == c for a in arrivals) for c in range(4)] == [3, 3, 2, 2]


@pytest.mark.parametrize("clients", [1, 4])
def test_each_clients_gaps_average_one_over_the_rate(clients):
    rate, n = 2.0, 40_000
    arrivals = schedule(n, clients, rate, random.Random(0))
    for c in range(clients):
        times = [0.0] + [a.at for a in arrivals if a.client == c]
        gaps = [b - a for a, b in zip(times, times[1:])]
        # exponential gaps: standard deviation of the mean is (1/rate)/sqrt(len): 5 sigma either way
        assert statistics.mean(gaps) == pytest.approx(1 / rate, abs=5 / rate / len(gaps) ** 0.5)
        assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.05)


def test_summary_of_known_latencies():
    s = summarize([float(x) for x in range(1, 101)], tokens=400, wall_s=8.0, errors=2)
    # numpy's linear interpolation: rank p/100 * (n - 1) between the sorted values
    assert s["p50_s"] == 50.5 and s["p99_s"] == pytest.approx(99.01) and s["mean_s"] == 50.5
    assert s["requests"] == 102 and s["errors"] == 2 and s["tokens_per_s"] == 50.0
    empty = summarize([], tokens=0, wall_s=1.0, errors=3)
    assert empty["p50_s"] is None and empty["p99_s"] is None and empty["requests"] == 3


@pytest.fixture
def replayed(monkeypatch) -> list:
    """(drafter, arrivals, prompts) of every (level, mode) run, as run_level got them; and
    each run's memory namespace in `namespaces`."""
    calls = []
    real_run_level = load.run_level

    def recording(client, arrivals, prompts, drafter, max_tokens, bar, namespace=""):
        calls.append((drafter, arrivals, prompts))
        namespaces.append(namespace)
        return real_run_level(client, arrivals, prompts, drafter, max_tokens, bar, namespace)

    namespaces = []
    recording.namespaces = namespaces

    monkeypatch.setattr(load, "run_level", recording)
    return calls


def test_load_run_against_a_real_router(server, replayed, tmp_path, capsys):
    out = tmp_path / "load.json"
    argv = ["bench", "--load", "--server", server, "--questions", str(DEV_QUESTIONS), "--limit-per-category", "1",
            "--clients", "1", "2", "--requests", "3", "--rate", "20", "--max-tokens", "4", "--out", str(out)]
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())
    assert report["command"] == "specserve " + " ".join(argv)
    rows = {(r["clients"], r["mode"]): r for r in report["results"]}
    assert list(rows) == [(1, "none"), (1, "auto"), (2, "none"), (2, "auto")]
    for (clients, mode), r in rows.items():
        assert r["requests"] == 3 and r["errors"] == 0
        assert r["generated_tokens"] == 3 * 4  # no end-of-sequence token: max_tokens each
        assert r["tokens_per_s"] > 0 and 0 < r["p50_s"] <= r["p99_s"]
        assert r["served_by"] == (["none"] if mode == "none" else ["pld"])  # auto: the server's default
        if mode == "none":  # plain decoding: one token a pass, nothing drafted
            assert r["tokens_per_pass"] == 1.0 and r["draft_tokens_per_token"] == 0.0
        else:
            assert r["tokens_per_pass"] >= 1.0 and r["draft_tokens_per_token"] >= 0.0
        assert (r["p99_ratio"] is None) == (mode == "none")
        # every request, in order of arrival; its latencies are the ones the percentiles summarise
        reqs = r["per_request"]
        assert [q["index"] for q in reqs] == [0, 1, 2] and all(q["tokens"] == 4 for q in reqs)
        assert [q["arrival_s"] for q in reqs] == sorted(q["arrival_s"] for q in reqs)
        assert {q["client"] for q in reqs} == set(range(clients))
        assert np.percentile([q["latency_s"] for q in reqs], 99) == pytest.approx(r["p99_s"], abs=2e-3)
        assert all(q["prompt_tokens"] > 0 and q["passes"] >= 1 and q["drafter"] == r["served_by"][0] for q in reqs)
        if mode == "auto":
            assert r["p99_ratio"] == pytest.approx(r["p99_s"] / rows[(clients, "none")]["p99_s"], abs=2e-3)
    # both modes of a level replay the same arrivals and prompts; the order of modes alternates
    assert [d for d, _, _ in replayed] == ["none", "", "", "none"]
    assert replayed[0][1:] == replayed[1][1:] and replayed[2][1:] == replayed[3][1:]
    assert {a.client for a in replayed[2][1]} == {0, 1}
    # each mode learns in its own memory namespace, the same across levels: one mode never
    # drafts the answers another gave to the same prompts
    spaces = load.run_level.namespaces
    assert spaces[0] == spaces[3] != spaces[1] == spaces[2] and all(spaces)
    assert report["api"] == "grpc" and {r["api"] for r in report["results"]} == {"grpc"}
    assert "| grpc | 2 | 1 | auto |" in out.with_suffix(".md").read_text()
    assert "Highest load (2 clients)" in capsys.readouterr().out


def test_repeated_load_runs_each_get_their_own_prompts_and_the_verdict_is_their_median(server, replayed,
                                                                                       tmp_path):
    out = tmp_path / "load.json"
    assert cli_main(["bench", "--load", "--server", server, "--questions", str(DEV_QUESTIONS),
                     "--limit-per-category", "2", "--clients", "2", "--requests", "2", "--repeats", "3",
                     "--rate", "20", "--max-tokens", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["run"], r["mode"]) for r in report["results"]] == [
        (run, mode) for run in (1, 2, 3) for mode in ("none", "auto")]
    # the modes of a run replay one schedule; runs differ in prompts (a learning server saw none) and arrivals
    assert [d for d, _, _ in replayed] == ["none", "", "", "none", "none", ""]
    runs = [replayed[i][1:] for i in (0, 2, 4)]
    assert runs[0] == replayed[1][1:] and runs[1] == replayed[3][1:] and runs[2] == replayed[5][1:]
    prompts = [p for _, ps in runs for p in ps]
    assert len(set(prompts)) == len(prompts) == 6
    assert runs[0][0] != runs[1][0] != runs[2][0]
    [median] = report["medians"]
    ratios = sorted(r["p99_ratio"] for r in report["results"] if r["mode"] == "auto")
    assert median["runs"] == 3 and median["p99_ratio"] == ratios[1]
    assert median["p99_ratio_range"] == [ratios[0], ratios[2]]
    assert f"p99 of auto / p99 of none = {ratios[1]:.2f}, median of 3 runs" in out.with_suffix(".md").read_text()


def test_a_mode_named_twice_runs_twice_and_its_second_run_is_compared_with_its_first(server, replayed, tmp_path):
    out = tmp_path / "load.json"
    assert cli_main(["bench", "--load", "--server", server, "--questions", str(DEV_QUESTIONS),
                     "--limit-per-category", "1", "--clients", "2", "--requests", "3", "--repeats", "2",
                     "--rate", "20", "--max-tokens", "4", "--load-modes", "none", "auto", "none",
                     "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["modes"] == ["none", "auto", "none#2"]
    rows = report["results"]
    assert [(r["run"], r["mode"]) for r in rows] == [(run, m) for run in (1, 2) for m in ("none", "auto", "none#2")]
    # the second none is plain decoding too, replaying the same arrivals, in a namespace of its own
    assert [d for d, _, _ in replayed] == ["none", "", "none", "none", "", "none"]
    assert replayed[0][1:] == replayed[1][1:] == replayed[2][1:]
    assert len(set(load.run_level.namespaces[:3])) == 3
    for r in rows:
        if r["mode"] == "none#2":
            assert r["served_by"] == ["none"] and r["tokens_per_pass"] == 1.0
            base = next(b for b in rows if b["run"] == r["run"] and b["mode"] == "none")
            assert r["p99_ratio"] == pytest.approx(r["p99_s"] / base["p99_s"], abs=2e-3)
    assert [m["mode"] for m in report["medians"]] == ["auto", "none#2"]
    assert "p99 of none#2 / p99 of none" in out.with_suffix(".md").read_text()


def test_the_http_client_gives_what_grpc_gives(server, http_server):
    """Same request, same tokens and usage: greedy by default (the HTTP API's own default
    is temperature 1), the drafter and namespace reach the router, the model is the listed one."""
    from specserve.client import Client

    messages = [{"role": "user", "content": "abcabcabcabc"}]
    with Client(server) as grpc_client, HttpClient(http_server, timeout=60) as http_client:
        for drafter in ("none", "pld", ""):
            want = grpc_client.generate(messages=messages, max_tokens=6, drafter=drafter, namespace="a")
            got = http_client.generate(messages=messages, max_tokens=6, drafter=drafter, namespace="b")
            assert got.token_ids == want.token_ids and len(got.token_ids) == 6
            for field in ("completion_tokens", "target_forward_passes", "draft_tokens", "accepted_draft_tokens",
                          "drafter"):
                assert getattr(got.usage, field) == getattr(want.usage, field), field
        assert http_client.model() == "tiny"
        with pytest.raises(HttpError) as e:  # the router refuses it: OpenAI's error shape, the status kept
            http_client.generate(messages=messages, max_tokens=2, drafter="warp")
        assert e.value.status == 400 and "warp" in e.value.message and isinstance(e.value, REQUEST_FAILED)
    with HttpClient("http://127.0.0.1:1", timeout=5) as nobody, pytest.raises(HttpError) as e:
        nobody.generate(messages=messages, max_tokens=2)  # no server: a failed request, no status
    assert e.value.status is None


def test_load_run_over_both_apis(server, http_server, replayed, tmp_path, capsys):
    """--server and --http: every run replays its arrivals and prompts through each API,
    each API and mode in a namespace of its own; ratios within an API."""
    out = tmp_path / "load.json"
    argv = ["bench", "--load", "--server", server, "--http", http_server, "--questions", str(DEV_QUESTIONS),
            "--limit-per-category", "1", "--clients", "1", "2", "--requests", "2", "--rate", "20",
            "--max-tokens", "4", "--out", str(out)]
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())
    assert report["api"] == "grpc+http" and report["http"] == http_server
    assert [(r["api"], r["clients"], r["mode"]) for r in report["results"]] == [
        (api, c, mode) for c in (1, 2) for api in ("grpc", "http") for mode in ("none", "auto")]
    for r in report["results"]:
        assert r["errors"] == 0 and r["generated_tokens"] == 2 * 4
        assert r["served_by"] == (["none"] if r["mode"] == "none" else ["pld"])
    # level 1: grpc none, auto, then http none, auto; level 2 reversed: http auto, none, grpc auto, none
    assert [d for d, _, _ in replayed] == ["none", "", "none", "", "", "none", "", "none"]
    assert all(call[1:] == replayed[0][1:] for call in replayed[:4])
    assert all(call[1:] == replayed[4][1:] for call in replayed[4:])
    spaces = load.run_level.namespaces
    assert len(set(spaces)) == 4 and spaces[:4] == spaces[4:][::-1]
    assert [(m["api"], m["clients"]) for m in report["medians"]] == [("grpc", 1), ("http", 1), ("grpc", 2),
                                                                      ("http", 2)]
    markdown = out.with_suffix(".md").read_text()
    assert "| http | 2 | 1 | auto |" in markdown and "OpenAI-compatible HTTP (" + http_server in markdown
    assert "Highest load (2 clients) over http" in capsys.readouterr().out


def test_a_server_that_fails_the_warm_up_names_the_flag(tmp_path, capsys):
    argv = ["bench", "--load", "--http", "http://127.0.0.1:1", "--questions", str(DEV_QUESTIONS),
            "--limit-per-category", "1", "--out", str(tmp_path / "x.json")]
    assert cli_main(argv) == 2
    assert capsys.readouterr().err.startswith("specserve: error: --http http://127.0.0.1:1: the warm-up request")


@pytest.mark.parametrize("args, field", [
    ([], "--server"),
    (["--http", "127.0.0.1:8000"], "--http"),
    (["--server", "127.0.0.1:1", "--clients", "1", "0"], "--clients"),
    (["--server", "127.0.0.1:1", "--rate", "0"], "--rate"),
    (["--server", "127.0.0.1:1", "--requests", "0"], "--requests"),
    (["--server", "127.0.0.1:1", "--repeats", "0"], "--repeats"),
    (["--server", "127.0.0.1:1", "--load-modes", "none", "warp"], "--load-modes"),
])
def test_load_rejects_bad_input_naming_the_field(args, field, capsys):
    assert cli_main(["bench", "--load", "--questions", str(DEV_QUESTIONS), "--out", "x.json", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"specserve: error: {field}:"), err
