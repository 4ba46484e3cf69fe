"""Where the runtime keeps what it makes once: converted models, compiled kernels,
distillation data."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache directory: `cache_dir`, or ~/.cache/specserve when that is None or empty."""
    return Path(cache_dir) if cache_dir else Path.home() / ".cache" / "specserve"
