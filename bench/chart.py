"""A PNG of a `specserve bench` report: speedup vs hf-ar per category and mode.

The Markdown table has the numbers; the chart is there to see at a glance
which modes beat plain decoding where.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402


def write_chart(report: dict, path: Path) -> None:
    """Grouped bars (x: categories, "overall" last; one bar per mode) of speedup vs hf-ar.

    hf-ar itself is the dashed line at 1.0. Without hf-ar in the run there is
    no speedup to draw, and nothing is written."""
    rows = [r for r in report["results"] if r.get("speedup_vs_hf_ar") is not None and r["mode"] != "hf-ar"]
    if not rows:
        return
    categories = list(dict.fromkeys(r["category"] for r in rows))
    if "overall" in categories:
        categories.remove("overall")
        categories.append("overall")
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    speedup = {(r["mode"], r["category"]): r["speedup_vs_hf_ar"] for r in rows}

    x = np.arange(len(categories))
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(max(7.0, len(categories) * (0.4 + 0.25 * len(modes))), 4.5))
    for i, mode in enumerate(modes):
        heights = [speedup.get((mode, c), np.nan) for c in categories]
        ax.bar(x - 0.4 + width * (i + 0.5), heights, width, label=mode)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="hf-ar")
    ax.set_xticks(x, categories, rotation=20, ha="right")
    ax.set_ylabel("speedup vs hf-ar")
    ax.set_title(f"specserve bench, max_tokens {report.get('max_tokens')}, "
                 f"draft length {report.get('draft_length')}")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside, not over, the bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
