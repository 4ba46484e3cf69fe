"""`specserve bench` end to end on a small scale: the report's shape and sums."""

from __future__ import annotations

import json

from cluster.cli import main as cli_main
from conftest import DEV_QUESTIONS

CATEGORIES = ["translation", "summarization", "qa", "math_reasoning", "rag", "mt_bench"]


def test_bench_reports_every_category_and_mode(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--questions", str(DEV_QUESTIONS), "--limit-per-category", "1", "--max-tokens", "4",
            "--modes", "ar", "pld", "--out", str(out)]
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())
    rows = {(r["mode"], r["category"]): r for r in report["results"]}
    assert set(rows) == {(m, c) for m in ("ar", "pld") for c in CATEGORIES + ["overall"]}
    for mode in ("ar", "pld"):
        overall = rows[(mode, "overall")]
        assert overall["generated_tokens"] == sum(rows[(mode, c)]["generated_tokens"] for c in CATEGORIES)
        assert 0 < overall["generated_tokens"] <= 4 * len(CATEGORIES)
        assert overall["tokens_per_s"] > 0 and overall["speedup_vs_hf_ar"] is None  # no hf-ar in this run
    assert rows[("ar", "overall")]["mean_accepted_tokens"] == 1.0
    assert report["identical_to_hf_ar"] == {}
    assert "| overall |" in out.with_suffix(".md").read_text()
    assert "overall" in capsys.readouterr().out


def test_bench_rejects_unknown_modes(capsys):
    assert cli_main(["bench", "--questions", str(DEV_QUESTIONS), "--modes", "warp", "--out", "x.json"]) == 2
    assert "--modes" in capsys.readouterr().err
