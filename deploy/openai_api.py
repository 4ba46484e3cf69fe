"""The OpenAI-compatible HTTP protocol: request models, their translation into the
router's `GenerateRequest`, and the response, chunk and error objects.

No Ray and no server here (deploy/app.py serves it): the router validates what it
validates for gRPC too (prompt, sampling ranges, stop strings, drafter, domain), so
both APIs share one path and one set of rules; this module checks only what is
HTTP's own (the body's shape, the model name, fields we do not support).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from protos import specserve_pb2 as pb

# OpenAI request fields we know and do not implement: a request that sets one (to anything
# but its neutral value) gets a 400 naming it rather than an answer that ignores it
NEUTRAL = {"logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
           "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []),
           "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
           "response_format": (None, {"type": "text"}), "best_of": (None, 1), "echo": (None, False),
           "suffix": (None, ""), "parallel_tool_calls": (None,), "service_tier": (None, "auto", "default"),
           "store": (None, False), "metadata": (None, {}), "modalities": (None, ["text"]),
           "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,)}
MAX_CHOICES = 8  # `n`: each choice is a request of its own
INT32 = {"ge": -2**31, "le": 2**31 - 1}  # what the router's int32 fields carry


class OpenAIError(Exception):
    """An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_exceeded", 500: "internal_error",
             503: "service_unavailable", 504: "timeout"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s  # a 429's Retry-After

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(math.ceil(self.retry_after_s))}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


# the router's gRPC status names and the HTTP status each becomes
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "UNAUTHENTICATED": 401, "RESOURCE_EXHAUSTED": 429,
               "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
# the router refuses values (a range, an unknown drafter): OpenAI's code for those
ROUTER_CODE = {"INVALID_ARGUMENT": "invalid_value"}


def router_error(status: str, message: str, field: str | None = None, too_long: bool = False,
                 retry_after_s: float | None = None) -> OpenAIError:
    """The HTTP form of a request the router refused or could not finish; `field` as the
    OpenAI request spells it (a chat request's "prompt" is its messages: the ingress renames it)."""
    param = {"domain_hint": "domain"}.get(field, field)
    if too_long:
        return OpenAIError(413, message, param, "prompt_too_long")
    return OpenAIError(HTTP_STATUS.get(status, 500), message, param, ROUTER_CODE.get(status, status.lower()),
                       retry_after_s)


# strict: a bool is not an integer, nor a string a number (OpenAI refuses `max_tokens: true`)
class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str | list[ContentPart] | None = ""
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Request(BaseModel):
    """Fields both endpoints take. specserve's own (`top_k`, `drafter`, `domain`, `namespace`,
    `return_token_ids`) come in the body beside OpenAI's, as vLLM takes its extras."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: int | None = Field(None, **INT32)
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int = Field(0, **INT32)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    drafter: str = ""
    domain: str = ""
    namespace: str = ""
    return_token_ids: bool = False

    def check_supported(self) -> None:
        """A field we do not implement, set to anything but its neutral value, is refused."""
        for key, value in (self.model_extra or {}).items():
            if key not in NEUTRAL:
                raise OpenAIError(400, f"unknown field {key!r}", key, "unknown_field")
            if value not in NEUTRAL[key]:
                raise OpenAIError(400, f"{key!r} is not supported by this server", key, "unsupported_field")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options: needs stream: true", "stream_options", "invalid_value")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def generate_requests(self, request_id: str) -> list[pb.GenerateRequest]:
        """One router request per choice; with a seed, choice i samples with seed + i (so the
        choices differ and the whole answer is reproducible)."""
        requests = []
        for i in range(self.n):
            sampling = pb.SamplingParams(temperature=self.temperature, top_k=self.top_k)
            if self.max_output_tokens() is not None:
                sampling.max_tokens = self.max_output_tokens()
            if self.top_p is not None:
                sampling.top_p = self.top_p
            if self.seed is not None:
                if self.seed < 0:
                    raise OpenAIError(400, f"seed: must be >= 0, got {self.seed}", "seed", "invalid_value")
                if self.seed + self.n > 2**64:  # choice i samples with seed + i, a uint64
                    raise OpenAIError(400, f"seed: must be at most 2^64 - n ({2**64 - self.n}), got {self.seed}",
                                      "seed", "invalid_value")
                sampling.seed = self.seed + i
            req = pb.GenerateRequest(sampling=sampling, stop=self.stops(), domain_hint=self.domain,
                                     request_id=f"{request_id}-{i}", drafter=self.drafter, namespace=self.namespace)
            self.fill_input(req)
            requests.append(req)
        return requests

    def max_output_tokens(self) -> int | None:
        return self.max_tokens

    def fill_input(self, req: pb.GenerateRequest) -> None:
        raise NotImplementedError


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, **INT32)

    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def fill_input(self, req: pb.GenerateRequest) -> None:
        for m in self.messages:
            req.messages.add(role=m.role, content=m.text())


class CompletionRequest(_Request):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError("give one prompt (a string, or a list of one string)")
        return prompt

    def fill_input(self, req: pb.GenerateRequest) -> None:
        req.prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def loads(raw: bytes) -> Any:
    """The body's JSON, or a 400 `invalid_json` (nesting too deep for the parser included)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise OpenAIError(400, f"the body is not valid JSON: {reason}", None, "invalid_json") from None


def parse(model: type[_Request], body: Any) -> _Request:
    """The request, or an OpenAIError naming the first field at fault."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object", None, "invalid_json")
    unencodable = _lone_surrogate(body)
    if unencodable is not None:  # JSON's \ud800 escapes decode to one; protobuf strings cannot carry it
        raise OpenAIError(400, f"{unencodable}: not valid Unicode text (a lone UTF-16 surrogate)", unencodable,
                          "invalid_value")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    req.check_supported()
    return req


def _lone_surrogate(body: dict) -> str | None:
    """The path (`messages[0].content`) of the first string or key holding a lone surrogate, or None.
    A loop, not recursion: the body may nest as deep as the JSON parser allows."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            for key, item in reversed(value.items()):
                name = f"{path}.{key}" if path else key
                if not _encodable(key):
                    return name.encode("utf-8", "backslashreplace").decode()
                todo.append((name, item))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, str) and not _encodable(value):
            return path
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _validation_error(e: ValidationError) -> OpenAIError:
    """The first field's error, with `param` as OpenAI writes it (`messages[0].content`, not pydantic's
    `messages.0.content.str`) and a code. Of a union's errors, the deepest: the member that matched
    furthest (`prompt[0]` for `"prompt": [5]`)."""
    errors = e.errors()
    first = [err for err in errors if err["loc"][:1] == errors[0]["loc"][:1]]
    err = max(first, key=lambda err: len(_param(err)))
    param = _param(err) or None
    return OpenAIError(400, f"{param}: {err['msg']}" if param else err["msg"], param, _code(err["type"]))


def _param(err: dict) -> str:
    """pydantic's location as OpenAI writes a param, without the union members' tags (`str`,
    `list[ContentPart]`): names of our fields, list indices, and a forbidden extra key."""
    param = ""
    for i, part in enumerate(err["loc"]):
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _FIELDS or (err["type"] == "extra_forbidden" and i == len(err["loc"]) - 1):
            param += f".{part}" if param else part
    return param


def _code(error_type: str) -> str:
    if error_type == "missing":
        return "missing_required_parameter"
    if error_type == "extra_forbidden":
        return "unknown_field"
    if error_type.endswith(("_type", "_parsing")):
        return "invalid_type"
    return "invalid_value"


_FIELDS = {name for m in (ChatCompletionRequest, CompletionRequest, Message, ContentPart, StreamOptions)
           for name in m.model_fields}


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema with its definitions inlined: in an OpenAPI document's request
    body, `#/$defs/...` references would resolve against the document's root."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:  # the models nest without cycles
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return inline(schema)


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of an endpoint taking `model` as JSON (the handlers parse the
    body themselves, so FastAPI would document none): for clients, generators and fuzzers."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body_schema(model)}}}}


def usage(choices: list[pb.Usage]) -> dict[str, Any]:
    """OpenAI's usage (the prompt counted once) plus the speculation figures, summed over
    the choices: draft and accepted tokens, target passes, tokens per pass, drafters."""
    prompt = choices[0].prompt_tokens if choices else 0
    completion = sum(u.completion_tokens for u in choices)
    passes = sum(u.target_forward_passes for u in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "draft_tokens": sum(u.draft_tokens for u in choices),
            "accepted_draft_tokens": sum(u.accepted_draft_tokens for u in choices),
            "target_forward_passes": passes,
            "mean_accepted_tokens": completion / passes if passes else 0.0,
            "drafters": sorted({d for u in choices for d in u.drafter.split("+") if d})}


class Responses:
    """Builds one request's response objects (chat or text completion, whole or chunked)."""

    def __init__(self, chat: bool, request_id: str, model: str, return_token_ids: bool = False):
        self.chat, self.model, self.return_token_ids = chat, model, return_token_ids
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, texts: list[str], token_ids: list[list[int]], reasons: list[str], usages: list[pb.Usage]
              ) -> dict[str, Any]:
        choices = []
        for i, (text, ids, reason) in enumerate(zip(texts, token_ids, reasons)):
            choice: dict[str, Any] = {"index": i, "finish_reason": reason, "logprobs": None}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if self.return_token_ids:
                choice["token_ids"] = ids
            choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage(usages)
        return body

    def chunk(self, index: int, text: str | None, token_ids: list[int], reason: str | None,
              first: bool = False, with_usage_field: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": reason, "logprobs": None}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": text or ""} if first
                               else ({} if text is None else {"content": text}))
        else:
            choice["text"] = text or ""
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if with_usage_field:
            body["usage"] = None  # include_usage: every chunk has the field, the last one fills it
        return body

    def usage_chunk(self, usages: list[pb.Usage]) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(usages)
        return body
