"""bench/chart.py on hand-made reports: a PNG when there is a speedup to draw, nothing otherwise."""

from __future__ import annotations

from bench.chart import write_chart

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(mode: str, category: str, speedup: float | None) -> dict:
    return {"mode": mode, "category": category, "tokens_per_s": 20.0 * (speedup or 1.0),
            "speedup_vs_hf_ar": speedup, "generated_tokens": 128}


def test_chart_is_a_png_of_every_mode_but_hf_ar(tmp_path):
    results = [row(mode, cat, speedup) for cat in ("translation", "qa", "overall")
               for mode, speedup in (("hf-ar", 1.0), ("ar", 1.03), ("pld", 1.35))]
    path = tmp_path / "bench.png"
    write_chart({"max_tokens": 128, "draft_length": 5, "results": results}, path)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_no_hf_ar_no_chart(tmp_path):
    path = tmp_path / "bench.png"
    write_chart({"max_tokens": 4, "draft_length": 5, "results": [row("ar", "overall", None)]}, path)
    assert not path.exists()
