"""`specserve bench` end to end on a small scale: the report's shape and sums."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from commands.cli import main as cli_main
from conftest import DEV_QUESTIONS
from drafter_service.pool import DrafterPool
from http_front import http_front
from loopback import loopback
from router.servicer import RouterConfig, RouterServicer
from router.servicer import serve as serve_router
from verifier_service.engine import VerifierEngine

CATEGORIES = ["translation", "summarization", "qa", "math_reasoning", "rag", "mt_bench"]


def test_bench_reports_every_category_and_mode(tmp_path, capsys):
    out = tmp_path / "bench.json"
    modes = ("hf-ar", "ar", "small-general")
    argv = ["bench", "--questions", str(DEV_QUESTIONS), "--limit-per-category", "1", "--max-tokens", "4",
            "--modes", *modes, "--out", str(out)]
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())
    rows = {(r["mode"], r["category"]): r for r in report["results"]}
    assert set(rows) == {(m, c) for m in modes for c in CATEGORIES + ["overall"]}
    for mode in modes:
        overall = rows[(mode, "overall")]
        assert overall["generated_tokens"] == sum(rows[(mode, c)]["generated_tokens"] for c in CATEGORIES)
        assert 0 < overall["generated_tokens"] <= 4 * len(CATEGORIES)
        assert overall["tokens_per_s"] > 0 and overall["speedup_vs_hf_ar"] > 0
    assert rows[("hf-ar", "overall")]["speedup_vs_hf_ar"] == 1.0
    assert rows[("ar", "overall")]["mean_accepted_tokens"] == 1.0
    assert report["identical_to_hf_ar"] == {"ar": "6/6", "small-general": "6/6"}
    assert report["departures_from_hf_ar"] == {}
    assert report["identical_to_ar"] == {"dtype": "float32", "small-general": "6/6"}
    assert rows[("ar", "overall")]["acceptance_rate"] is None  # nothing drafted
    assert 0 <= rows[("small-general", "overall")]["acceptance_rate"] <= 1  # a model drafter always drafts
    markdown = out.with_suffix(".md").read_text()
    assert "| overall |" in markdown and "acceptance rate" in markdown
    assert "Outputs identical to ar (float32): small-general 6/6" in markdown
    assert "overall" in capsys.readouterr().out
    png = out.with_suffix(".png").read_bytes()  # the speedup chart
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000


def test_bench_runs_without_the_openai_package():
    """openai is a test extra: only the HTTP modes need it, and say so when it is missing."""
    code = ("import sys; sys.modules['openai'] = None\n"
            "import bench.harness\n"
            "from bench.http_client import HttpClient\n"
            "try:\n    HttpClient('http://127.0.0.1:1')\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'openai" in out.stdout


def test_bench_rejects_unknown_modes(capsys):
    assert cli_main(["bench", "--questions", str(DEV_QUESTIONS), "--modes", "warp", "--out", "x.json"]) == 2
    assert "--modes" in capsys.readouterr().err
    # `auto` (the server's routing) exists only served
    assert cli_main(["bench", "--questions", str(DEV_QUESTIONS), "--modes", "auto", "--out", "x.json"]) == 2
    assert "unknown mode(s) auto" in capsys.readouterr().err
    assert cli_main(["bench", "--questions", str(DEV_QUESTIONS), "--modes", "served-auto", "--out", "x.json"]) == 2
    assert "--server" in capsys.readouterr().err  # known, but it needs a server


def test_served_modes_name_the_eagle_placement(capsys):
    from bench.harness import eagle_placement, local_mode, served_drafter

    assert [served_drafter("served-eagle@pool"), eagle_placement("served-eagle@pool"),
            local_mode("served-eagle+pld+suffix@verifier")] == ["eagle", "pool", "eagle+pld+suffix"]
    assert eagle_placement("served-eagle") == "" and served_drafter("eagle") is None
    for bad in ("served-eagle@gpu", "eagle@pool", "http-eagle@pool"):  # a placement is a gRPC request field
        assert cli_main(["bench", "--questions", str(DEV_QUESTIONS), "--modes", bad, "--out", "x.json"]) == 2
        assert f"unknown mode(s) {bad}" in capsys.readouterr().err
    assert cli_main(["bench", "--questions", str(DEV_QUESTIONS), "--modes", "served-eagle@pool", "--out", "x.json"]) == 2
    assert "--server" in capsys.readouterr().err  # known, but it needs a server


@pytest.mark.parametrize("modes, extra, field", [
    (["http-pld"], [], "--http"),  # the http-* modes need --http; served-* ones --server
    (["http-auto", "served-none"], ["--http", "http://127.0.0.1:1"], "--server"),
    (["http-none"], ["--server", "127.0.0.1:1"], "--http"),
    (["http-pld"], ["--http", "127.0.0.1:8000"], "--http"),  # a URL, not HOST:PORT
])
def test_served_modes_name_the_flag_they_need(modes, extra, field, capsys):
    assert cli_main(["bench", "--questions", str(DEV_QUESTIONS), "--modes", *modes, *extra, "--out", "x.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"specserve: error: {field}:"), err


def test_an_unreachable_server_is_one_line_naming_its_flag(capsys):
    # the served modes' warm-up comes before loading the model: a wrong address fails at once
    argv = ["bench", "--questions", str(DEV_QUESTIONS), "--limit-per-category", "1", "--modes", "ar", "http-pld",
            "--http", "http://127.0.0.1:1", "--out", "x.json"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("specserve: error: --http http://127.0.0.1:1: the warm-up request of mode http-pld"), err


@pytest.fixture(scope="module")
def served(smollm2):
    """(HOST:PORT, http://HOST:PORT): a real router over a real pool (pld) and verifier serving
    the default target over gRPC on loopback, and an OpenAI-compatible HTTP front to it
    (tests/http_front.py: not the Ray Serve ingress, whose start would cost minutes)."""
    model, tokenizer = smollm2
    pool, engine = DrafterPool(model, kinds=["pld"]), VerifierEngine(model, max_batch=4, max_len=2048)
    config = RouterConfig(context_length=model.config.max_position_embeddings,
                          eos_token_ids=list(tokenizer.eos_token_ids or model.config.eos_token_ids),
                          vocab_size=model.config.vocab_size, default_drafter="pld", draft_length=5,
                          adaptive=False, pipelined=False)
    with loopback(pool, engine) as coordinator:
        router, port = serve_router(RouterServicer(tokenizer, coordinator, config), "127.0.0.1", 0)
        with http_front(f"127.0.0.1:{port}") as url:
            yield f"127.0.0.1:{port}", url
        router.stop(None)


SHORT_QUESTIONS = [  # short prompts keep the six modes' prefills cheap
    {"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]},
    {"question_id": 2, "category": "translation", "turns": ["Translate to German: the cat sleeps."]},
]


def test_in_process_grpc_and_http_on_the_same_prompts(served, tmp_path, monkeypatch):
    """One run: a drafter in process, over gRPC and over HTTP, the same outputs on the same
    prompts, and the overhead table of each API per request. (No hf-ar here: loading it costs
    more than the rest; the in-process modes' agreement with it is tested above.)"""
    from bench import harness
    from cluster.local import LocalEngine

    outputs: dict[str, list] = {}
    served_run, local_run = harness.ServedRunner.run, LocalEngine.run

    def record_served(self, prompt, params, mode, namespace=""):
        result = served_run(self, prompt, params, mode, namespace)
        outputs.setdefault(mode, []).append(result[0])
        return result

    def record_local(self, request, *args, **kwargs):
        result = local_run(self, request, *args, **kwargs)
        outputs.setdefault({"none": "ar"}.get(request.drafter, request.drafter), []).append(result.token_ids)
        return result

    monkeypatch.setattr(harness.ServedRunner, "run", record_served)
    monkeypatch.setattr(LocalEngine, "run", record_local)
    server, url = served
    questions, out = tmp_path / "q.jsonl", tmp_path / "bench.json"
    questions.write_text("".join(json.dumps(q) + "\n" for q in SHORT_QUESTIONS))
    modes = ("ar", "pld", "served-ar", "served-pld", "http-none", "http-pld")
    assert cli_main(["bench", "--questions", str(questions), "--limit-per-category", "1", "--max-tokens", "6",
                     "--modes", *modes, "--server", server, "--http", url, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(outputs) == set(modes) and all(len(o) == 2 for o in outputs.values())
    assert all(outputs[m] == outputs["ar"] for m in modes)  # greedy and lossless, whatever the API
    overall = {r["mode"]: r for r in report["results"] if r["category"] == "overall"}
    assert overall["http-none"]["mean_accepted_tokens"] == 1.0  # plain decoding, served over HTTP
    assert overall["http-pld"]["generated_tokens"] == overall["pld"]["generated_tokens"]
    assert set(report["served_overhead_ms_per_round"]) == {"served-ar", "served-pld", "http-none", "http-pld"}
    rows = {r["drafter"]: r for r in report["overhead_per_request"]}
    assert set(rows) == {"ar", "pld"}
    assert rows["ar"]["modes"] == {"in_process": "ar", "grpc": "served-ar", "http": "http-none"}
    for r in rows.values():
        assert r["requests"] == 2 and all(r[f"{api}_s"] > 0 for api in ("in_process", "grpc", "http"))
        assert r["grpc_minus_in_process_ms"] is not None and r["http_minus_grpc_ms"] is not None
    markdown = out.with_suffix(".md").read_text()
    assert "| pld / served-pld / http-pld | 2 |" in markdown


def test_overhead_is_the_median_of_per_prompt_differences():
    from bench.harness import api_overhead

    rows = api_overhead({"hf-ar": [9.0] * 3, "pld": [1.0, 2.0, 3.0], "served-pld": [1.1, 2.5, 3.2],
                         "http-pld": [1.2, 2.6, 4.2], "pipelined-pld": [0.5] * 3, "served-auto": [2.0] * 3,
                         "http-auto": [2.5, 2.1, 2.2], "suffix": [1.0] * 3})
    by = {r["drafter"]: r for r in rows}
    assert set(by) == {"pld", "auto"}  # suffix: in process only; pipelined-*: not one request's overhead
    pld = by["pld"]
    assert (pld["in_process_s"], pld["grpc_s"], pld["http_s"]) == (2.0, 2.5, 2.6)
    assert pld["grpc_minus_in_process_ms"] == 200.0  # differences 100, 500, 200 ms
    assert pld["http_minus_grpc_ms"] == 100.0  # differences 100, 100, 1000 ms
    assert by["auto"]["in_process_s"] is None and by["auto"]["grpc_minus_in_process_ms"] is None
    assert by["auto"]["http_minus_grpc_ms"] == 200.0


def test_draft_token_cost_is_measured_against_a_target_forward(smollm2):
    from bench.harness import draft_token_ms
    from cluster.local import LocalEngine

    cost = draft_token_ms(LocalEngine(*smollm2), ["small-general"], target_ms=40.0, repeats=3)
    # (how it compares with a target forward is the bench's to measure, not a test's to time)
    assert cost["small-general"]["ms"] > 0
    assert abs(cost["small-general"]["ratio_to_target_forward"] - cost["small-general"]["ms"] / 40.0) < 2e-3


def test_a_departure_from_hf_ar_names_the_token_and_hfs_margin_there(smollm2):
    """Where an output leaves Hugging Face's, the bench says at which token and how far HF's
    own top choice was ahead of its second there (a near-tie when tiny)."""
    import torch

    from bench.harness import HFRunner, departure
    from runtime.loading import converted_gguf_dir, default_gguf_path
    from speculative.sampling import SamplingParams

    _, tokenizer = smollm2
    hf = HFRunner(converted_gguf_dir(default_gguf_path()))  # the GGUF's float32 weights, without converting them again
    ids = tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}])
    reference, _ = hf.run(ids, SamplingParams(max_tokens=8), "hf-ar")
    swapped = reference[:3] + [reference[3] + 1] + reference[4:]
    where = departure(hf, ids, swapped, reference)
    with torch.inference_mode():
        logits = hf.model(torch.tensor([ids + reference[:3]])).logits[0, -1]
    assert where["token"] == 3 and int(logits.argmax()) == reference[3]
    assert where["hf_top2_gap"] == pytest.approx(float(logits.max() - logits.topk(2).values[1]), abs=1e-5)
    assert where["hf_top2_gap"] > 0
    assert departure(hf, ids, reference[:5], reference)["token"] == 5  # ours stopped early: HF's margin there
    assert departure(hf, ids, reference + [7], reference) == {"token": len(reference), "hf_top2_gap": None}


def test_departures_a_mode_shares_with_an_earlier_one_are_not_listed_twice():
    from bench.harness import _footnotes

    where = [{"question": 0, "category": "qa", "token": 7, "hf_top2_gap": 2e-5}]
    notes = _footnotes({"departures_from_hf_ar": {"ar": where, "pld": where, "suffix": [{**where[0], "token": 9}]}})
    assert notes == ["Where ar leaves hf-ar (token, HF's top-two logit gap there): qa 7 (2.0e-05)",
                     "Where pld leaves hf-ar (token, HF's top-two logit gap there): as ar",
                     "Where suffix leaves hf-ar (token, HF's top-two logit gap there): qa 9 (2.0e-05)"]


def test_structured_bench_keeps_plain_decodings_tokens_and_counts_forced_ones(tmp_path):
    """`bench --workload tools`: a required tool call; pld under the grammar emits plain decoding's
    tokens, the grammar forces some (the call's opening), and the mask's cost is reported."""
    out = tmp_path / "tools.json"
    argv = ["bench", "--questions", str(DEV_QUESTIONS), "--workload", "tools", "--limit-per-category", "1",
            "--max-tokens", "12", "--modes", "ar", "pld", "--out", str(out)]
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())
    plain, pld = report["modes"]["none"], report["modes"]["pld"]
    assert report["prompts"] == 6 and pld["same_as_plain"] == 6
    assert plain["forced"] > 0 and plain["passes"] < plain["tokens"]  # forced tokens cost no pass of their own
    assert report["mask_per_token"]["median_ms"] > 0 and report["mask_per_tree_node"]["median_ms"] > 0


def test_structured_outputs_are_judged_by_jsonschema_not_by_the_grammar():
    from bench.structured import valid

    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
    assert valid("tools", call)
    assert not valid("tools", call.replace('"expression"', '"formula"'))  # no such parameter
    assert not valid("tools", call.replace("calculator", "abacus"))
    answer = {"category": "math", "answer": "Four.", "key_terms": ["sum"]}
    assert valid("extraction", json.dumps(answer))
    assert not valid("extraction", json.dumps({**answer, "category": "astrology"}))
    assert not valid("extraction", json.dumps(answer)[:-1])  # cut off


@pytest.mark.parametrize("extra,field", [(["--modes", "hf-ar"], "modes"), (["--temperature", "0.7"], "temperature")])
def test_structured_bench_refuses_what_it_cannot_run(extra, field, capsys):
    argv = ["bench", "--questions", str(DEV_QUESTIONS), "--workload", "extraction", "--out", "x.json", *extra]
    assert cli_main(argv) == 2
    assert field in capsys.readouterr().err
