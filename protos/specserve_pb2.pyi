from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "grammar", "logprobs", "processed_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROCESSED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    grammar: str
    logprobs: int
    processed_logprobs: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., grammar: _Optional[str] = ..., logprobs: _Optional[int] = ..., processed_logprobs: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "logprob", "top_ids", "top_logprobs", "text", "token_bytes", "top_texts", "top_bytes")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOP_TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOP_BYTES_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    token_bytes: bytes
    top_texts: _containers.RepeatedScalarFieldContainer[str]
    top_bytes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., token_bytes: _Optional[bytes] = ..., top_texts: _Optional[_Iterable[str]] = ..., top_bytes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SparseDist(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("tokens", "parents", "draw_nodes", "draw_q", "confidence")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAW_NODES_FIELD_NUMBER: _ClassVar[int]
    DRAW_Q_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    draw_nodes: _containers.RepeatedScalarFieldContainer[int]
    draw_q: _containers.RepeatedCompositeFieldContainer[SparseDist]
    confidence: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., draw_nodes: _Optional[_Iterable[int]] = ..., draw_q: _Optional[_Iterable[_Union[SparseDist, _Mapping]]] = ..., confidence: _Optional[_Iterable[float]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    class Choice(_message.Message):
        __slots__ = ("options",)
        OPTIONS_FIELD_NUMBER: _ClassVar[int]
        options: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, options: _Optional[_Iterable[str]] = ...) -> None: ...
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Constraint.Choice
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Constraint.Choice, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "sampling", "stop", "domain_hint", "request_id", "drafter", "pipelined", "namespace", "constraint", "tools", "tool_choice", "parallel_tool_calls", "draft_length", "eagle_placement")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_HINT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EAGLE_PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    domain_hint: str
    request_id: str
    drafter: str
    pipelined: bool
    namespace: str
    constraint: Constraint
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: str
    parallel_tool_calls: bool
    draft_length: int
    eagle_placement: str
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., domain_hint: _Optional[str] = ..., request_id: _Optional[str] = ..., drafter: _Optional[str] = ..., pipelined: _Optional[bool] = ..., namespace: _Optional[str] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., draft_length: _Optional[int] = ..., eagle_placement: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "target_forward_passes", "draft_tokens", "accepted_draft_tokens", "mean_accepted_tokens", "drafter", "reused_drafts", "forced_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    REUSED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    target_forward_passes: int
    draft_tokens: int
    accepted_draft_tokens: int
    mean_accepted_tokens: float
    drafter: str
    reused_drafts: int
    forced_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., target_forward_passes: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., mean_accepted_tokens: _Optional[float] = ..., drafter: _Optional[str] = ..., reused_drafts: _Optional[int] = ..., forced_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "logprobs", "tool_calls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "logprobs", "tool_calls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class DrafterPrefillRequest(_message.Message):
    __slots__ = ("request_id", "drafter", "token_ids", "sampling", "stream", "resumed", "namespace", "domain")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    drafter: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    stream: int
    resumed: int
    namespace: str
    domain: str
    def __init__(self, request_id: _Optional[str] = ..., drafter: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stream: _Optional[int] = ..., resumed: _Optional[int] = ..., namespace: _Optional[str] = ..., domain: _Optional[str] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("request_id", "context_length", "new_tokens", "max_tokens", "speculative_tokens", "min_confidence", "max_nodes", "observed_tokens", "observed_ids", "observed_probs", "features", "features_start", "features_count")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_IDS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_PROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_START_FIELD_NUMBER: _ClassVar[int]
    FEATURES_COUNT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context_length: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    speculative_tokens: _containers.RepeatedScalarFieldContainer[int]
    min_confidence: float
    max_nodes: int
    observed_tokens: _containers.RepeatedScalarFieldContainer[int]
    observed_ids: _containers.RepeatedScalarFieldContainer[int]
    observed_probs: _containers.RepeatedScalarFieldContainer[float]
    features: bytes
    features_start: int
    features_count: int
    def __init__(self, request_id: _Optional[str] = ..., context_length: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., speculative_tokens: _Optional[_Iterable[int]] = ..., min_confidence: _Optional[float] = ..., max_nodes: _Optional[int] = ..., observed_tokens: _Optional[_Iterable[int]] = ..., observed_ids: _Optional[_Iterable[int]] = ..., observed_probs: _Optional[_Iterable[float]] = ..., features: _Optional[bytes] = ..., features_start: _Optional[int] = ..., features_count: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("tree", "state_lost", "seconds")
    TREE_FIELD_NUMBER: _ClassVar[int]
    STATE_LOST_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    tree: DraftTree
    state_lost: bool
    seconds: float
    def __init__(self, tree: _Optional[_Union[DraftTree, _Mapping]] = ..., state_lost: _Optional[bool] = ..., seconds: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "learn_token_ids", "namespace")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEARN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    learn_token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: str
    def __init__(self, request_id: _Optional[str] = ..., learn_token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierPrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "max_len", "candidates", "resumed", "prompt_length", "namespace", "feature_layers", "verifier_drafter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    max_len: int
    candidates: int
    resumed: int
    prompt_length: int
    namespace: str
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    verifier_drafter: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_len: _Optional[int] = ..., candidates: _Optional[int] = ..., resumed: _Optional[int] = ..., prompt_length: _Optional[int] = ..., namespace: _Optional[str] = ..., feature_layers: _Optional[_Iterable[int]] = ..., verifier_drafter: _Optional[str] = ...) -> None: ...

class VerifierPrefillResponse(_message.Message):
    __slots__ = ("next_token", "active_requests", "candidate_ids", "candidate_probs", "logprobs", "features", "features_start", "features_count")
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_IDS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_PROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_START_FIELD_NUMBER: _ClassVar[int]
    FEATURES_COUNT_FIELD_NUMBER: _ClassVar[int]
    next_token: int
    active_requests: int
    candidate_ids: _containers.RepeatedScalarFieldContainer[int]
    candidate_probs: _containers.RepeatedScalarFieldContainer[float]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    features: bytes
    features_start: int
    features_count: int
    def __init__(self, next_token: _Optional[int] = ..., active_requests: _Optional[int] = ..., candidate_ids: _Optional[_Iterable[int]] = ..., candidate_probs: _Optional[_Iterable[float]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., features: _Optional[bytes] = ..., features_start: _Optional[int] = ..., features_count: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("request_id", "tree", "context_length", "candidates", "feature_layers")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tree: DraftTree
    context_length: int
    candidates: int
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., tree: _Optional[_Union[DraftTree, _Mapping]] = ..., context_length: _Optional[int] = ..., candidates: _Optional[int] = ..., feature_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted", "bonus", "state_lost", "batch_size", "queued", "active_requests", "candidate_ids", "candidate_probs", "pass_id", "pass_seconds", "pass_tokens", "pass_width", "drafted", "drafted_depth", "forced", "logprobs", "features", "features_start", "features_count", "member_drafted", "member_accepted", "draft_seconds")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    STATE_LOST_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_IDS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_PROBS_FIELD_NUMBER: _ClassVar[int]
    PASS_ID_FIELD_NUMBER: _ClassVar[int]
    PASS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PASS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PASS_WIDTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_DEPTH_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_START_FIELD_NUMBER: _ClassVar[int]
    FEATURES_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMBER_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    bonus: int
    state_lost: bool
    batch_size: int
    queued: int
    active_requests: int
    candidate_ids: _containers.RepeatedScalarFieldContainer[int]
    candidate_probs: _containers.RepeatedScalarFieldContainer[float]
    pass_id: int
    pass_seconds: float
    pass_tokens: int
    pass_width: int
    drafted: int
    drafted_depth: int
    forced: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    features: bytes
    features_start: int
    features_count: int
    member_drafted: _containers.RepeatedScalarFieldContainer[int]
    member_accepted: _containers.RepeatedScalarFieldContainer[int]
    draft_seconds: float
    def __init__(self, accepted: _Optional[_Iterable[int]] = ..., bonus: _Optional[int] = ..., state_lost: _Optional[bool] = ..., batch_size: _Optional[int] = ..., queued: _Optional[int] = ..., active_requests: _Optional[int] = ..., candidate_ids: _Optional[_Iterable[int]] = ..., candidate_probs: _Optional[_Iterable[float]] = ..., pass_id: _Optional[int] = ..., pass_seconds: _Optional[float] = ..., pass_tokens: _Optional[int] = ..., pass_width: _Optional[int] = ..., drafted: _Optional[int] = ..., drafted_depth: _Optional[int] = ..., forced: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., features: _Optional[bytes] = ..., features_start: _Optional[int] = ..., features_count: _Optional[int] = ..., member_drafted: _Optional[_Iterable[int]] = ..., member_accepted: _Optional[_Iterable[int]] = ..., draft_seconds: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "drafter", "draft_length", "max_tokens", "eos_token_ids", "max_rounds", "candidates", "max_nodes", "namespace", "feature_layers", "drafted_rounds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    drafter: str
    draft_length: int
    max_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_rounds: int
    candidates: int
    max_nodes: int
    namespace: str
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    drafted_rounds: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., drafter: _Optional[str] = ..., draft_length: _Optional[int] = ..., max_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_rounds: _Optional[int] = ..., candidates: _Optional[int] = ..., max_nodes: _Optional[int] = ..., namespace: _Optional[str] = ..., feature_layers: _Optional[_Iterable[int]] = ..., drafted_rounds: _Optional[int] = ...) -> None: ...

class VerifierStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierStatsResponse(_message.Message):
    __slots__ = ("forward_passes", "verified_requests", "max_batch_size", "batch_size_histogram", "active_requests", "busy_seconds", "uptime_seconds")
    class BatchSizeHistogramEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    forward_passes: int
    verified_requests: int
    max_batch_size: int
    batch_size_histogram: _containers.ScalarMap[int, int]
    active_requests: int
    busy_seconds: float
    uptime_seconds: float
    def __init__(self, forward_passes: _Optional[int] = ..., verified_requests: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., batch_size_histogram: _Optional[_Mapping[int, int]] = ..., active_requests: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., uptime_seconds: _Optional[float] = ...) -> None: ...
