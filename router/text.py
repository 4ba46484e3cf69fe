"""Turning verified tokens into streamed text, honouring stop strings."""

from __future__ import annotations

from typing import Sequence


class StreamingText:
    """Text of the tokens so far, released in pieces that are final.

    Held back: a trailing partial UTF-8 character, and as many characters as
    could still turn into a stop string. The text ends before the first stop
    string.
    """

    def __init__(self, decode, stop: Sequence[str] = ()):
        self.decode, self.stop = decode, [s for s in stop if s]
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def add(self, tokens: list[int]) -> str:
        """Append tokens; return the newly final text."""
        self.tokens.extend(tokens)
        text = self.decode(self.tokens)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(text[:cut])
        if text.endswith("\ufffd"):
            text = text[:-1]
        return self._release(text[:len(text) - self._hold] if self._hold else text)

    def finish(self) -> str:
        """Everything still held back, at the end of generation."""
        if self.stopped:
            return ""
        text = self.decode(self.tokens)
        return self._release(text)

    def _release(self, final: str) -> str:
        delta = final[len(self.sent):] if final.startswith(self.sent) else ""
        self.sent += delta
        return delta

    @property
    def text(self) -> str:
        return self.sent
