"""The line of prefills waiting for a verifier row, served in arrival order.

While every verifier row is taken, a prefill that found them all full joins
the line, and so does every prefill that arrives while someone is waiting.
Only the first in line asks the verifiers again; the others wait their turn.
Without the line each waiting request polled on its own, and a row freed went
to whichever polled first: a request could be passed over again and again
(time to first token of minutes under a burst, docs/RELIABILITY.md).

A row freed by a request of this router wakes the first in line at once;
rows freed elsewhere (another router replica) are found by polling. The line
is per router replica: replicas keep their own order.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Callable


class RowLine:
    def __init__(self, poll_s: float):
        self.poll_s = poll_s  # how often the first in line asks again without being woken
        self._cond = threading.Condition()
        self._line: deque[int] = deque()
        self._tickets = itertools.count()
        self._freed = 0  # rows freed here so far: a waiter wakes when it changes

    def place(self) -> "Place":
        """One prefill's place: in line once it finds others waiting or waits its turn."""
        return Place(self)

    def waiting(self) -> int:
        with self._cond:
            return len(self._line)

    def freed(self) -> None:
        """A row of some verifier was given back by this router."""
        with self._cond:
            self._freed += 1
            self._cond.notify_all()


class Place:
    """A prefill's place in the line; a context manager that leaves the line on exit."""

    def __init__(self, line: RowLine):
        self.line = line
        self.ticket: int | None = None

    def __enter__(self) -> "Place":
        line = self.line
        with line._cond:
            if line._line:  # others are waiting for a row: no jumping the line
                self._join()
        return self

    def __exit__(self, *exc) -> None:
        line = self.line
        with line._cond:
            if self.ticket is not None:
                line._line.remove(self.ticket)
                self.ticket = None
                line._cond.notify_all()  # the next in line may be first now

    def _join(self) -> None:
        self.ticket = next(self.line._tickets)
        self.line._line.append(self.ticket)

    def wait_turn(self, check: Callable[[], None], for_row: bool) -> None:
        """Return when this place is first in line; with `for_row` (the verifiers were all
        full), also not before a row is freed here or `poll_s` has passed. Joins the line
        if not in it. `check` is called at least every `poll_s` and may raise (cancelled,
        deadline passed)."""
        line = self.line
        with line._cond:
            if self.ticket is None:
                self._join()
            freed, poll_until = line._freed, time.monotonic() + line.poll_s
            while True:
                first = line._line[0] == self.ticket
                if first and (not for_row or line._freed != freed or time.monotonic() >= poll_until):
                    return
                line._cond.wait(timeout=max(0.0, poll_until - time.monotonic()) if first else line.poll_s)
                line._cond.release()  # `check` may call out (the job's cancellation): not under the lock
                try:
                    check()
                finally:
                    line._cond.acquire()
