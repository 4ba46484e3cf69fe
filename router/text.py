"""Turning verified tokens into streamed text, honouring stop strings."""

from __future__ import annotations

from typing import Sequence


class StreamingText:
    """Text of the tokens so far, released in pieces that are final.

    Held back: a trailing partial UTF-8 character, and as many characters as
    could still turn into a stop string. The text ends before the first stop
    string to be completed.

    Each round costs the same however long the output is: only the tokens since
    the last complete character are decoded again (from a few tokens before
    them, as vLLM's incremental detokenizer does, so that a decoder which treats
    a text's first token apart, a leading space say, treats both decodes alike),
    and stop strings are looked for only where new text could complete one.
    """

    # tokens decoded before the new ones, as the context their text is cut from
    CONTEXT_TOKENS = 5

    def __init__(self, decode, stop: Sequence[str] = ()):
        self.decode, self.stop = decode, [s for s in stop if s]
        self.tokens: list[int] = []
        self._released = 0  # characters of _decoded sent out
        self.stopped = False
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._decoded = ""  # the text of tokens[:_read], each character complete
        self._prefix = 0  # tokens[_prefix:_read]: the context the next decode starts from
        self._read = 0
        self._searched = 0  # no stop string starts before this index of _decoded

    def add(self, tokens: list[int]) -> str:
        """Append tokens; return the newly final text."""
        self.tokens.extend(tokens)
        self._decode_new(final=False)
        cut = self._first_stop()
        if cut >= 0:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self._decoded) - self._hold)

    def finish(self) -> str:
        """Everything still held back, at the end of generation."""
        if self.stopped:
            return ""
        self._decode_new(final=True)
        return self._release(len(self._decoded))

    def _decode_new(self, final: bool) -> None:
        """Extend `_decoded` by the tokens after `_read`, unless their text ends in a partial
        character (it waits for the next tokens), or `final`."""
        if self._read == len(self.tokens):
            return
        context = self.decode(self.tokens[self._prefix:self._read]) if self._read > self._prefix else ""
        text = self.decode(self.tokens[self._prefix:])
        if len(text) < len(context) or (text.endswith("\ufffd") and not final):
            return
        self._decoded += text[len(context):]  # nothing, for tokens with no text (special ones)
        self._read = len(self.tokens)
        self._prefix = max(self._prefix, self._read - self.CONTEXT_TOKENS)

    def _first_stop(self) -> int:
        """Where the first stop string to be completed starts in `_decoded`, or -1: the one
        ending first, and of those ending there the longest, as if the text came a character
        at a time, so that how the tokens came in rounds changes nothing. The text it has
        searched is not searched again but for a stop string's length less one before its end."""
        if not self.stop:
            return -1
        start = max(0, self._searched - self._hold)
        self._searched = len(self._decoded)
        found = [(i + len(s), i) for i, s in ((self._decoded.find(s, start), s) for s in self.stop) if i >= 0]
        return min(found)[1] if found else -1

    def _release(self, end: int) -> str:
        """The text up to `end` not yet released. A stop string cannot start in text already
        released (as much as the longest could still become one is held back)."""
        delta = self._decoded[self._released:max(end, 0)]
        self._released += len(delta)
        return delta
