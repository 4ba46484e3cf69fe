"""Where the online learner publishes improved drafters and where pools find them.

A published checkpoint is a drafter directory (drafter_service/checkpoint.py) under
`root`/<kind>/v<version>, which every pool must be able to read (a shared disk or a
mounted object store), and a record {"version", "path", ...} in the state store
(`publish_drafter`/`published_drafter`), which every pool reads at most every
`refresh_s` seconds. Versions count up from 1 per drafter kind; 0 is the shipped one.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Any, Callable

from runtime.model import Transformer

from .checkpoint import load_drafter, save_drafter


class PublishedDrafters:
    def __init__(self, root: str | Path, store, refresh_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        """`store`: a cluster.state.StateStore (duck-typed: drafter_service does not import cluster)."""
        self.root, self.store, self.refresh_s, self.clock = Path(root), store, refresh_s, clock
        self._seen: dict[str, tuple[float, dict[str, Any] | None]] = {}  # kind -> (when read, record)
        # (kind's directory, version, id of the target) -> the loaded drafter
        self._loaded: dict[tuple[str, int, int], tuple[Transformer, list[int] | None]] = {}
        self._lock = threading.Lock()

    def publish(self, kind: str, model: Transformer, vocab_ids: list[int] | None, info: dict[str, Any]) -> int:
        """Write `model` as `kind`'s next version and record it; returns the version."""
        record = self.store.published_drafter(kind)
        version = (record["version"] if record else 0) + 1
        out = self.root / _dir_name(kind) / f"v{version}"
        save_drafter(model, vocab_ids, out, info)
        # the files are complete before the record points at them
        self.store.publish_drafter(kind, {"version": version, "path": str(out), **info.get("online", {})})
        with self._lock:
            self._seen.pop(kind, None)
        return version

    def latest(self, kind: str) -> dict[str, Any] | None:
        """`kind`'s latest record, read from the store at most every `refresh_s` seconds."""
        now = self.clock()
        with self._lock:
            seen = self._seen.get(kind)
            if seen is not None and now - seen[0] < self.refresh_s:
                return seen[1]
        record = self.store.published_drafter(kind)
        with self._lock:
            self._seen[kind] = (now, record)
        return record

    def load(self, record: dict[str, Any], target: Transformer) -> tuple[Transformer, list[int] | None]:
        """The drafter a record points at, loaded once per process and target, tuned for
        serving as the shipped ones are (registry.py)."""
        from runtime.cpu_tuning import apply_cpu_tuning, tuning_of

        key = (str(Path(record["path"]).parent), record["version"], id(target))
        with self._lock:
            if key not in self._loaded:
                model, vocab_ids, _ = load_drafter(record["path"], str(target.device), target.dtype)
                apply_cpu_tuning(model, tuning_of(target))
                # a kind's older versions go (requests still drafting with one keep their reference)
                self._loaded = {k: v for k, v in self._loaded.items() if k[0] != key[0] or k[2] != key[2]}
                self._loaded[key] = (model, vocab_ids)
            return self._loaded[key]


def _dir_name(kind: str) -> str:
    """A directory name for a drafter kind (a kind may be a path)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in kind)[-48:]
    return f"{safe}-{hashlib.sha256(kind.encode()).hexdigest()[:8]}"
