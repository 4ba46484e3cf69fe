"""A request's constraints on its output, as the verifier applies them: the grammar
compiled from its `constraint` or its tools, the stop tokens, and its speculation cap."""

from __future__ import annotations

import dataclasses

from protos import specserve_pb2 as pb
from runtime.errors import InvalidArgument
from speculative.grammar import Grammars
from speculative.sampling import SamplingParams

from .tools import Function, call_grammar

_SPECS = {"json_schema": lambda c: c.json_schema, "json_object": lambda c: True, "regex": lambda c: c.regex,
          "choice": lambda c: list(c.choice.options), "grammar": lambda c: c.grammar}


def constrained(params: SamplingParams, req: pb.GenerateRequest, grammars: Grammars | None,
                tools: list[Function], choice: str, eos_token_ids: list[int]) -> SamplingParams:
    """`params` with the request's grammar and its stop tokens (the model's end tokens and
    the request's own). A client never sets the grammar itself: the router compiles it."""
    if params.grammar:
        raise InvalidArgument("sampling.grammar", "is the server's to set: give a constraint")
    grammar = request_grammar(req, grammars, tools, choice)
    stops = tuple(dict.fromkeys([*eos_token_ids, *params.stop_token_ids]))
    return dataclasses.replace(params, grammar=grammar, stop_token_ids=stops)


def request_grammar(req: pb.GenerateRequest, grammars: Grammars | None, tools: list[Function],
                    choice: str) -> str | None:
    """The grammar of the request's structured output, or of the calls its tool choice
    requires (a function's name, or "required"); None: free text."""
    kind = req.constraint.WhichOneof("kind")
    must_call = choice not in ("none", "auto")
    if kind is not None and must_call:
        raise InvalidArgument("tool_choice", "a required tool call and a constraint on the output cannot go "
                                             "together")
    if kind is None and not must_call:
        return None
    if grammars is None:
        raise InvalidArgument("constraint" if kind else "tool_choice", "this server runs no grammars")
    if must_call:
        parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True
        return grammars.compile("grammar", call_grammar(tools, choice, parallel), "tools")
    return grammars.compile(kind, _SPECS[kind](req.constraint), f"constraint.{kind}")


def draft_length(req: pb.GenerateRequest, server_length: int) -> int:
    """The most tokens a round of the request drafts: the server's, or less if it asks."""
    if not req.HasField("draft_length"):
        return server_length
    if req.draft_length < 0:
        raise InvalidArgument("draft_length", f"must be >= 0 (0: no speculation), got {req.draft_length}")
    return min(server_length, req.draft_length)
