"""Errors every service shares, in a module that imports nothing heavy: the
configuration and the request validation raise them without loading torch."""

from __future__ import annotations


class InvalidArgument(ValueError):
    """A request field is out of range; `field` names it for the caller."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class PromptTooLong(InvalidArgument):
    """The prompt is longer than the server takes (HTTP answers it with 413)."""
