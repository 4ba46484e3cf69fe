"""Property-based fuzzing of specserve's gRPC services and of its HTTP API (issue 21),
shared by tests/test_fuzz_grpc.py and tests/test_http_api.py (a few hundred inputs
each) and scripts/fuzz.py (the long campaign).

gRPC: every RPC of every service in protos/specserve.proto gets a hypothesis
strategy built by walking its request message's DESCRIPTOR, so every field is
covered and a field added to the proto is fuzzed without touching this file:
integers over their type's whole range and near the edges, floats with NaN and the
infinities, unicode and empty strings, repeated fields short and long, nested
messages set or not, `optional` fields present or not. Some requests go as bytes
no message serialises to (`raw_request`): a string holding a lone surrogate, groups
nested past protobuf's depth limit, a field with the wrong wire type, a message
past gRPC's size limit. Fields we know by name also
get likely values (token ids inside the vocabulary, request ids from a small pool so
that the calls of one example meet the same request, the pool's drafter names...)
and values just outside; a message is drawn with every field generic, or every
field likely, or every field likely but one (which then meets the check, or the
code, behind the others), made to pass the checks that tie fields together
(FIXUPS); draft trees also come well formed. So inputs get past validation into
the model as well as into every check.

An example is a short program of calls to one service (Prefill, Verify, Verify,
Release...); the property is that each call ends OK or with a status in
`allowed_statuses` (INVALID_ARGUMENT naming the field, RESOURCE_EXHAUSTED when the
rows are full...), never INTERNAL or UNKNOWN, never OK with a NaN or infinite
sampling parameter, that no server of this process raised
an exception it did not handle (even one the caller never saw as such), and that
afterwards no request holds state: the fuzz releases every id it prefilled, and the
router frees its own.

HTTP (`HttpFuzz`): schemathesis over a running server's OpenAPI document, and
bodies schemathesis never writes (`HostileBody`): a lone surrogate, NaN, the
infinities and 1e309, the wrong JSON type, nesting deep and past the parser's
depth, a body over the server's size limit; each must get the error naming its field.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

from protos import specserve_pb2 as pb
from protos.server import CLUSTER_SECRET_METADATA
from speculative.domains import DOMAINS
from speculative.drafter_kinds import DRAFTER_NAMES

SERVICES = ("Specserve", "Verifier", "Drafter")
# what a call may end with besides OK; never INTERNAL or UNKNOWN. UNAVAILABLE only from
# the router (no verifier, or a pool went away): the internal services are up throughout.
ALLOWED = frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "OUT_OF_RANGE",
                     "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"})


def allowed_statuses(service: str) -> frozenset[str]:
    return ALLOWED | {"UNAVAILABLE"} if service == "Specserve" else ALLOWED


@dataclass(frozen=True)
class Rpc:
    service: str  # "Verifier"
    method: str  # "Prefill"
    request: Descriptor
    response: Descriptor
    streaming: bool  # server streaming

    @property
    def name(self) -> str:
        return f"{self.service}.{self.method}"

    @property
    def path(self) -> str:
        return f"/{pb.DESCRIPTOR.services_by_name[self.service].full_name}/{self.method}"


def rpcs(service: str | None = None) -> list[Rpc]:
    """Every RPC of the proto's services (or of one)."""
    return [Rpc(s.name, m.name, m.input_type, m.output_type, m.server_streaming)
            for s in pb.DESCRIPTOR.services_by_name.values() if service in (None, s.name)
            for m in s.methods]


# ---------------------------------------------------------------- strategies --

INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-2**31, 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-2**31, 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-2**31, 2**31 - 1), FieldDescriptor.TYPE_INT64: (-2**63, 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-2**63, 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
# strings that have broken parsers elsewhere: empty, NUL, a path, one too long for a file name
EDGE_STRINGS = ("", " ", "\x00", "\n", "/", "..", "../../etc/passwd", "x" * 300, "é漢🙂" * 20, "+", "a+b", "%s{}")


def generic_int(fd: FieldDescriptor) -> st.SearchStrategy[int]:
    lo, hi = INT_RANGES[fd.type]
    edges = sorted({lo, hi, max(lo, -1), 0, 1, max(lo, -2**31), min(hi, 2**31 - 1)})
    return st.one_of(st.integers(max(lo, -3), 80), st.sampled_from(edges), st.integers(lo, hi))


def generic_scalar(fd: FieldDescriptor) -> st.SearchStrategy:
    if fd.type in INT_RANGES:
        return generic_int(fd)
    if fd.type == FieldDescriptor.TYPE_FLOAT:
        return st.one_of(st.sampled_from([0.0, -0.0, 0.5, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e-45, 3.4e38]),
                         st.floats(width=32))
    if fd.type == FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.sampled_from([0.0, 1.0, math.nan, math.inf, -math.inf]), st.floats())
    if fd.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if fd.type == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(EDGE_STRINGS), st.text(st.characters(codec="utf-8"), max_size=24))
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=24)
    if fd.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in fd.enum_type.values])
    raise TypeError(f"no strategy for field {fd.full_name} of type {fd.type}")


def hints(vocab_size: int, request_ids: tuple[str, ...], kinds: tuple[str, ...]
          ) -> dict[str, tuple[st.SearchStrategy, st.SearchStrategy | None]]:
    """Per field name (in any message): values near what the services take, so that inputs
    also reach past validation into the model, and values just outside (None: the generic
    strategy's edges suffice). `kinds`: the drafters the pool serves."""
    v = vocab_size
    unit = st.one_of(st.sampled_from([0.0, 1.0, 0.5]), st.floats(0.0, 1.0, width=32))
    not_unit = st.sampled_from([-0.1, 1.5, math.nan, math.inf, -math.inf])
    tokens = (st.integers(0, v - 1), st.sampled_from([-1, v, v + 1, -2**31, 2**31 - 1]))
    return {
        **{name: tokens for name in ("token_ids", "tokens", "new_tokens", "speculative_tokens", "observed_tokens",
                                     "observed_ids", "ids", "candidate_ids", "eos_token_ids", "stop_token_ids")},
        "draw_nodes": (st.integers(0, 8), st.sampled_from([-1, 9, 2**31 - 1])),
        "parents": (st.integers(-1, 7), st.sampled_from([-2, 8, 2**31 - 1])),
        "request_id": (st.sampled_from(request_ids), None),
        "max_tokens": (st.integers(1, 12), st.sampled_from([0, -1, 2**31 - 1])),
        "draft_length": (st.integers(0, 8), st.sampled_from([-1, 64, 2**31 - 1])),
        "max_len": (st.integers(0, 64), st.sampled_from([-1, 65, 2**31 - 1])),
        "context_length": (st.integers(0, 40), st.sampled_from([-1, 64, 2**31 - 1])),
        "candidates": (st.integers(0, 8), st.sampled_from([-1, 64, 65])),
        "max_nodes": (st.integers(0, 24), st.sampled_from([-1, 2**31 - 1])),
        "stream": (st.integers(1, 3), st.sampled_from([0, -1])),
        "resumed": (st.integers(0, 3), st.sampled_from([-1, 2**31 - 1])),
        "top_k": (st.integers(0, v + 1), st.sampled_from([-1, 2**31 - 1])),
        "seed": (st.integers(0, 5), None),
        "temperature": (st.one_of(st.sampled_from([0.0, 0.0, 0.7, 1.0]), st.floats(0.0, 2.0, width=32)),
                        st.sampled_from([-1.0, math.nan, math.inf, 1e-30])),
        "top_p": (st.one_of(st.just(1.0), st.floats(0.0625, 1.0, width=32)), st.sampled_from([0.0, 1.5, math.nan])),
        **{name: (unit, not_unit) for name in ("min_confidence", "probs", "observed_probs", "confidence")},
        "drafter": (st.sampled_from(kinds), st.sampled_from(
            [*DRAFTER_NAMES, "", "auto", "pld+suffix", "suffix+recycle", "pld+none", "pld+", "pld+pld", "+"])),
        "namespace": (st.sampled_from(["", "a", "tenant/1"]), st.sampled_from(["bad namespace", "n" * 129])),
        "role": (st.sampled_from(["system", "user", "assistant"]), st.sampled_from(["developer", "tool", ""])),
        **{name: (st.sampled_from(["", *DOMAINS]), st.sampled_from(["astrology", "QA"]))
           for name in ("domain_hint", "domain")},
        **{name: (st.text(st.characters(codec="utf-8"), min_size=1, max_size=20), None)
           for name in ("prompt", "content")},
        "stop": (st.sampled_from(["1", "23", "4"]), st.sampled_from(["", "\x00"])),
        "tool_choice": (st.sampled_from(["", "auto", "none"]), st.sampled_from(["required", "get_weather", "x"])),
        **{name: (st.sampled_from([0.0, 0.0, 0.5, -1.0, 2.0]), st.sampled_from([2.5, -3.0, math.nan, math.inf]))
           for name in ("presence_penalty", "frequency_penalty")},
        "repetition_penalty": (st.sampled_from([1.0, 1.1, 0.8]), st.sampled_from([0.0, -1.0, math.nan, math.inf])),
        "logit_bias": (st.dictionaries(st.integers(0, v - 1), st.sampled_from([-100.0, -1.0, 0.5, 100.0]), max_size=3),
                       st.dictionaries(st.sampled_from([-1, v]), st.sampled_from([0.0, 101.0, math.nan]),
                                       min_size=1, max_size=2)),
        "min_tokens": (st.integers(0, 2), st.sampled_from([-1, 13, 2**31 - 1])),
        "grammar": (st.just(""), None),  # the constrained tests reach the grammars themselves
        "logprobs": (st.integers(0, 5), st.sampled_from([-1, 21, 2**31 - 1])),
        "prompt_length": (st.integers(1, 3), st.sampled_from([0, -1, 2**31 - 1])),
        # the target's features (eagle): mostly none asked or sent, now and then a bad layer or size
        "feature_layers": (st.sampled_from([0, 1]), st.sampled_from([-1, 2, 2**31 - 1])),
        "verifier_drafter": (st.just(""), st.sampled_from(["pld", "x", "eagle+pld"])),
        "features": (st.just(b""), st.sampled_from([b"\x00", b"\x00" * 6])),
        **{name: (st.just(0), st.sampled_from([-1, 1, 3, 2**31 - 1])) for name in ("features_start", "features_count")},
        "eagle_placement": (st.sampled_from(["", "verifier", "pool"]), st.sampled_from(["gpu", "Pool", " "])),
    }


def message_class(descriptor: Descriptor) -> type:
    return message_factory.GetMessageClass(descriptor)


class Strategies:
    """Hypothesis strategies of every message of the proto, from its DESCRIPTOR."""

    def __init__(self, vocab_size: int, kinds: tuple[str, ...] = ("pld",),
                 request_ids: tuple[str, ...] = ("r0", "r1", "r2", "r3", "r4", "r5")):
        self.vocab_size, self.request_ids = vocab_size, request_ids
        self.hints = hints(vocab_size, request_ids, tuple(kinds))
        # whole messages with a likelier variant of their own (drawn beside the generic one)
        self.variants: dict[str, st.SearchStrategy] = {
            "specserve.v1.DraftTree": well_formed_tree(vocab_size)}
        self._cache: dict[str, st.SearchStrategy] = {}

    def scalar(self, fd: FieldDescriptor, hinted: bool = False) -> st.SearchStrategy:
        generic = generic_scalar(fd)
        if fd.name not in self.hints:
            return generic
        likely, edge = self.hints[fd.name]
        if hinted:
            return likely
        return st.one_of(likely, generic) if edge is None else st.one_of(likely, edge, generic)

    def field(self, fd: FieldDescriptor, hinted: bool = False) -> st.SearchStrategy:
        """A value to set (None: leave the field unset); `hinted`: from the field's hint alone,
        where it has one."""
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            if fd.name in self.hints:  # a map with a hint of its own, as for a scalar
                likely, edge = self.hints[fd.name]
                return likely if hinted else st.one_of(likely, edge)
            key, value = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
            return st.dictionaries(self.scalar(key, hinted), self.field(value, hinted), max_size=4)
        one = self.message(fd.message_type, hinted) if fd.message_type is not None else self.scalar(fd, hinted)
        if fd.is_repeated:
            if fd.message_type is not None:
                return st.lists(one, max_size=6)
            if hinted:
                return st.lists(one, max_size=10)
            # short lists mostly; now and then longer than the tiny target's 64 positions
            return st.one_of(st.lists(one, max_size=10), st.lists(one, min_size=60, max_size=72))
        if fd.has_presence:  # a message field, or a proto3 `optional` scalar: set or not
            return st.one_of(st.none(), one)
        return one

    def message(self, descriptor: Descriptor, hinted: bool = False) -> st.SearchStrategy:
        """Messages of `descriptor`'s type: each field generic or hinted, or every hinted field
        from its hint alone (likelier to pass validation), or the type's own variant."""
        key = (descriptor.full_name, hinted)
        if key not in self._cache:
            self._cache[key] = st.deferred(lambda: self._build(descriptor, hinted))
        return self._cache[key]

    def _build(self, descriptor: Descriptor, hinted: bool) -> st.SearchStrategy:
        variant = self.variants.get(descriptor.full_name)
        options = [self.fields(descriptor, True)] if hinted else [
            self.fields(descriptor, False), self.fields(descriptor, True), self.one_off(descriptor),
            self.one_off(descriptor)]
        return st.one_of(*([variant] if variant is not None else []), *options)

    def fields(self, descriptor: Descriptor, hint_only: bool, off: str | None = None) -> st.SearchStrategy:
        """Messages with every field drawn from its strategy (`hint_only`: its hint alone, but
        for field `off`, drawn from its whole strategy, and then made to pass the checks that
        tie fields together, if the type has such a `fixup`)."""
        cls = message_class(descriptor)
        fields = {fd.name: self.field(fd, hint_only and fd.name != off) for fd in descriptor.fields}
        built = st.fixed_dictionaries(fields).map(lambda values: make(cls, values))
        fixup = FIXUPS.get(descriptor.full_name)
        if hint_only and fixup is not None:
            return st.builds(lambda msg, choice: fixup(msg, choice, off), built, st.integers(0, 2**16))
        return built

    def one_off(self, descriptor: Descriptor) -> st.SearchStrategy:
        """Messages with every field from its hint but one, drawn from its whole strategy: a bad
        value where the others let it reach the check (or the code) that meets it."""
        if not descriptor.fields:
            return self.fields(descriptor, True)
        return st.sampled_from([fd.name for fd in descriptor.fields]).flatmap(
            lambda off: self.fields(descriptor, True, off))

    def request(self, rpc: Rpc) -> st.SearchStrategy:
        """Messages of the RPC's request type; one in HOSTILE_SHARE is sent as bytes no message
        serialises to (`raw_request`), and one is a likely message with a float made NaN or
        infinite (`with_non_finite`: the others let it reach the check)."""
        message, choice = self.message(rpc.request), st.integers(0, 2**16)
        raw = st.builds(raw_request, message, st.sampled_from(RAW_KINDS), choice)
        non_finite = st.builds(with_non_finite, self.message(rpc.request, hinted=True), choice)
        return st.integers(0, HOSTILE_SHARE - 1).flatmap(lambda i: (raw, non_finite, message)[min(i, 2)])

    def program(self, service: str, max_calls: int = 6) -> st.SearchStrategy[list[tuple[Rpc, object]]]:
        """A short sequence of calls to `service`'s RPCs with fuzzed requests."""
        calls = [st.tuples(st.just(rpc), self.request(rpc)) for rpc in rpcs(service)]
        return st.lists(st.one_of(calls), min_size=1, max_size=max_calls)


# -------------------------------------------------------- requests as raw bytes --

HOSTILE_SHARE = 6  # one request in this many is raw, one has a non-finite float
# by weight: a message past the size limit costs 4 MiB to send, so it comes rarely
RAW_KINDS = ("surrogate",) * 7 + ("deep",) * 4 + ("retyped",) * 4 + ("oversized",)
_PLACEHOLDER = "\x01\x02\x03"
_SURROGATE = b"\xed\xa0\x80"  # U+D800 as UTF-8 would write it, which UTF-8 forbids
GRPC_MAX_MESSAGE = 4 * 1024 * 1024  # what a server receives by default


def raw_request(msg, kind: str, choice: int) -> RawRequest:
    """`msg` sent as bytes that no message serialises to: one of its strings a lone surrogate,
    unknown groups nested past protobuf's depth limit, a field again with the wrong wire type,
    or padding past gRPC's message size limit."""
    data = msg.SerializeToString()
    if kind == "surrogate" and _set_placeholder(msg, choice):
        return RawRequest(msg, msg.SerializeToString().replace(_PLACEHOLDER.encode(), _SURROGATE), kind)
    if kind == "oversized":
        return RawRequest(msg, data + _record(1001, 2, b"\0" * (GRPC_MAX_MESSAGE + 1)), kind)
    fields = msg.ListFields()
    if kind == "retyped" and fields:
        fd = fields[choice % len(fields)][0]
        wire = 0 if fd.message_type is not None or fd.type in (fd.TYPE_STRING, fd.TYPE_BYTES) or fd.is_repeated else 2
        return RawRequest(msg, data + _record(fd.number, wire, b"ab"), f"{fd.name} retyped")
    depth = 100 + choice % 5000  # protobuf parses groups recursively, up to a depth of 100
    return RawRequest(msg, data + _varint(1000 << 3 | 3) * depth + _varint(1000 << 3 | 4) * depth, "deep")


def with_non_finite(msg, choice: int):
    """`msg` with one float field (or one in a message in it) set to NaN or an infinity."""
    _set_one(msg, (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE), (math.inf, -math.inf, math.nan)[choice % 3],
             choice // 3)
    return msg


def _set_placeholder(msg, choice: int) -> bool:
    return _set_one(msg, (FieldDescriptor.TYPE_STRING,), _PLACEHOLDER, choice)


def _set_one(msg, types: tuple[int, ...], value, choice: int) -> bool:
    """Set one field of `msg` of one of `types` (a repeated one: add `value`), in it or in a message
    in it (a singular one, set or not, or an element of a repeated one); False if there is none."""
    slots = []

    def walk(m) -> None:
        for fd in m.DESCRIPTOR.fields:
            if fd.type in types:
                slots.append((m, fd))
            elif fd.message_type is not None and not fd.message_type.GetOptions().map_entry:
                for sub in getattr(m, fd.name) if fd.is_repeated else [getattr(m, fd.name)]:
                    walk(sub)

    walk(msg)
    if not slots:
        return False
    m, fd = slots[choice % len(slots)]
    if fd.is_repeated:
        getattr(m, fd.name).append(value)
    else:
        setattr(m, fd.name, value)
    return True


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _record(number: int, wire: int, payload: bytes) -> bytes:
    """One field on the wire: a varint (wire 0, payload ignored) or a length-delimited one (2)."""
    if wire == 0:
        return _varint(number << 3) + _varint(1)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def non_finite_sampling(request) -> str | None:
    """The sampling field of `request` that is NaN or infinite (no service may take it), or None."""
    if isinstance(request, RawRequest) or "sampling" not in request.DESCRIPTOR.fields_by_name:
        return None
    sampling = request.sampling
    if not math.isfinite(sampling.temperature):
        return "temperature"
    if sampling.HasField("top_p") and not math.isfinite(sampling.top_p):
        return "top_p"
    return None


def _one_input(msg: pb.GenerateRequest, choice: int, off: str | None) -> pb.GenerateRequest:
    """A prompt or messages, not both (unless one of them is the field left off), and
    max_tokens set (the router's default would not fit the tiny target's context)."""
    if off not in ("prompt", "messages"):
        msg.ClearField("messages" if choice % 2 else "prompt")
    if off != "sampling" and not msg.sampling.HasField("max_tokens"):
        msg.sampling.max_tokens = 1 + choice % 12
    # no structure, or a valid one: a constraint, or (chat only) one tool the model may call
    shape = choice // 2 % 6
    if off != "constraint":
        msg.ClearField("constraint")
        if shape == 1:
            msg.constraint.json_object = True
        elif shape == 2:
            msg.constraint.choice.options.extend(["yes", "no"])
    if off not in ("tools", "tool_choice", "parallel_tool_calls"):
        msg.ClearField("tools")
        msg.tool_choice = ""
        if shape == 3 and msg.messages and not msg.HasField("constraint"):
            msg.tools.add(name="get_weather", description="the weather in a city",
                          parameters='{"type": "object", "properties": {"city": {"type": "string"}}}')
            msg.tool_choice = ("auto", "required", "")[choice // 12 % 3]
    return msg


def _observed_rows(msg: pb.ProposeRequest, choice: int, off: str | None) -> pb.ProposeRequest:
    """k (0-3) candidates and probabilities for each observed token (unless one of the three
    is the field left off)."""
    if off in ("observed_tokens", "observed_ids", "observed_probs"):
        return msg
    size = len(msg.observed_tokens) * (choice % 4)
    ids, probs = (list(msg.observed_ids) + [0] * size)[:size], (list(msg.observed_probs) + [0.5] * size)[:size]
    msg.ClearField("observed_ids")
    msg.ClearField("observed_probs")
    msg.observed_ids.extend(ids)
    msg.observed_probs.extend(probs)
    return msg


# per message type: made to pass the checks that tie its fields together, as
# fixup(message, a random number, the field left off or None)
def _no_features(msg, choice: int, off: str | None):
    """No feature layers asked for, mostly (unless they are the field left off): a list of
    them repeats one now and then, and every prefill would be refused."""
    if off != "feature_layers" and choice % 4:
        msg.ClearField("feature_layers")
    return msg


def _verifier_drafter(msg: pb.DecodeRequest, choice: int, off: str | None) -> pb.DecodeRequest:
    """A drafter the verifier drafts with itself (the pools' kinds are mostly others), and
    candidates only with "none" (unless one of them is the field left off)."""
    _no_features(msg, choice, off)
    if off != "drafter":
        msg.drafter = ("pld", "none")[choice % 2]
    if off not in ("drafter", "candidates") and msg.drafter != "none":
        msg.candidates = 0
    return msg


FIXUPS: dict[str, Callable] = {"specserve.v1.GenerateRequest": _one_input,
                               "specserve.v1.ProposeRequest": _observed_rows,
                               "specserve.v1.DecodeRequest": _verifier_drafter,
                               "specserve.v1.VerifierPrefillRequest": _no_features,
                               "specserve.v1.VerifyRequest": _no_features}


def make(cls: type, values: dict) -> object:
    """A message of class `cls` with each field in `values` set (None: left unset)."""
    msg = cls()
    for name, value in values.items():
        if value is None:
            continue
        fd = cls.DESCRIPTOR.fields_by_name[name]
        target = getattr(msg, name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            for k, v in value.items():
                if fd.message_type.fields_by_name["value"].message_type is not None:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif fd.is_repeated:
            target.extend(value)
        elif fd.message_type is not None:
            target.CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg


@st.composite
def well_formed_tree(draw, vocab_size: int) -> pb.DraftTree:
    """A tree the verifier takes: tokens inside the vocabulary, each parent before its node;
    draws landing on nodes, each with a sparse q giving its token a positive probability
    (normalised, or now and then not); a confidence per node or none."""
    n = draw(st.integers(0, 8))
    tokens = [draw(st.integers(0, vocab_size - 1)) for _ in range(n)]
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tree = pb.DraftTree(tokens=tokens, parents=parents)
    if n and draw(st.booleans()):
        draws = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n + 2))
        tree.draw_nodes.extend(draws)
        for node in draws:
            ids = sorted(set(draw(st.lists(st.integers(0, vocab_size - 1), max_size=4))) | {tokens[node]})
            weights = [draw(st.floats(0.01, 1.0)) for _ in ids]
            normalise = draw(st.booleans()) or draw(st.booleans())
            probs = [w / sum(weights) for w in weights] if normalise else weights
            tree.draw_q.add(ids=ids, probs=probs)
    if n and draw(st.booleans()):
        tree.confidence.extend(draw(st.floats(0.0, 1.0, width=32)) for _ in range(n))
    return tree


# ------------------------------------------------------------------- calling --

@dataclass(frozen=True)
class RawRequest:
    """A request sent as `raw` rather than as `message` serialises: what the protobuf library
    will not build (a string that is not UTF-8, groups nested past its limit, a message past
    gRPC's size limit). Reads as `message` otherwise (its request_id...)."""
    message: object
    raw: bytes
    why: str = ""

    def SerializeToString(self) -> bytes:
        return self.raw

    def __getattr__(self, name: str):
        if name in ("message", "raw", "why"):  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.message, name)


def call(channel: grpc.Channel, rpc: Rpc, request, timeout: float, secret: str | None = None
         ) -> tuple[str, str, object]:
    """(status name, details, response or None) of one call; a streamed response is read
    to its end (its chunks are the response)."""
    metadata = [(CLUSTER_SECRET_METADATA, secret)] if secret is not None else None
    serialize, parse = (lambda m: m.SerializeToString()), message_class(rpc.response).FromString
    try:
        if rpc.streaming:
            out = list(channel.unary_stream(rpc.path, request_serializer=serialize, response_deserializer=parse)(
                request, timeout=timeout, metadata=metadata))
        else:
            out = channel.unary_unary(rpc.path, request_serializer=serialize, response_deserializer=parse)(
                request, timeout=timeout, metadata=metadata)
    except grpc.RpcError as e:
        return e.code().name, e.details() or "", None
    return "OK", "", out


@dataclass
class Outcome:
    rpc: str
    status: str
    details: str
    request: object


@dataclass
class Tally:
    """Calls per (RPC, status) and the calls that broke the property, first few kept whole."""
    counts: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)  # (RPC, the field an INVALID_ARGUMENT named) -> calls
    failures: list[Outcome] = field(default_factory=list)
    failure_count: int = 0
    keep: int = 20

    def add(self, outcome: Outcome, allowed: frozenset[str]) -> bool:
        self.counts[(outcome.rpc, outcome.status)] += 1
        if outcome.status == "INVALID_ARGUMENT":
            self.refused[(outcome.rpc, outcome.details.partition(":")[0])] += 1
        if outcome.status in allowed:
            return True
        self.failure_count += 1
        if len(self.failures) < self.keep:
            self.failures.append(outcome)
        return False


class ServerErrors(logging.Handler):
    """The exceptions this process's gRPC servers did not handle (grpc logs each as
    "Exception calling application"): crashes even where the caller saw an allowed
    status, as when the router, answered UNKNOWN by a verifier, tries another and
    finally answers UNAVAILABLE."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def since(self, start: int) -> list[str]:
        return [repr(r.exc_info[1]) if r.exc_info else r.getMessage() for r in self.records[start:]]


@dataclass
class Target:
    """The services one fuzz drives: addresses of the router, the verifier and the drafter
    pool; the cluster secret the internal ones take; and, when they run in this process,
    how many requests each holds (for the leak checks)."""
    addresses: dict[str, str]  # service name -> HOST:PORT
    secret: str | None = None
    held: dict[str, Callable[[], int]] = field(default_factory=dict)  # "Verifier"/"Drafter" -> rows held
    timeout_s: float = 20.0
    server_errors: ServerErrors | None = None  # of servers in this process
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def channel(self, service: str) -> grpc.Channel:
        if service not in self._channels:
            self._channels[service] = grpc.insecure_channel(self.addresses[service])
        return self._channels[service]

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()

    def run(self, program: list[tuple[Rpc, object]], tally: Tally) -> list[Outcome]:
        """Make the program's calls, then release every request id a Prefill named (the router
        frees its own); returns the calls that broke the property."""
        bad = []
        errors_before = len(self.server_errors.records) if self.server_errors else 0
        for rpc, request in program:
            secret = None if rpc.service == "Specserve" else self.secret
            status, details, _ = call(self.channel(rpc.service), rpc, request, self.timeout_s, secret)
            outcome = Outcome(rpc.name, status, details, request)
            if status == "OK" and non_finite_sampling(request):  # taken: it sampled noise
                outcome = Outcome(rpc.name, "TOOK_NON_FINITE", f"{non_finite_sampling(request)} accepted", request)
            if not tally.add(outcome, allowed_statuses(rpc.service)):
                bad.append(outcome)
        for service in {rpc.service for rpc, _ in program} - {"Specserve"}:
            ids = {req.request_id for rpc, req in program if rpc.service == service and rpc.method == "Prefill"}
            release = next(r for r in rpcs(service) if r.method == "Release")
            for request_id in ids:
                status, details, _ = call(self.channel(service), release, pb.ReleaseRequest(request_id=request_id),
                                          self.timeout_s, self.secret)
                if status != "OK":
                    bad.append(Outcome(release.name, status, details, pb.ReleaseRequest(request_id=request_id)))
        for error in self.server_errors.since(errors_before) if self.server_errors else ():
            rpc, request = program[-1]
            outcome = Outcome(f"{rpc.service} (a server of the program)", "UNHANDLED", error, request)
            tally.add(outcome, frozenset())
            bad.append(outcome)
        return bad

    def leaks(self, wait_s: float = 5.0) -> dict[str, int]:
        """Requests still held by the in-process services (waiting up to `wait_s` for the
        router's releases, which may land just after its answer); empty when none."""
        until = time.monotonic() + wait_s
        while True:
            held = {name: count() for name, count in self.held.items() if count()}
            if not held or time.monotonic() >= until:
                return held
            time.sleep(0.02)


def describe(request) -> str:
    """A request as one line of text (protobuf's text format)."""
    from google.protobuf import text_format

    if isinstance(request, RawRequest):
        return f"{describe(request.message)} sent as {len(request.raw)} bytes, {request.why}: {request.raw[:200]!r}"
    return text_format.MessageToString(request, as_one_line=True)


def still_serving(target: Target) -> list[str]:
    """Valid calls of every RPC that has state (a generation, a prefill, a verify and a
    release on each internal service); returns what went wrong (empty: all succeeded)."""
    by_name = {r.name: r for r in rpcs()}
    calls = [("Specserve.Generate", pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=4))),
             ("Specserve.GenerateStream", pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=4))),
             ("Verifier.Prefill", pb.VerifierPrefillRequest(request_id="after", token_ids=[1, 2, 3], max_len=16)),
             ("Verifier.Verify", pb.VerifyRequest(request_id="after", tree=pb.DraftTree(tokens=[1], parents=[-1]))),
             ("Verifier.Release", pb.ReleaseRequest(request_id="after")),
             ("Drafter.Prefill", pb.DrafterPrefillRequest(request_id="after", drafter="pld", token_ids=[1, 2, 1])),
             ("Drafter.Propose", pb.ProposeRequest(request_id="after", context_length=3, new_tokens=[2],
                                                   max_tokens=3)),
             ("Drafter.Release", pb.ReleaseRequest(request_id="after"))]
    problems = []
    for name, request in calls:
        rpc = by_name[name]
        if rpc.service not in target.addresses:
            continue
        secret = None if rpc.service == "Specserve" else target.secret
        status, details, resp = call(target.channel(rpc.service), rpc, request, target.timeout_s, secret)
        if status != "OK":
            problems.append(f"{name}: {status} {details}")
        elif name == "Specserve.Generate" and not resp.token_ids:
            problems.append(f"{name}: no tokens")
        elif name.endswith("Release") and not resp.released:
            problems.append(f"{name}: nothing released")
        elif name == "Verifier.Verify" and resp.state_lost:
            problems.append(f"{name}: state lost")
    return problems


class CharTokenizer:
    """Enough of a tokenizer for the tiny target: each of the first 16 characters of the
    prompt (or the last message) is one token, its code point mod the vocabulary."""

    def __init__(self, vocab_size: int, chars: int = 16):
        self.vocab_size, self.chars = vocab_size, chars

    def encode(self, text: str) -> list[int]:
        return [ord(c) % self.vocab_size for c in text[:self.chars]]

    template_knows_tools = False

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.encode(messages[-1]["content"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(str, ids))

    def id_to_token(self, token_id: int) -> str:
        return str(token_id)


TINY_KINDS = ("pld", "suffix", "recycle", "layerskip")
TINY_SECRET = "fuzz-cluster-secret-0123456789abcdef"


@contextmanager
def tiny_services(kinds: tuple[str, ...] = TINY_KINDS, secret: str = TINY_SECRET) -> Iterator[Target]:
    """A router, a verifier and a drafter pool on loopback around the tiny target (no Ray),
    the internal two refusing calls without `secret`, as `specserve serve` runs them."""
    import torch
    from loopback import loopback
    from tiny import TINY, tiny_model

    from drafter_service.pool import DrafterPool
    from router.servicer import RouterConfig, RouterServicer
    from router.servicer import serve as serve_router
    from verifier_service.engine import VerifierEngine

    torch.set_num_threads(1)
    engine = VerifierEngine(tiny_model(0), max_batch=4, max_len=64)
    pool = DrafterPool(engine.model, kinds=list(kinds))
    config = RouterConfig(context_length=TINY.max_position_embeddings - 12, eos_token_ids=[0],
                          vocab_size=TINY.vocab_size, default_drafter=kinds[0], draft_length=3,
                          routed_drafters=tuple(kinds))
    with loopback(pool, engine, secret=secret) as coordinator:
        router, port = serve_router(RouterServicer(CharTokenizer(TINY.vocab_size), coordinator, config),
                                    "127.0.0.1", 0)
        errors = ServerErrors()
        logging.getLogger("grpc._server").addHandler(errors)
        target = Target({"Specserve": f"127.0.0.1:{port}", "Verifier": coordinator.services.verifiers()[0],
                         "Drafter": coordinator.services.drafters()[0]}, secret,
                        {"Verifier": engine.active_requests, "Drafter": pool.active_requests},
                        server_errors=errors)
        try:
            yield target
        finally:
            logging.getLogger("grpc._server").removeHandler(errors)
            target.close()
            router.stop(None)

# ---------------------------------------------------------------------- HTTP --

HTTP_CRASH_TYPES = frozenset({"internal_error"})
# gauges of the state a request holds, in the ingress's /metrics (one sample per service instance)
HELD_GAUGES = ("specserve_verifier_rows_held", "specserve_drafter_requests_held")
# fields a steered body keeps: the endpoints' own and the OpenAI fields they know (neutral or not)
MAX_STEERED_TOKENS = 8


# (field, the type it takes, which endpoint has it: True chat, False completions, None both)
HOSTILE_TARGETS = (("messages[0].content", "str", True), ("messages[0].role", "str", True), ("prompt", "str", False),
                   ("stop", "str", None), ("stop[0]", "str", None), ("model", "str", None), ("user", "str", None),
                   ("drafter", "str", None), ("namespace", "str", None), ("temperature", "float", None),
                   ("top_p", "float", None), ("max_tokens", "int", None), ("n", "int", None), ("seed", "int", None),
                   ("top_k", "int", None), ("stream", "bool", None), ("return_token_ids", "bool", None))
WRONG_TYPES = {"str": (5, True, {}, 1.5), "float": (True, "0.5", [], {}), "int": (True, "7", 4.0, [], {}),
               "bool": (1, "true", [], None)}
HOSTILE_KINDS = ("surrogate",) * 3 + ("non_finite",) * 3 + ("wrong_type",) * 3 + ("deep",) * 3 + ("oversized",)


@dataclass(frozen=True)
class RawJson:
    """JSON text a value stands for where json.dumps cannot write it (1e309, deep nesting)."""
    text: str


@dataclass(frozen=True)
class HostileBody:
    """A valid request with the field at `path` set to `value`; `kind` "oversized": the valid
    request padded with spaces to `size` bytes (sent chunked or with its Content-Length)."""
    chat: bool
    path: str  # "messages[0].content", as the error's param names it
    kind: str
    value: object
    size: int = 0
    chunked: bool = False

    @property
    def route(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, model: str) -> bytes:
        import json
        import re

        body = {"model": model, "max_tokens": 2, "temperature": 0, "stop": ["zzzz"],
                **({"messages": [{"role": "user", "content": "Hello"}]} if self.chat else {"prompt": "Hello"})}
        if self.kind != "oversized":
            *parents, last = [int(k) if k.isdigit() else k for k in re.findall(r"\w+", self.path)]
            holder = body
            for key in parents:
                holder = holder[key]
            holder[last] = "@RAW@" if isinstance(self.value, RawJson) else self.value
        text = json.dumps(body)  # ensure_ascii: a surrogate as its \u escape; NaN and Infinity as Python writes them
        return (text.replace('"@RAW@"', self.value.text) if isinstance(self.value, RawJson) else text).encode()

    def expected(self, status: int, error: dict) -> bool:
        if self.kind == "oversized":
            return (status, error["code"]) == (413, "request_too_large")
        if isinstance(self.value, RawJson) and len(self.value.text) > 2000:  # past the parser's depth
            return (status, error["code"], error["param"]) == (400, "invalid_json", None)
        param = error["param"] or ""
        return status == 400 and bool(error["code"]) and (param == self.path or param.startswith(self.path + "["))

    def expectation(self) -> str:
        return {"oversized": "413 request_too_large"}.get(self.kind, f"400 naming {self.path}")

    def describe(self) -> dict:
        value = self.value.text[:40] if isinstance(self.value, RawJson) else repr(self.value)
        return {"path": self.path, "kind": self.kind, "value": value, "size": self.size, "chunked": self.chunked}


def post_raw(base: str, path: str, body: bytes, size: int = 0, chunked: bool = False,
             timeout: float = 120.0) -> tuple[int, object, float]:
    """POST `body` padded with spaces to `size` bytes (JSON allows them) on a connection of its
    own, reading the answer while sending: a server may answer before it has read the whole
    body, and close. (status, the answer's JSON or {}, seconds to the answer)."""
    import http.client
    import json
    import socket
    import threading
    from urllib.parse import urlsplit

    size = max(size, len(body))
    host, port = urlsplit(base).hostname, urlsplit(base).port
    sock = socket.create_connection((host, port), timeout=timeout)
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % size
    started = time.monotonic()
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s\r\n\r\n"
                 % (path.encode(), host.encode(), framing))

    def send() -> None:
        left, first = size, body
        try:
            while left > 0:
                part = (first or b" " * 65536)[:left]
                first = b""
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                left -= len(part)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed before taking it all
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        response = http.client.HTTPResponse(sock)
        response.begin()
        answered = time.monotonic() - started
        raw = response.read()
        try:
            return response.status, json.loads(raw), answered
        except ValueError:
            return response.status, {}, answered
    finally:
        sock.close()
        sender.join(timeout=timeout)


@dataclass
class HttpOutcome:
    operation: str  # "POST /v1/chat/completions"
    status: int
    ok: bool
    problem: str  # why not ok
    body: object  # what was sent


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _repair(body: dict) -> None:
    """Make valid (or drop) each field of an OpenAI request body that the router checks."""
    from deploy import openai_api as oa
    from speculative.drafter_kinds import is_drafter
    from speculative.namespaces import _ALLOWED, MAX_NAMESPACE_LENGTH

    def text(value) -> str:
        return value if isinstance(value, str) and value.strip() else "Hello"

    for key in [k for k in body if k in oa.NEUTRAL]:
        del body[key]
    if isinstance(body.get("messages"), list) and body["messages"]:
        body["messages"] = [{"role": m.get("role") if m.get("role") in ("system", "user", "assistant") else "user",
                             "content": text(m.get("content"))} if isinstance(m, dict) else
                            {"role": "user", "content": "Hello"} for m in body["messages"]]
    elif "messages" in body:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    if "prompt" in body:
        body["prompt"] = text(body["prompt"][0] if isinstance(body["prompt"], list) and body["prompt"]
                              else body["prompt"])
    checks = {"temperature": lambda v: isinstance(v, (int, float)) and 0 <= v <= 2,
              "top_p": lambda v: isinstance(v, (int, float)) and 0 < v <= 1,
              "top_k": lambda v: _is_int(v) and 0 <= v < 2**31,
              "seed": lambda v: _is_int(v) and 0 <= v < 2**63,
              "n": lambda v: _is_int(v) and 1 <= v <= oa.MAX_CHOICES,
              "stop": lambda v: isinstance(v, str) and v or isinstance(v, list) and len(v) <= 8 and all(
                  isinstance(s, str) and s for s in v),
              "drafter": lambda v: isinstance(v, str) and "/" not in v and is_drafter(v),
              "domain": lambda v: isinstance(v, str) and v in ("", *DOMAINS),
              "namespace": lambda v: isinstance(v, str) and len(v) <= MAX_NAMESPACE_LENGTH and _ALLOWED.fullmatch(v),
              "stream_options": lambda v: body.get("stream") is True and isinstance(v, dict)}
    for key, ok in checks.items():
        if key in body and body[key] is not None and not ok(body[key]):
            del body[key]


class HttpFuzz:
    """schemathesis over the OpenAPI document of a running `specserve serve`: every operation,
    bodies valid by the document (positive) and not (negative). Three in four bodies are
    steered to reach the model: the served model's name, only the fields the endpoints
    know, at most MAX_STEERED_TOKENS tokens a choice (the generated ones run to thousands).
    The property: 2xx, or 4xx in OpenAI's error shape; never 5xx; a stream's error events
    never internal."""

    def __init__(self, base: str, model: str, timeout_s: float = 300.0, max_body_bytes: int = 2 * 1024 * 1024):
        import requests
        import schemathesis

        self.base, self.model, self.timeout_s = base.rstrip("/"), model, timeout_s
        self.max_body_bytes = max_body_bytes  # the server's [http] max_body_bytes
        self.schema = schemathesis.openapi.from_url(f"{self.base}/openapi.json")
        self.schema.config.max_stream_events = 10**6  # read streams to their end (schemathesis stops at 20 events)
        self.operations = [result.ok() for result in self.schema.get_all_operations()]
        self.session = requests.Session()
        self.counts: Counter = Counter()  # (operation, status) -> calls
        self.refused: Counter = Counter()  # (operation, the param a 4xx named) -> calls
        self.failures: list[HttpOutcome] = []
        self.failure_count = 0

    def strategy(self) -> st.SearchStrategy:
        """(case, steer) pairs over every operation and both generation modes; one in three a
        (HostileBody, None)."""
        from schemathesis import GenerationMode

        cases = [op.as_strategy(generation_mode=mode) for op in self.operations for mode in GenerationMode]
        generated = st.tuples(st.one_of(cases), st.sampled_from([0, 1, 2, 3, 3]))
        hostile = st.tuples(st.builds(self.hostile, st.booleans(), st.sampled_from(HOSTILE_KINDS),
                                      st.integers(0, 2**16)), st.none())
        return st.integers(0, 2).flatmap(lambda i: hostile if i == 0 else generated)

    def hostile(self, chat: bool, kind: str, choice: int) -> HostileBody:
        targets = [(path, type_) for path, type_, only in HOSTILE_TARGETS if only in (None, chat)]
        path, type_ = targets[choice % len(targets)]
        if kind == "oversized":
            return HostileBody(chat, path, kind, None, self.max_body_bytes + 1 + choice % 4096, bool(choice & 1))
        depth = (50, 500, 100_000)[choice % 3]
        value = {"surrogate": lambda: ("x\ud800y", "\udfff", "\ud83d")[choice % 3],
                 "non_finite": lambda: (math.inf, -math.inf, math.nan, RawJson("1e309"), RawJson("-1e309"))[choice % 5],
                 "wrong_type": lambda: WRONG_TYPES[type_][choice % len(WRONG_TYPES[type_])],
                 "deep": lambda: RawJson("[" * depth + "]" * depth)}[kind]()
        return HostileBody(chat, path, kind, value)

    def run_hostile(self, case: HostileBody) -> HttpOutcome:
        """Send it; the answer must be the error its value deserves (HostileBody.expected)."""
        label = f"POST {case.route} [hostile]"
        try:
            status, body, _ = post_raw(self.base, case.route, case.body(self.model), case.size, case.chunked,
                                       self.timeout_s)
        except Exception as e:  # noqa: BLE001 - recorded as a failure, as run() does
            status, body = 0, {"no response": f"{type(e).__name__}: {e}"}
        error = body.get("error") if isinstance(body, dict) else None
        ok = isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} and \
            case.expected(status, error)
        outcome = HttpOutcome(label, status, ok, "" if ok else f"expected {case.expectation()}, got {body!r:.300}",
                              case.describe())
        self.counts[(label, status)] += 1
        if ok:
            self.refused[(label, error["param"])] += 1
        else:
            self.failure_count += 1
            if len(self.failures) < 20:
                self.failures.append(outcome)
        return outcome

    def steer(self, case, aim: int) -> None:
        """aim 0: the body as generated; 1: the served model's name; 2: also only the fields
        the endpoint knows, and few tokens; 3: also each field the router checks made valid
        (or dropped), so that the combinations of the rest reach the model."""
        body = case.body
        if aim == 0 or not isinstance(body, dict) or case.method.upper() != "POST":
            return
        body["model"] = self.model
        if aim >= 2:
            from deploy import openai_api as oa

            kind = oa.ChatCompletionRequest if case.path.endswith("chat/completions") else oa.CompletionRequest
            for key in [k for k in body if k not in kind.model_fields and k not in oa.NEUTRAL]:
                del body[key]
            for key in ("max_tokens", "max_completion_tokens"):  # 188.0 is an int to pydantic
                value = body.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                        MAX_STEERED_TOKENS < value < 2**31 and value == int(value):
                    body[key] = 1 + int(value) % MAX_STEERED_TOKENS
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                body["max_tokens"] = aim  # unset: the server's default of 128 tokens a choice
        if aim >= 3:
            _repair(body)

    def run(self, case, aim: int | None) -> HttpOutcome:
        if isinstance(case, HostileBody):
            return self.run_hostile(case)
        self.steer(case, aim)
        label = case.operation.label
        try:
            response = case.call(base_url=self.base, session=self.session, timeout=self.timeout_s)
        except Exception as e:
            outcome = HttpOutcome(label, 0, False, f"no response: {type(e).__name__}: {e}", case.body)
        else:
            outcome = HttpOutcome(label, response.status_code, *self.judge(label, response), case.body)
            if 400 <= response.status_code < 500 and outcome.ok:
                self.refused[(label, response.json()["error"]["param"])] += 1
        self.counts[(label, outcome.status)] += 1
        if not outcome.ok:
            self.failure_count += 1
            if len(self.failures) < 20:
                self.failures.append(outcome)
        return outcome

    @staticmethod
    def judge(label: str, response) -> tuple[bool, str]:
        import json

        status, text = response.status_code, response.content.decode("utf-8", "replace")
        if status >= 500:
            return False, f"server error: {text[:300]}"
        if 400 <= status < 500:
            try:
                error = json.loads(text)["error"]
            except (ValueError, KeyError, TypeError):
                return False, f"4xx not in OpenAI's error shape: {text[:300]}"
            if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
                return False, f"4xx not in OpenAI's error shape: {text[:300]}"
            return True, ""
        if status >= 300:
            return False, f"unexpected status: {text[:300]}"
        if getattr(response, "stream_cut_short", False):
            return False, f"the stream did not end within the timeout: {text[-300:]}"
        content_type = response.headers.get("content-type") or ""  # schemathesis: a list of values
        if "text/event-stream" in " ".join(content_type if isinstance(content_type, list) else [content_type]):
            events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
            if not events or events[-1] != "[DONE]":
                return False, f"a stream that does not end with [DONE]: {text[-300:]}"
            for event in events[:-1]:
                error = json.loads(event).get("error")
                if error is not None and (error.get("type") in HTTP_CRASH_TYPES or error.get("code") == "internal"):
                    return False, f"an internal error in the stream: {event[:300]}"
        elif label.startswith("POST"):
            try:
                body = json.loads(text)
            except ValueError:
                return False, f"a 2xx completion that is not JSON: {text[:300]!r}"
            if not isinstance(body, dict) or "choices" not in body:
                return False, f"a completion without choices: {text[:300]}"
        return True, ""

    def held(self) -> dict[str, float]:
        """Every service instance's held requests, from the ingress's /metrics:
        {'specserve_verifier_rows_held{service=...,instance=...}': value}."""
        import re

        text = self.session.get(f"{self.base}/metrics", timeout=30).text
        found = {}
        for name in HELD_GAUGES:
            for labels, value in re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
                found[name + labels] = float(value)
        return found

    def leaks(self, wait_s: float = 30.0) -> dict[str, float]:
        """Gauges still above 0 once in-flight work has settled (empty: none); raises if
        /metrics shows no verifier at all."""
        until = time.monotonic() + wait_s
        while True:
            held = self.held()
            if not any(k.startswith(HELD_GAUGES[0]) for k in held):
                raise AssertionError("/metrics shows no verifier's specserve_verifier_rows_held")
            leaked = {k: v for k, v in held.items() if v}
            if not leaked or time.monotonic() >= until:
                return leaked
            time.sleep(0.5)

    def still_serving(self) -> tuple[bool, str]:
        """Whether a plain chat request succeeds, and what it got."""
        r = self.session.post(f"{self.base}/v1/chat/completions", timeout=self.timeout_s, json={
            "model": self.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
            "temperature": 0})
        ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        return ok, f"{r.status_code} {r.text[:200]}"
