"""Client for the specserve gRPC API (service `specserve.v1.Specserve`).

    from specserve.client import Client

    with Client("localhost:50051", timeout=30) as client:
        done = client.generate("Explain speculative decoding.", max_tokens=64)
        print(done.text, done.usage.mean_accepted_tokens)
        for chunk in client.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(chunk.text, end="", flush=True)

`AsyncClient` has the same API for asyncio (`await client.generate(...)`,
`async for chunk in client.stream(...)`); create it inside the running event loop.

Results are plain frozen dataclasses (`Completion`, `Chunk`, `Usage`,
`ToolCall`, `TokenLogprob`); no protobuf types reach the caller.

Structured output, tools, logprobs, penalties (the same as the HTTP API's):

    person = client.generate(messages=[...], json_schema={"type": "object", ...})
    digits = client.generate("12 + 30 =", regex=r" [0-9]+")
    called = client.generate(messages=[...], tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": {...}}}], tool_choice="required")
    called.tool_calls[0].name, called.tool_calls[0].arguments  # finish_reason "tool_calls"
    scored = client.generate("Hello", logprobs=5)  # scored.logprobs[i].logprob, .top

Errors: every failed call raises `SpecserveError`, whose `.code` is the
`grpc.StatusCode` (e.g. `DEADLINE_EXCEEDED`, `UNAVAILABLE`, `INVALID_ARGUMENT`)
and `.details` the server's message; the original `grpc.RpcError` is its
`__cause__`. Bad arguments caught before sending (neither or both of
`prompt` / `messages`, text with a lone surrogate) raise `ValueError`.

Deadlines: `timeout` (seconds) on a call, else the client's `timeout`, becomes
the gRPC deadline. It covers the whole call, retries included; None = no deadline.

Retries: gRPC itself retries calls that fail with UNAVAILABLE, configured
through the channel's service config: up to `max_attempts` attempts (1 turns
retrying off, gRPC allows at most 5), with jittered exponential backoff from
0.1 s up to 2 s. A stream is retried only until its first response arrives;
after that a failure reaches the caller, since chunks already handed out
cannot be taken back.

TLS: `tls=True` verifies the server against `root_certificates` (PEM bytes),
or the system's roots when None.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc

SERVICE = "specserve.v1.Specserve"
MAX_ATTEMPTS_LIMIT = 5  # gRPC silently caps retryPolicy.maxAttempts here; refuse more instead


class SpecserveError(Exception):
    """A call failed; `code` is the gRPC status code, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    target_forward_passes: int
    draft_tokens: int
    accepted_draft_tokens: int
    mean_accepted_tokens: float  # completion tokens per target forward pass
    drafter: str  # the drafter kind that served the request
    reused_drafts: int = 0  # rounds drafted while the previous one was verified (pipelining)
    forced_tokens: int = 0  # output tokens a grammar forced (jump-forward), drafted for free

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: the function's name and its arguments, a JSON object as JSON text."""

    id: str
    name: str
    arguments: str

    def parsed_arguments(self) -> dict:
        return json.loads(self.arguments)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target (`processed_logprobs`: after penalties,
    bias and grammar), its text and bytes, and its likeliest alternatives, best first
    (each a TokenLogprob with no alternatives of its own)."""

    token: int
    logprob: float
    text: str = ""
    bytes: bytes = b""
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Completion:
    text: str  # with tool calls: what the output says around them
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop", "length" or "tool_calls"
    usage: Usage
    request_id: str
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None  # one a token, when asked (`logprobs=`)


@dataclass(frozen=True)
class Chunk:
    """The tokens verified in one round; the last chunk also carries finish_reason and usage,
    and the tool calls (they come whole, at the end)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage | None
    request_id: str
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None  # of token_ids, when asked


def _service_config(max_attempts: int) -> str:
    method: dict[str, Any] = {"name": [{"service": SERVICE}]}
    if max_attempts > 1:  # gRPC rejects a retryPolicy with maxAttempts < 2
        method["retryPolicy"] = {
            "maxAttempts": max_attempts,
            "initialBackoff": "0.1s",
            "maxBackoff": "2s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }
    return json.dumps({"methodConfig": [method]})


def _channel_options(max_attempts: int, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    if not 1 <= max_attempts <= MAX_ATTEMPTS_LIMIT:
        raise ValueError(f"max_attempts must be in 1..{MAX_ATTEMPTS_LIMIT}, got {max_attempts}")
    merged = {"grpc.enable_retries": 1, "grpc.service_config": _service_config(max_attempts)}
    merged.update(options)  # the caller's options win
    return list(merged.items())


def _credentials(tls: bool, root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    if root_certificates is not None and not tls:
        raise ValueError("root_certificates given without tls=True")
    return grpc.ssl_channel_credentials(root_certificates) if tls else None


def _text(name: str, value: str) -> str:
    """`value`, if protobuf can send it: UTF-8 has no lone surrogate (a JSON "\\ud800" escape makes one)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: not valid Unicode text (a lone surrogate at {e.start})") from None
    return value


def request(prompt: str | None = None, *, messages: Sequence[Mapping[str, Any]] | None = None,
            max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
            seed: int | None = None, stop: Sequence[str] = (), domain_hint: str = "", drafter: str = "",
            request_id: str = "", pipelined: bool | None = None, namespace: str = "",
            json_schema: Mapping[str, Any] | str | None = None, json_object: bool = False, regex: str | None = None,
            choice: Sequence[str] | None = None, grammar: str | None = None,
            tools: Sequence[Mapping[str, Any]] = (), tool_choice: str | Mapping[str, Any] = "",
            parallel_tool_calls: bool | None = None, logprobs: int | None = None, processed_logprobs: bool = False,
            presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float | None = None,
            logit_bias: Mapping[int, float] | None = None, min_tokens: int = 0, stop_token_ids: Sequence[int] = (),
            draft_length: int | None = None, eagle_placement: str = "") -> pb.GenerateRequest:
    """The `GenerateRequest` of a prompt (or chat `messages`) and its settings: every
    method of `Client` and `AsyncClient` takes these fields, written once here.

    Structured output, one at most: `json_schema` (a JSON schema, as a dict or JSON text),
    `json_object`, `regex`, `choice` (the output is one of the strings) or `grammar` (a Lark
    grammar, llguidance's dialect). `tools`: functions the model may call, as OpenAI writes
    them (`{"type": "function", "function": {"name", "description", "parameters"}}`, or the
    inner object alone); `tool_choice` "none", "auto" (the default), "required" or a
    function's name (or OpenAI's `{"type": "function", "function": {"name": ...}}`).
    Messages may carry an assistant's `tool_calls` (ToolCall, or OpenAI's dicts) and a tool's
    answer (`{"role": "tool", "tool_call_id": ..., "content": ...}`). `logprobs`: how many
    alternatives each token's logprobs list (0..20; None: no logprobs). Penalties and
    `logit_bias` (token id -> bias in [-100, 100]) as OpenAI's; `repetition_penalty`,
    `min_tokens`, `stop_token_ids` as vLLM's. `draft_length`: the most draft tokens a round
    (0: no speculation; None: the server's). `eagle_placement`: where an eagle drafter runs,
    "verifier" or "pool" ("": the server's `[router] eagle_placement`)."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    if messages is not None and not messages:
        raise ValueError("messages must not be empty")
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                 logit_bias=dict(logit_bias or {}), min_tokens=min_tokens,
                                 stop_token_ids=list(stop_token_ids))
    if seed is not None:  # `optional` on the wire: unset means unseeded
        sampling.seed = seed
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    if logprobs is not None:
        sampling.logprobs = logprobs
        sampling.processed_logprobs = processed_logprobs
    req = pb.GenerateRequest(sampling=sampling, stop=[_text(f"stop[{i}]", s) for i, s in enumerate(stop)],
                             domain_hint=domain_hint, drafter=drafter,
                             request_id=request_id, namespace=namespace, eagle_placement=eagle_placement)
    if pipelined is not None:  # unset: the server's setting
        req.pipelined = pipelined
    if draft_length is not None:
        req.draft_length = draft_length
    _constrain(req.constraint, json_schema=json_schema, json_object=json_object, regex=regex, choice=choice,
               grammar=grammar)
    for i, tool in enumerate(tools):
        req.tools.append(_tool(tool, i))
    req.tool_choice = _tool_choice(tool_choice)
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = parallel_tool_calls
    if prompt is not None:
        req.prompt = _text("prompt", prompt)
    else:
        for i, m in enumerate(messages or ()):
            req.messages.append(_message(m, i))
    return req


MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def _message(m: Mapping[str, Any], i: int) -> pb.ChatMessage:
    if "role" not in m or ("content" not in m and not m.get("tool_calls")) or not set(m) <= MESSAGE_KEYS:
        raise ValueError(f"a message needs 'role' and 'content' (an assistant's may have 'tool_calls' instead), "
                         f"and at most {sorted(MESSAGE_KEYS)}; got {sorted(m)}")
    msg = pb.ChatMessage(role=_text(f"messages[{i}].role", m["role"]),
                         content=_text(f"messages[{i}].content", m.get("content") or ""),
                         name=_text(f"messages[{i}].name", m.get("name") or ""),
                         tool_call_id=_text(f"messages[{i}].tool_call_id", m.get("tool_call_id") or ""))
    for j, call in enumerate(m.get("tool_calls") or ()):
        if isinstance(call, ToolCall):
            call_id, name, arguments = call.id, call.name, call.arguments
        else:  # OpenAI's {"id", "type", "function": {"name", "arguments"}}, or flat
            inner = call.get("function", call)
            call_id, name, arguments = call.get("id", ""), inner["name"], inner.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        where = f"messages[{i}].tool_calls[{j}]"
        msg.tool_calls.add(id=_text(f"{where}.id", call_id), name=_text(f"{where}.name", name),
                           arguments=_text(f"{where}.arguments", arguments))
    return msg


def _constrain(constraint: pb.Constraint, **given: Any) -> None:
    """The one structured output given (a falsy value: not given)."""
    chosen = [(kind, value) for kind, value in given.items() if value is not None and value is not False]
    if len(chosen) > 1:
        raise ValueError(f"give at most one of json_schema, json_object, regex, choice, grammar; got "
                         f"{', '.join(kind for kind, _ in chosen)}")
    if not chosen:
        return
    kind, value = chosen[0]
    if kind == "json_schema":
        constraint.json_schema = _text("json_schema", value if isinstance(value, str) else json.dumps(value))
    elif kind == "json_object":
        constraint.json_object = True
    elif kind == "choice":
        if isinstance(value, str):
            raise ValueError("choice: a sequence of strings, not one string")
        constraint.choice.options.extend(_text(f"choice[{i}]", c) for i, c in enumerate(value))
    else:
        setattr(constraint, kind, _text(kind, value))


def _tool(tool: Mapping[str, Any], i: int) -> pb.Tool:
    """OpenAI's tool, or its function alone."""
    f = tool.get("function", tool) if tool.get("type", "function") == "function" else None
    if f is None or "name" not in f:
        raise ValueError(f"tools[{i}]: a function's name (and description, parameters) is needed, "
                         f"as {{'type': 'function', 'function': {{'name': ...}}}}")
    parameters = f.get("parameters")
    if parameters is not None and not isinstance(parameters, str):
        parameters = json.dumps(parameters)
    return pb.Tool(name=_text(f"tools[{i}].name", f["name"]),
                   description=_text(f"tools[{i}].description", f.get("description") or ""),
                   parameters=_text(f"tools[{i}].parameters", parameters or ""))


def _tool_choice(choice: str | Mapping[str, Any]) -> str:
    if isinstance(choice, Mapping):
        try:
            return _text("tool_choice", choice["function"]["name"])
        except (KeyError, TypeError):
            raise ValueError("tool_choice: 'none', 'auto', 'required', a function's name or "
                             "{'type': 'function', 'function': {'name': ...}}") from None
    return _text("tool_choice", choice)


def _takes_request_fields(method):
    """`method(self, prompt=None, *, timeout=None, metadata=(), **fields)` shown (help, IDEs)
    with `request`'s fields in place of `**fields`."""
    own = inspect.signature(method).parameters
    fields = list(inspect.signature(request).parameters.values())
    method.__signature__ = inspect.Signature(
        [own["self"], *fields, own["timeout"], own["metadata"]],
        return_annotation=inspect.signature(method).return_annotation)
    return method


def _usage(u: pb.Usage) -> Usage:
    return Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                 target_forward_passes=u.target_forward_passes, draft_tokens=u.draft_tokens,
                 accepted_draft_tokens=u.accepted_draft_tokens, mean_accepted_tokens=u.mean_accepted_tokens,
                 drafter=u.drafter, reused_drafts=u.reused_drafts, forced_tokens=u.forced_tokens)


def _calls(calls: Sequence[pb.ToolCall]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(c.id, c.name, c.arguments) for c in calls)


def _logprobs(logprobs: Sequence[pb.TokenLogprob], asked: bool) -> tuple[TokenLogprob, ...] | None:
    if not asked:
        return None
    return tuple(TokenLogprob(lp.token, lp.logprob, lp.text, lp.token_bytes, tuple(
        TokenLogprob(t, v, text, raw) for t, v, text, raw in zip(lp.top_ids, lp.top_logprobs, lp.top_texts,
                                                                 lp.top_bytes))) for lp in logprobs)


def _completion(r: pb.GenerateResponse, req: pb.GenerateRequest) -> Completion:
    return Completion(text=r.text, token_ids=tuple(r.token_ids), finish_reason=r.finish_reason,
                      usage=_usage(r.usage), request_id=r.request_id, tool_calls=_calls(r.tool_calls),
                      logprobs=_logprobs(r.logprobs, req.sampling.HasField("logprobs")))


def _chunk(c: pb.GenerateChunk, req: pb.GenerateRequest) -> Chunk:
    return Chunk(text=c.text, token_ids=tuple(c.token_ids), finish_reason=c.finish_reason or None,
                 usage=_usage(c.usage) if c.HasField("usage") else None, request_id=c.request_id,
                 tool_calls=_calls(c.tool_calls), logprobs=_logprobs(c.logprobs, req.sampling.HasField("logprobs")))


def _error(e: grpc.RpcError) -> SpecserveError:
    # Raised RpcErrors (sync and aio) are also grpc.Call objects carrying the status.
    return SpecserveError(e.code(), e.details() or "")  # type: ignore[attr-defined]


class _Base:
    def __init__(self, tls: bool, root_certificates: bytes | None,
                 metadata: Sequence[tuple[str, str]], timeout: float | None, max_attempts: int,
                 options: Sequence[tuple[str, Any]]):
        self._credentials = _credentials(tls, root_certificates)
        self._options = _channel_options(max_attempts, options)
        self._metadata = tuple(metadata)
        self._timeout = timeout

    def _call_args(self, timeout: float | None, metadata: Sequence[tuple[str, str]]) -> dict[str, Any]:
        return {"timeout": self._timeout if timeout is None else timeout,
                "metadata": self._metadata + tuple(metadata)}


class Client(_Base):
    """Blocking client over one gRPC channel; safe to share between threads."""

    def __init__(self, target: str, *, tls: bool = False, root_certificates: bytes | None = None,
                 metadata: Sequence[tuple[str, str]] = (), timeout: float | None = None, max_attempts: int = 4,
                 options: Sequence[tuple[str, Any]] = ()):
        super().__init__(tls, root_certificates, metadata, timeout, max_attempts, options)
        self._channel = (grpc.secure_channel(target, self._credentials, self._options) if self._credentials
                         else grpc.insecure_channel(target, self._options))
        self._stub = pb_grpc.SpecserveStub(self._channel)

    @_takes_request_fields
    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] = (), **fields: Any) -> Completion:
        """The whole completion (`request`'s fields; `timeout`, `metadata`: this call's)."""
        req = request(prompt, **fields)
        try:
            return _completion(self._stub.Generate(req, **self._call_args(timeout, metadata)), req)
        except grpc.RpcError as e:
            raise _error(e) from e

    @_takes_request_fields
    def stream(self, prompt: str | None = None, *, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] = (), **fields: Any) -> Iterator[Chunk]:
        """The completion's chunks as they come (`request`'s fields)."""
        # Not a generator itself, so bad arguments raise here and the call starts now.
        req = request(prompt, **fields)
        return self._chunks(self._stub.GenerateStream(req, **self._call_args(timeout, metadata)), req)

    @staticmethod
    def _chunks(call: Any, req: pb.GenerateRequest) -> Iterator[Chunk]:
        try:
            for c in call:
                yield _chunk(c, req)
        except grpc.RpcError as e:
            raise _error(e) from e
        finally:
            call.cancel()  # the caller stopped early: let the server stop generating too

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client (grpc.aio) with the same API as `Client`."""

    def __init__(self, target: str, *, tls: bool = False, root_certificates: bytes | None = None,
                 metadata: Sequence[tuple[str, str]] = (), timeout: float | None = None, max_attempts: int = 4,
                 options: Sequence[tuple[str, Any]] = ()):
        super().__init__(tls, root_certificates, metadata, timeout, max_attempts, options)
        self._channel = (grpc.aio.secure_channel(target, self._credentials, self._options) if self._credentials
                         else grpc.aio.insecure_channel(target, self._options))
        self._stub = pb_grpc.SpecserveStub(self._channel)

    @_takes_request_fields
    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] = (), **fields: Any) -> Completion:
        """The whole completion (`request`'s fields; `timeout`, `metadata`: this call's)."""
        req = request(prompt, **fields)
        try:
            return _completion(await self._stub.Generate(req, **self._call_args(timeout, metadata)), req)
        except grpc.RpcError as e:
            raise _error(e) from e

    @_takes_request_fields
    def stream(self, prompt: str | None = None, *, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] = (), **fields: Any) -> AsyncIterator[Chunk]:
        """The completion's chunks as they come (`request`'s fields)."""
        req = request(prompt, **fields)
        return self._chunks(self._stub.GenerateStream(req, **self._call_args(timeout, metadata)), req)

    @staticmethod
    async def _chunks(call: Any, req: pb.GenerateRequest) -> AsyncIterator[Chunk]:
        try:
            async for c in call:
                yield _chunk(c, req)
        except grpc.RpcError as e:
            raise _error(e) from e
        finally:
            call.cancel()  # the caller stopped early: let the server stop generating too

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
