"""How many requests this router holds at each verifier and drafter pool, so that a new
request goes to the replica holding the fewest. Without it every request went to the first
listed replica until its rows were full, and a second verifier node idled while the first
batched (docs/lab/simulator-validation.md). The counts are per router replica; a replica
that other routers filled answers "every row taken", and the next is tried."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Iterable


class Holdings:
    def __init__(self):
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()

    def fewest_first(self, addresses: Iterable[str]) -> list[str]:
        """`addresses` by the requests held at each, fewest first; ties keep their order."""
        with self._lock:
            return sorted(addresses, key=lambda a: self._held[a])

    def moved(self, old: str | None, new: str | None) -> None:
        """A request left `old` (None: was nowhere) for `new` (None: goes nowhere)."""
        if old == new:
            return
        with self._lock:
            if old is not None:
                self._held[old] -= 1
                if self._held[old] <= 0:
                    del self._held[old]
            if new is not None:
                self._held[new] += 1

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._held)
