"""`specserve bench` end to end on a small scale: the report's shape and sums."""

from __future__ import annotations

import json

from cluster.cli import main as cli_main
from conftest import DEV_QUESTIONS

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
    assert rows[("ar", "overall")]["acceptance_rate"] is None  # nothing drafted
    assert 0 <= rows[("small-general", "overall")]["acceptance_rate"] <= 1  # a model drafter always drafts
    markdown = out.with_suffix(".md").read_text()
    assert "| overall |" in markdown and "acceptance rate" in markdown
    assert "overall" in capsys.readouterr().out
    png = out.with_suffix(".png").read_bytes()  # the speedup chart
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000


def test_bench_rejects_unknown_modes(capsys):
    assert cli_main(["bench", "--questions", str(DEV_QUESTIONS), "--modes", "warp", "--out", "x.json"]) == 2
    assert "--modes" in capsys.readouterr().err
    # `auto` (the server's routing) exists only served
    assert cli_main(["bench", "--questions", str(DEV_QUESTIONS), "--modes", "auto", "--out", "x.json"]) == 2
    assert "unknown mode(s) auto" in capsys.readouterr().err
    assert cli_main(["bench", "--questions", str(DEV_QUESTIONS), "--modes", "served-auto", "--out", "x.json"]) == 2
    assert "--server" in capsys.readouterr().err  # known, but it needs a server


def test_draft_token_cost_is_measured_against_a_target_forward(smollm2):
    from bench.harness import draft_token_ms
    from cluster.local import LocalEngine

    cost = draft_token_ms(LocalEngine(*smollm2), ["small-general"], target_ms=40.0, repeats=3)
    assert 0 < cost["small-general"]["ms"] < 40.0
    assert abs(cost["small-general"]["ratio_to_target_forward"] - cost["small-general"]["ms"] / 40.0) < 2e-3
