"""Memory namespaces: what drafting learns across requests, kept apart per namespace.

Some drafters learn from every request they serve (a suffix index of outputs,
a table of the target's own predictions), and the router learns how far to
trust each drafter (confidence calibration, acceptance per domain). That
memory is what makes them fast on repeated text, and it is also a channel:
a request drafts from what earlier requests produced. A namespace bounds it.
Requests of one namespace share one memory; requests of different namespaces
never draft from each other's. A tenant (later: an API key) gets its own, and
a benchmark gives each mode its own so that no mode drafts another's answer to
the same question from memory. "" is the server's shared default.

Only speed depends on this memory, never the output: verification alone
decides tokens. So a namespace evicted to bound memory simply starts afresh.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Callable, Generic, TypeVar

from runtime.errors import InvalidArgument

DEFAULT_NAMESPACE = ""
MAX_NAMESPACE_LENGTH = 128
# namespaces kept per process before the least recently used is forgotten: a suffix
# index and a recycling table each take megabytes
DEFAULT_CAPACITY = 16
_ALLOWED = re.compile(r"[A-Za-z0-9._:/@+-]*")

T = TypeVar("T")


def check_namespace(namespace: str) -> str:
    """`namespace` if it is a valid name, else InvalidArgument naming the field."""
    if len(namespace) > MAX_NAMESPACE_LENGTH:
        raise InvalidArgument("namespace", f"at most {MAX_NAMESPACE_LENGTH} characters, got {len(namespace)}")
    if not _ALLOWED.fullmatch(namespace):
        raise InvalidArgument("namespace", "only letters, digits and . _ : / @ + - are allowed")
    return namespace


class Namespaces(Generic[T]):
    """One value per namespace, made by `make(namespace)` on first use; past `capacity`
    namespaces the least recently used one is forgotten, after `forget(value)` if given
    (to write out what it has not yet). Thread-safe."""

    def __init__(self, make: Callable[[str], T], capacity: int = DEFAULT_CAPACITY,
                 forget: Callable[[T], None] | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._make, self.capacity, self._forget = make, capacity, forget
        self._values: OrderedDict[str, T] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, namespace: str = DEFAULT_NAMESPACE) -> T:
        evicted = []
        with self._lock:
            if namespace in self._values:
                self._values.move_to_end(namespace)
                return self._values[namespace]
            value = self._values[namespace] = self._make(namespace)
            while len(self._values) > self.capacity:
                evicted.append(self._values.popitem(last=False)[1])
        for old in evicted if self._forget else ():
            self._forget(old)  # outside the lock: it may talk to the state store
        return value

    def values(self) -> list[T]:
        with self._lock:
            return list(self._values.values())

    def __contains__(self, namespace: str) -> bool:
        with self._lock:
            return namespace in self._values

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)
