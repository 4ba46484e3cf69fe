"""Grammars that constrain a request's output, through llguidance.

A request's constraint (a JSON schema, a regex, a choice of strings, a Lark grammar)
compiles into one llguidance grammar for the target's tokenizer (`Grammars.compile`);
the verifier keeps a `Matcher` per request: the grammar's state after the verified
tokens, the set of tokens it allows next (`mask`), the tokens it forces (`forced`,
jump-forward), and `consume` / `rollback` to walk a draft tree's paths and come back.

llguidance was chosen for its compile and mask time on a CPU (docs/lab/structured-outputs.md)
and because its matcher rolls back, which walking a tree needs.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Sequence

import numpy as np
import torch

from runtime.errors import InvalidArgument

# A grammar that takes longer than this to compile is refused (a pathological schema or
# regex must not hold a request, or a router thread, for long).
COMPILE_TIMEOUT_S = 5.0
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
FORCED_CHECKED = 16  # forced tokens a compile check consumes (speculative.processing's MAX_FORCED a round)


class Grammars:
    """Compiles constraints for one tokenizer, and makes matchers of compiled grammars."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 compile_timeout_s: float = COMPILE_TIMEOUT_S):
        """`tokenizer_json`: the Hugging Face tokenizers JSON of the target's tokenizer;
        `vocab_size`: the target's (masks have one entry a row of its logits)."""
        import llguidance

        self._llg = llguidance
        self.vocab_size, self.compile_timeout_s = vocab_size, compile_timeout_s
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int) -> "Grammars":
        """For a runtime.tokenizer.Tokenizer."""
        return cls(tokenizer.to_json(), vocab_size, tokenizer.eos_token_ids)

    def compile(self, kind: str, spec: Any, field: str) -> str:
        """The llguidance grammar of a constraint: `kind` one of KINDS, `spec` the schema (a
        dict or its JSON), the regex, the list of strings, or the Lark grammar. Raises
        InvalidArgument naming `field` when it is malformed or does not compile in time."""
        grammar = self._grammar_of(kind, spec, field)
        self._check(grammar, field)
        return grammar

    def _grammar_of(self, kind: str, spec: Any, field: str) -> str:
        M = self._llg.LLMatcher
        try:
            if kind == "json_schema":
                return M.grammar_from_json_schema(spec if isinstance(spec, str) else json.dumps(spec))
            if kind == "json_object":
                return M.grammar_from_json_schema({"type": "object"})
            if kind == "regex":
                return M.grammar_from_regex(_text(spec, field))
            if kind == "choice":
                return M.grammar_from_lark(choice_lark(spec, field))
            if kind == "grammar":
                return M.grammar_from_lark(_text(spec, field))
        except (ValueError, TypeError) as e:
            raise InvalidArgument(field, f"is not a valid {kind.replace('_', ' ')}: {e}") from None
        raise InvalidArgument(field, f"unknown kind of constraint {kind!r}; one of {', '.join(KINDS)}")

    def _check(self, grammar: str, field: str) -> None:
        """Build a matcher of `grammar` on another thread (llguidance drops the GIL while it
        compiles), waiting at most the compile timeout for it."""
        outcome: list = []
        worker = threading.Thread(target=lambda: outcome.append(self._try_matcher(grammar)), daemon=True,
                                  name="grammar-compile")
        worker.start()
        worker.join(self.compile_timeout_s)
        if not outcome:
            raise InvalidArgument(field, f"did not compile within {self.compile_timeout_s:g} s")
        error = outcome[0]
        if error:  # its first line: llguidance appends its state and the grammar
            raise InvalidArgument(field, f"does not compile: {error.strip().splitlines()[0]}")

    def _try_matcher(self, grammar: str) -> str:
        """"" when a matcher of `grammar` starts, else why not. Starting is the first mask and
        the tokens it forces, consumed: llguidance builds its lexer lazily, and a grammar too
        complex for it (the regex a{99999999}) fails only there, which in a verifier failed
        the request as no verifier available rather than refusing it."""
        try:
            matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
            if not matcher.is_error():
                matcher.compute_bitmask()
                for token in matcher.compute_ff_tokens()[:FORCED_CHECKED]:
                    if not matcher.consume_token(token):
                        break
        except Exception as e:  # noqa: BLE001 - its message is the caller's error
            return str(e)
        return matcher.get_error() if matcher.is_error() else ""

    def matcher(self, grammar: str) -> "Matcher":
        """A matcher at the grammar's start."""
        return Matcher(self._llg.LLMatcher(self.tokenizer, grammar, log_level=0), self.vocab_size)


class Matcher:
    """One request's grammar state: the tokens it allows next, consumed tokens, rollback."""

    def __init__(self, matcher, vocab_size: int):
        self._m, self.vocab_size = matcher, vocab_size

    def mask(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next (only end-of-sequence once it is done)."""
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[:self.vocab_size].astype(bool))

    def consume(self, token: int) -> None:
        """Advance past `token`, which the grammar must allow (`mask`)."""
        if not self._m.consume_token(int(token)):
            raise ValueError(f"the grammar does not allow token {token}: {self._m.get_error()}")

    def consume_all(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.consume(token)

    def rollback(self, n: int) -> None:
        if n and not self._m.rollback(n):
            raise ValueError(f"cannot roll back {n} tokens: {self._m.get_error()}")

    def forced(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (jump-forward)."""
        return list(self._m.compute_ff_tokens())

    def is_done(self) -> bool:
        """Whether the grammar allows nothing but the end of the output."""
        return self._m.is_stopped()


def choice_lark(choices: Any, field: str) -> str:
    """A Lark grammar matching exactly one of the strings."""
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidArgument(field, "must be a non-empty list of strings")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def _text(spec: Any, field: str) -> str:
    if not isinstance(spec, str) or not spec:
        raise InvalidArgument(field, "must be a non-empty string")
    return spec
