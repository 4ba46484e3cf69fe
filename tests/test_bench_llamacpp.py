"""llama.cpp beside us in `specserve bench` (`llamacpp-ar`, `llamacpp-pld`): the clear error
without the optional extra, and, where llama-cpp-python is installed, a small real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.llamacpp import LlamaCppRunner, agreement, agreement_lines, built_with_amx
from commands.cli import main as cli_main
from cluster.local import cpu_cores
from conftest import DEV_QUESTIONS
from runtime.loading import default_gguf_path
from speculative.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
# the CLI in a fresh interpreter where `import llama_cpp` fails, as it does without the extra
WITHOUT_LLAMA_CPP = ("import sys; sys.modules['llama_cpp'] = None; from commands.cli import main; "
                     "sys.exit(main(sys.argv[1:]))")


def needs_llama_cpp() -> None:
    """Skip unless llama-cpp-python is installed without AMX (the bench refuses that build:
    its AMX kernels segfault on this model, llama.cpp #20824)."""
    pytest.importorskip("llama_cpp")
    if built_with_amx():
        pytest.skip("llama-cpp-python built with AMX; rebuild it without (docs/CLI.md)")


def test_without_the_extra_the_bench_says_how_to_install_it_before_any_work(tmp_path):
    out = tmp_path / "bench.json"
    # questions that do not exist: had the bench started any work, it would fail on them instead
    argv = ["bench", "--questions", str(tmp_path / "missing.jsonl"), "--modes", "ar", "llamacpp-ar",
            "llamacpp-pld", "--out", str(out)]
    done = subprocess.run([sys.executable, "-c", WITHOUT_LLAMA_CPP, *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("specserve: error: --modes: llamacpp-ar, llamacpp-pld: llama-cpp-python is not "
                          "installed"), err
    assert "pip install 'specserve[llamacpp]'" in err and "compiles llama.cpp" in err
    assert not out.exists()


def test_agreement_counts_leading_equal_tokens_per_question():
    reference = [[5, 6, 7, 2], [9, 9]]
    outputs = {"llamacpp-ar": [[5, 6, 8, 2], [9, 9]], "llamacpp-pld": [[4, 6, 7, 2], [9, 9, 3]]}
    agree = agreement(reference, outputs, ["qa", "rag"])
    assert agree["per_question"] == [{"category": "qa", "reference_tokens": 4, "llamacpp-ar": 2, "llamacpp-pld": 0},
                                      {"category": "rag", "reference_tokens": 2, "llamacpp-ar": 2,
                                       "llamacpp-pld": 2}]  # a longer output is not identical
    assert agree["identical"] == {"llamacpp-ar": "1/2", "llamacpp-pld": "0/2"}
    lines = agreement_lines({"llamacpp": {"agreement_with_ours": {
        "reference_mode": "ar", "reference_dtype": "float32", **agree}}})
    assert "| 1 | qa | 2/4 | 0/4 |" in lines and "| identical | | 1/2 | 0/2 |" in lines


def test_prompt_lookup_takes_a_context_past_llama_cpps_batch(tmp_path):
    """llama-cpp-python sizes its logits buffer by n_batch (512) unless told to keep every
    position's logits; prompt lookup needs them all (a long prompt failed on a second question)."""
    needs_llama_cpp()
    ids = list(range(100, 700))  # 600 prompt tokens
    runner = LlamaCppRunner(default_gguf_path(), ["llamacpp-pld"], n_ctx=1024, n_threads=1, pld_tokens=3, eos=[])
    for _ in range(2):
        tokens, _, passes, _ = runner.run(ids, SamplingParams(max_tokens=4), "llamacpp-pld")
        assert len(tokens) == 4 and passes >= 2


def test_llamacpp_modes_are_greedy_only(tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    argv = ["bench", "--questions", str(DEV_QUESTIONS), "--modes", "llamacpp-ar", "--temperature", "0.7",
            "--out", str(tmp_path / "bench.json")]
    assert cli_main(argv) == 2
    assert capsys.readouterr().err.startswith("specserve: error: --temperature: must be 0 with llamacpp-ar")


def test_llamacpp_modes_run_beside_ours_and_agree_with_ar(tmp_path):
    needs_llama_cpp()
    question = json.loads(DEV_QUESTIONS.read_text().splitlines()[0])
    questions = tmp_path / "one.jsonl"
    questions.write_text(json.dumps(question) + "\n")
    out = tmp_path / "bench.json"
    modes = ("ar", "llamacpp-ar", "llamacpp-pld")
    argv = ["bench", "--questions", str(questions), "--limit-per-category", "1", "--max-tokens", "16",
            "--modes", *modes, "--out", str(out)]
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["results"] if r["category"] == "overall"}
    assert set(rows) == set(modes)
    for mode in modes:
        assert 0 < rows[mode]["generated_tokens"] <= 16 and rows[mode]["tokens_per_s"] > 0
    assert rows["llamacpp-ar"]["mean_accepted_tokens"] == 1.0  # one token a pass: plain decoding
    assert rows["llamacpp-pld"]["mean_accepted_tokens"] >= 1.0

    llama = report["llamacpp"]
    # our thread count: what the bench gave torch, every core this process may use
    assert llama["n_threads"] == llama["n_threads_batch"] == torch.get_num_threads() == cpu_cores()
    assert llama["gguf"].endswith(".gguf") and llama["pld_num_pred_tokens"] == report["draft_length"]
    agree = llama["agreement_with_ours"]
    assert agree["reference_mode"] == "ar" and agree["reference_dtype"] == "float32"
    [q] = agree["per_question"]
    assert q["reference_tokens"] == rows["ar"]["generated_tokens"]
    # the same weights (ours are the GGUF's, dequantized): their first tokens agree
    assert q["llamacpp-ar"] >= 8 and q["llamacpp-pld"] >= 8, q
    identical = q["llamacpp-ar"] == q["reference_tokens"] == rows["llamacpp-ar"]["generated_tokens"]
    assert agree["identical"]["llamacpp-ar"] == f"{int(identical)}/1"
    markdown = out.with_suffix(".md").read_text()
    assert "| question | category | llamacpp-ar | llamacpp-pld |" in markdown
    assert llama["pld_identical_to_ar"] in ("0/1", "1/1")
    assert f"llamacpp-pld's outputs identical to llamacpp-ar's: {llama['pld_identical_to_ar']}" in markdown
    assert f"| 1 | {report['results'][0]['category']} | {q['llamacpp-ar']}/{q['reference_tokens']} |" in markdown


def test_the_structured_workloads_grammars_hold_llama_cpps_own_structure():
    """`bench --workload ... --modes llamacpp-ar`: llama.cpp decodes under the GBNF made of the
    same schemas (its JSON-schema converter, in a <tool_call> block for tools), which its
    grammar parser takes."""
    needs_llama_cpp()
    from llama_cpp import LlamaGrammar

    from bench.structured import EXTRACTION_SCHEMA, TOOLS, gbnf
    from router.tools import call_schema, functions

    for workload, schema in (("extraction", EXTRACTION_SCHEMA), ("tools", call_schema(functions(TOOLS)))):
        text = gbnf(workload, schema)
        LlamaGrammar.from_string(text, verbose=False)  # compiles
        assert text.startswith('root ::= "<tool_call>\\n" call') == (workload == "tools")
