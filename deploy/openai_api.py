"""The OpenAI-compatible HTTP protocol: request models, their translation into the
router's `GenerateRequest`, and the response, chunk and error objects.

No Ray and no server here (deploy/app.py serves it): the router validates what it
validates for gRPC too (prompt, sampling and penalty ranges, stop strings and tokens,
logit_bias's tokens, the constraint's grammar, the tools and tool_choice, drafter,
domain, eagle_placement), so both APIs share one path and one set of rules; this module
checks only what is HTTP's own (the body's shape and types, the model name, one structured output
at most, a tool message's call id, fields we do not support) and names the router's
fields as the request spelt them (`constraint.regex` is `guided_regex` or
`structured_outputs.regex`, ...).
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from protos import specserve_pb2 as pb

# OpenAI request fields we know and do not implement: a request that sets one (to anything
# but its neutral value) gets a 400 naming it rather than an answer that ignores it
NEUTRAL = {"functions": (None, []), "function_call": (None, "none"), "best_of": (None, 1), "echo": (None, False),
           "suffix": (None, ""), "service_tier": (None, "auto", "default"), "store": (None, False),
           "metadata": (None, {}), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
           "reasoning_effort": (None,), "web_search_options": (None,)}
MAX_CHOICES = 8  # `n`: each choice is a request of its own
INT32 = {"ge": -2**31, "le": 2**31 - 1}  # what the router's int32 fields carry
MAX_LOGPROBS = 20  # top_logprobs (OpenAI's limit, speculative.sampling's)


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
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str  # a JSON object, as JSON text (OpenAI's shape)


class MessageToolCall(_Strict):
    """A call an assistant message made, sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Strict):
    role: str
    content: str | list[ContentPart] | None = ""
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: the call it answers
    refusal: str | None = None  # the openai client sends an answer's message back with it

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # unset: any JSON value
    strict: bool | None = None  # the output always follows the schema exactly (a grammar)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class FunctionSpec(_Strict):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; unset: none
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


def _int32_key(key: str) -> int | None:
    """A logit_bias key as OpenAI writes it (a token id in a string), or None."""
    if not key.isascii() or not key.lstrip("-").isdigit() or len(key) > 11:
        return None
    value = int(key)
    return value if INT32["ge"] <= value <= INT32["le"] else None


class _Request(BaseModel):
    """Fields both endpoints take. specserve's own (`top_k`, `drafter`, `domain`, `namespace`,
    `return_token_ids`, `draft_length`, `eagle_placement`) and vLLM's extras
    (`repetition_penalty`, `min_tokens`, `stop_token_ids`, `guided_*`, `structured_outputs`)
    come in the body beside OpenAI's."""

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
    # what changes the target's distribution (the router checks the ranges)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: int = Field(0, **INT32)
    stop_token_ids: list[Annotated[int, Field(**INT32)]] | None = None
    # structured output: one of these
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    processed_logprobs: bool = False  # logprobs of the processed distribution (penalties, bias, grammar)
    draft_length: int | None = Field(None, **INT32)  # most draft tokens a round (0: no speculation)
    eagle_placement: str = ""  # where an eagle drafter runs: "verifier" or "pool" ("": the router's; it checks)

    def check_supported(self) -> None:
        """A field we do not implement, set to anything but its neutral value, is refused."""
        for key, value in (self.model_extra or {}).items():
            if key not in NEUTRAL:
                raise OpenAIError(400, f"unknown field {key!r}", key, "unknown_field")
            if value not in NEUTRAL[key]:
                raise OpenAIError(400, f"{key!r} is not supported by this server", key, "unsupported_field")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options: needs stream: true", "stream_options", "invalid_value")
        for key in self.logit_bias or {}:
            if _int32_key(key) is None:
                raise OpenAIError(400, f"logit_bias: the key {key!r} is not a token id", "logit_bias",
                                  "invalid_value")
        self.constraint()  # one at most

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def constraint(self) -> tuple[pb.Constraint | None, str | None]:
        """The structured output the request asks for, and the field that asked (its errors
        name it); (None, None) for free text. Two given are a 400 naming the second."""
        found: list[tuple[str, pb.Constraint]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", pb.Constraint(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise OpenAIError(400, "response_format.json_schema: needed with type json_schema",
                                  "response_format.json_schema", "missing_required_parameter")
            schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
            found.append(("response_format.json_schema.schema", pb.Constraint(json_schema=json.dumps(schema))))
        if self.guided_json is not None:
            found.append(("guided_json", pb.Constraint(json_schema=_schema_text(self.guided_json, "guided_json"))))
        if self.guided_regex is not None:
            found.append(("guided_regex", pb.Constraint(regex=self.guided_regex)))
        if self.guided_choice is not None:
            found.append(("guided_choice", pb.Constraint(choice=pb.Constraint.Choice(options=self.guided_choice))))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", pb.Constraint(grammar=self.guided_grammar)))
        so = self.structured_outputs
        if so is not None:
            given = [(f"structured_outputs.{name}", c) for name, value, c in [
                ("json", so.json_, lambda v: pb.Constraint(json_schema=_schema_text(v, "structured_outputs.json"))),
                ("json_object", so.json_object or None, lambda v: pb.Constraint(json_object=True)),
                ("regex", so.regex, lambda v: pb.Constraint(regex=v)),
                ("choice", so.choice, lambda v: pb.Constraint(choice=pb.Constraint.Choice(options=v))),
                ("grammar", so.grammar, lambda v: pb.Constraint(grammar=v))] if value is not None
                     for c in [c(value)]]
            if not given:
                raise OpenAIError(400, "structured_outputs: give one of json, json_object, regex, choice, grammar",
                                  "structured_outputs", "invalid_value")
            found.extend(given)
        if len(found) > 1:
            raise OpenAIError(400, f"{found[1][0]}: one structured output at a time ({found[0][0]} is given too)",
                              found[1][0], "invalid_value")
        return (found[0][1], found[0][0]) if found else (None, None)

    def rename(self, e: OpenAIError) -> None:
        """The router's error, its field (and the message that starts with it) as this request spelt it."""
        param = self.http_param(e.param)
        if e.param and param != e.param and e.message.startswith(f"{e.param}: "):
            e.message = f"{param}: {e.message[len(e.param) + 2:]}"
        e.param = param

    def http_param(self, field: str | None) -> str | None:
        """A router field the way this request spelt it (the router names its gRPC fields)."""
        if field is None:
            return None
        if field == "domain_hint":
            return "domain"
        if field == "constraint" or field.startswith("constraint."):
            return self.constraint()[1] or field
        return field

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
            self.fill_processing(sampling)
            req = pb.GenerateRequest(sampling=sampling, stop=self.stops(), domain_hint=self.domain,
                                     request_id=f"{request_id}-{i}", drafter=self.drafter, namespace=self.namespace,
                                     eagle_placement=self.eagle_placement)
            constraint, _ = self.constraint()
            if constraint is not None:
                req.constraint.CopyFrom(constraint)
            if self.draft_length is not None:
                req.draft_length = self.draft_length
            self.fill_input(req)
            requests.append(req)
        return requests

    def fill_processing(self, sampling: pb.SamplingParams) -> None:
        """Penalties, bias, min_tokens, stop tokens and logprobs."""
        sampling.presence_penalty = self.presence_penalty or 0.0
        sampling.frequency_penalty = self.frequency_penalty or 0.0
        if self.repetition_penalty is not None:
            sampling.repetition_penalty = self.repetition_penalty
        for key, bias in (self.logit_bias or {}).items():
            sampling.logit_bias[_int32_key(key)] = bias
        sampling.min_tokens = self.min_tokens
        sampling.stop_token_ids.extend(self.stop_token_ids or ())
        if self.top_logprob_count() is not None:
            sampling.logprobs = self.top_logprob_count()
            sampling.processed_logprobs = self.processed_logprobs

    def top_logprob_count(self) -> int | None:
        """How many alternatives each token's logprobs list; None: no logprobs."""
        raise NotImplementedError

    def max_output_tokens(self) -> int | None:
        return self.max_tokens

    def fill_input(self, req: pb.GenerateRequest) -> None:
        raise NotImplementedError


def _schema_text(schema: dict | str, field: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    if isinstance(schema, dict):
        return json.dumps(schema)
    try:
        if isinstance(json.loads(schema), (dict, bool)):
            return schema
    except ValueError:
        pass
    raise OpenAIError(400, f"{field}: not a JSON schema (an object, or its JSON text)", field, "invalid_value")


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, **INT32)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "top_logprobs: needs logprobs: true", "top_logprobs", "invalid_value")
        for i, m in enumerate(self.messages):
            if m.role == "tool" and not m.tool_call_id:
                raise OpenAIError(400, f"messages[{i}].tool_call_id: a tool message answers a call: name it",
                                  f"messages[{i}].tool_call_id", "missing_required_parameter")
            if m.tool_calls and m.role != "assistant":
                raise OpenAIError(400, f"messages[{i}].tool_calls: only an assistant's message makes calls",
                                  f"messages[{i}].tool_calls", "invalid_value")
            for j, call in enumerate(m.tool_calls or ()):
                if not _is_json_object(call.function.arguments):
                    param = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise OpenAIError(400, f"{param}: must be a JSON object, as JSON text", param, "invalid_value")

    def top_logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def http_param(self, field: str | None) -> str | None:
        if field == "prompt":  # a chat request's prompt is its messages
            return "messages"
        if field is not None and re.fullmatch(r"messages\[\d+\]\.tool_calls\[\d+\]\.arguments", field):
            return field.replace(".arguments", ".function.arguments")
        return super().http_param(field)

    def fill_input(self, req: pb.GenerateRequest) -> None:
        for m in self.messages:
            msg = req.messages.add(role=m.role, content=m.text(), name=m.name or "",
                                   tool_call_id=m.tool_call_id or "")
            for call in m.tool_calls or ():
                msg.tool_calls.add(id=call.id, name=call.function.name, arguments=call.function.arguments)
        for tool in self.tools or ():
            f = tool.function
            req.tools.add(name=f.name, description=f.description,
                          parameters=json.dumps(f.parameters) if f.parameters is not None else "")
        choice = self.tool_choice
        req.tool_choice = choice.function.name if isinstance(choice, NamedToolChoice) else (choice or "")
        if self.parallel_tool_calls is not None:
            req.parallel_tool_calls = self.parallel_tool_calls


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


class CompletionRequest(_Request):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # OpenAI's legacy: the alternatives a token

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError("give one prompt (a string, or a list of one string)")
        return prompt

    def top_logprob_count(self) -> int | None:
        return self.logprobs

    def http_param(self, field: str | None) -> str | None:
        if field == "top_logprobs":  # the router's name of the count
            return "logprobs"
        return super().http_param(field)

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


_MODELS = (ChatCompletionRequest, CompletionRequest, Message, ContentPart, StreamOptions, CalledFunction,
           MessageToolCall, JsonSchemaFormat, ResponseFormat, StructuredOutputs, FunctionSpec, ToolSpec, FunctionName,
           NamedToolChoice)
_FIELDS = {info.alias or name for m in _MODELS for name, info in m.model_fields.items()}


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
    the choices: draft and accepted tokens, target passes, tokens per pass, the tokens a
    grammar forced (drafted for free), drafters."""
    prompt = choices[0].prompt_tokens if choices else 0
    completion = sum(u.completion_tokens for u in choices)
    passes = sum(u.target_forward_passes for u in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "draft_tokens": sum(u.draft_tokens for u in choices),
            "accepted_draft_tokens": sum(u.accepted_draft_tokens for u in choices),
            "target_forward_passes": passes,
            "mean_accepted_tokens": completion / passes if passes else 0.0,
            "forced_tokens": sum(u.forced_tokens for u in choices),
            "drafters": sorted({d for u in choices for d in u.drafter.split("+") if d})}


# a logprob JSON cannot carry: a token the grammar or the bias rules out (OpenAI writes -9999.0)
FLOOR_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else FLOOR_LOGPROB


def tool_calls(calls: list[pb.ToolCall], streamed: bool = False) -> list[dict[str, Any]]:
    """OpenAI's tool calls; streamed (`delta.tool_calls`), each with its index."""
    return [{**({"index": i} if streamed else {}), "id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]


class Responses:
    """Builds one request's response objects (chat or text completion, whole or chunked)."""

    def __init__(self, chat: bool, request_id: str, model: str, return_token_ids: bool = False,
                 logprobs: bool = False):
        """`logprobs`: the request asked for them (each choice then has its `logprobs`)."""
        self.chat, self.model, self.return_token_ids, self.logprobs = chat, model, return_token_ids, logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # a streamed text completion's choice: its text so far (text_offset)

    def _envelope(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, texts: list[str], token_ids: list[list[int]], reasons: list[str], usages: list[pb.Usage],
              calls: list[list[pb.ToolCall]] | None = None,
              logprobs: list[list[pb.TokenLogprob]] | None = None) -> dict[str, Any]:
        choices = []
        for i, (text, ids, reason) in enumerate(zip(texts, token_ids, reasons)):
            made = calls[i] if calls else []
            choice: dict[str, Any] = {"index": i, "finish_reason": reason,
                                      "logprobs": self._logprobs(logprobs[i] if logprobs else [], i)
                                      if self.logprobs else None}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text if text or not made else None}
                if made:
                    choice["message"]["tool_calls"] = tool_calls(made)
            else:
                choice["text"] = text
            if self.return_token_ids:
                choice["token_ids"] = ids
            choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage(usages)
        return body

    def chunk(self, index: int, text: str | None, token_ids: list[int], reason: str | None,
              first: bool = False, with_usage_field: bool = False, calls: list[pb.ToolCall] | None = None,
              logprobs: list[pb.TokenLogprob] | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": reason,
                                  "logprobs": self._logprobs(logprobs, index) if self.logprobs and logprobs else None}
        if self.chat:
            delta: dict[str, Any] = ({"role": "assistant", "content": text or ""} if first
                                     else ({} if not text and (calls or text is None) else {"content": text}))
            if calls:
                delta["tool_calls"] = tool_calls(calls, streamed=True)
            choice["delta"] = delta
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

    def _logprobs(self, logprobs: list[pb.TokenLogprob], index: int) -> dict[str, Any]:
        """Chat: `{"content": [{token, logprob, bytes, top_logprobs}], "refusal"}`; a text completion:
        OpenAI's legacy `{tokens, token_logprobs, top_logprobs, text_offset}`, the offsets counted
        from the choice's text so far when streamed."""
        if self.chat:
            return {"content": [{"token": lp.text, "logprob": _logprob(lp.logprob), "bytes": list(lp.token_bytes),
                                 "top_logprobs": [{"token": text, "logprob": _logprob(value), "bytes": list(raw)}
                                                  for text, value, raw in zip(lp.top_texts, lp.top_logprobs,
                                                                              lp.top_bytes)]}
                                for lp in logprobs], "refusal": None}
        offset, offsets = self._offsets.get(index, 0), []
        for lp in logprobs:
            offsets.append(offset)
            offset += len(lp.text)
        self._offsets[index] = offset
        return {"tokens": [lp.text for lp in logprobs], "token_logprobs": [_logprob(lp.logprob) for lp in logprobs],
                "top_logprobs": [{text: _logprob(value) for text, value in zip(lp.top_texts, lp.top_logprobs)}
                                 for lp in logprobs], "text_offset": offsets}
