"""What applications send over the OpenAI-compatible HTTP API: structured outputs
(`response_format`, vLLM's `guided_*` and `structured_outputs`), tool calls, logprobs,
penalties and bias, and the per-request speculation cap.

The served tests run `specserve serve` (the Ray Serve ingress, as users start it) once for
the module and talk to it with the official `openai` client where it has the call
(`chat.completions.parse` with a pydantic model, tools, a tool loop, logprobs), raw HTTP
where it has not (vLLM's extras, bad values). Every structured output validates against
its schema or matches its regex or choice; tool calls come back as `message.tool_calls`,
streamed as `delta.tool_calls` that reassemble to the same; logprobs have OpenAI's shapes
and equal the log-softmax of Hugging Face's logits on the same weights. The unserved tests
check the mapping of each field into the router's request and the answers' shapes."""

from __future__ import annotations

import json
import math
import re
import urllib.request

import jsonschema
import openai
import pydantic
import pytest
import torch

from http_front import post_json
from oracle import PROMPTS, oracle
from serve_process import specserve_serve

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": MODEL, "prompt": "hi"}

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PERSON_PROMPT = [{"role": "user", "content": "Give me a person named Ann who is 31 years old as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
WEATHER_PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
LOGPROB_TOLERANCE = 1e-4  # float32 log-softmax of the same weights, our kernels against HF's


class Person(pydantic.BaseModel):
    name: str
    age: int


# -- the served API ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    config = tmp_path_factory.mktemp("structured") / "serve.toml"
    with specserve_serve(config, '[drafter_pools]\nkinds = ["pld", "suffix"]\n[verifiers]\nmax_len = 1024\n'
                                 'threads = 1\n') as served:
        yield served.http


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=240, max_retries=0)


def _post(base: str, path: str, body: dict) -> tuple[int, dict]:
    return post_json(f"{base}{path}", body)


def _chat(base: str, **fields) -> dict:
    status, reply = _post(base, "/v1/chat/completions", {"model": MODEL, "temperature": 0, **fields})
    assert status == 200, reply
    return reply


def test_openai_parse_with_a_pydantic_model_returns_the_object(client):
    """The official client's structured-output call: it sends a strict json_schema and parses
    the answer into the model."""
    done = client.chat.completions.parse(model=MODEL, messages=PERSON_PROMPT, response_format=Person,
                                         max_tokens=48, temperature=0)
    person = done.choices[0].message.parsed
    assert isinstance(person, Person), done
    jsonschema.validate(json.loads(done.choices[0].message.content), Person.model_json_schema())
    assert done.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
    {"guided_json": PERSON},
    {"structured_outputs": {"json": PERSON}, "drafter": "pld+suffix"},
], ids=["response_format", "guided_json", "structured_outputs-fused"])
def test_json_schema_output_validates_and_streams_the_same(base, fields):
    whole = _chat(base, messages=PERSON_PROMPT, max_tokens=48, **fields)
    text = whole["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), PERSON)
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert _streamed_text(base, messages=PERSON_PROMPT, max_tokens=48, **fields) == text


def test_json_object_is_a_json_object(base):
    whole = _chat(base, messages=PERSON_PROMPT, max_tokens=64, response_format={"type": "json_object"})
    choice = whole["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # cut short by max_tokens: still the start of one
        assert choice["message"]["content"].lstrip().startswith("{")


@pytest.mark.parametrize("fields,pattern", [
    ({"guided_regex": r"[0-9]{1,4}"}, r"[0-9]{1,4}"),
    ({"structured_outputs": {"regex": r"(yes|no), [a-z ]{3,20}\."}}, r"(yes|no), [a-z ]{3,20}\."),
    ({"guided_choice": ["Paris", "London", "Rome"]}, r"Paris|London|Rome"),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}, "drafter": "pld+suffix"}, r"red|green|blue"),
    ({"guided_grammar": 'start: "The answer is " NUM\nNUM: /[0-9]+/'}, r"The answer is [0-9]+"),
])
def test_regex_choice_and_grammar_outputs_match(base, fields, pattern):
    reply = _chat(base, messages=[{"role": "user", "content": "What is 12 + 30? And is Paris in France?"}],
                  max_tokens=24, **fields)
    text = reply["choices"][0]["message"]["content"]
    assert re.fullmatch(pattern, text), text
    assert reply["choices"][0]["finish_reason"] == "stop"


def test_completions_take_a_constraint_too(base):
    status, reply = _post(base, "/v1/completions", {"model": MODEL, "prompt": "The capital of Italy is",
                                                    "max_tokens": 8, "temperature": 0,
                                                    "guided_choice": [" Rome", " Milan"]})
    assert status == 200 and reply["choices"][0]["text"] in (" Rome", " Milan"), reply


def _arguments_validate(call, tools) -> None:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_required_call_comes_as_tool_calls_and_streams_the_same(client, tool_choice):
    kwargs = dict(model=MODEL, messages=WEATHER_PROMPT, tools=[WEATHER, TIME], tool_choice=tool_choice,
                  parallel_tool_calls=False, max_tokens=64, temperature=0)
    done = client.chat.completions.create(**kwargs)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", done
    assert len(choice.message.tool_calls) == 1 and not choice.message.content
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    _arguments_validate(call, [WEATHER, TIME])
    # streamed: delta.tool_calls (with their index) put together give the same call
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or ():
                got = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                got["id"] += d.id or ""
                got["name"] += (d.function.name or "") if d.function else ""
                got["arguments"] += (d.function.arguments or "") if d.function else ""
    assert [r for r in reasons if r] == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")


def test_the_stream_accumulates_in_the_clients_own_helper(client):
    """The openai client's stream helper puts delta.tool_calls together by their index."""
    with client.chat.completions.stream(model=MODEL, messages=WEATHER_PROMPT, tools=[WEATHER], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=64, temperature=0) as stream:
        done = stream.get_final_completion()
    call = done.choices[0].message.tool_calls[0]
    assert done.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    _arguments_validate(call, [WEATHER])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_loop_completes_through_the_client(client, stream):
    """A call, the tool's answer sent back (role tool, its call's id), the final answer."""
    messages: list = list(WEATHER_PROMPT)
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=64, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message)  # the client sends the assistant's message back as it came
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18,
                                                                                      "sky": "cloudy"})})
    kwargs = dict(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=48, temperature=0)
    if stream:
        parts = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        reason = [c.choices[0].finish_reason for c in parts if c.choices and c.choices[0].finish_reason][-1]
    else:
        final = client.chat.completions.create(**kwargs)
        text, reason = final.choices[0].message.content, final.choices[0].finish_reason
        assert not final.choices[0].message.tool_calls
    assert text.strip() and reason in ("stop", "length")
    assert "18" in text or "cloud" in text.lower(), text  # it read the tool's answer


def test_auto_lets_the_model_answer_in_text(client):
    done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                          tools=[WEATHER], max_tokens=16, temperature=0)
    assert done.choices[0].message.content and done.choices[0].finish_reason in ("stop", "length")


def test_chat_logprobs_have_openais_shape_and_stream_the_same(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12,
                  temperature=0, logprobs=True, top_logprobs=3)
    done = client.chat.completions.create(**kwargs)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    text = done.choices[0].message.content
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace").startswith(text)
    streamed = [e for c in client.chat.completions.create(stream=True, **kwargs) for ch in c.choices
                if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # no logprobs asked: none given
    assert client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None}
                                          ).choices[0].logprobs is None


def test_completion_logprobs_have_the_legacy_shape(client):
    kwargs = dict(model=MODEL, prompt="The three primary colors are", max_tokens=10, temperature=0, logprobs=2)
    done = client.completions.create(**kwargs)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs,
                                                                                         lp.token_logprobs))
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs)
                if c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


@pytest.mark.parametrize("i", [0, 1])
def test_chat_logprobs_equal_hf_log_softmax(client, hf_oracle, i):
    """The target's own log-probabilities, from the verification pass: HF's log-softmax at
    each emitted token, the chosen one and the top five."""
    done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i][1]}],
                                          max_tokens=32, temperature=0, logprobs=True, top_logprobs=5,
                                          extra_body={"return_token_ids": True})
    want_ids, logits = oracle(hf_oracle, i)
    got_ids = done.choices[0].token_ids
    same = next((j for j, (a, b) in enumerate(zip(got_ids, want_ids)) if a != b), min(len(got_ids), len(want_ids)))
    assert same >= 8, (got_ids, want_ids)  # a near-tie may part them later (test_http_api checks the tokens)
    hf = torch.log_softmax(logits[:same].float(), dim=-1)
    for j, entry in enumerate(done.choices[0].logprobs.content[:same]):
        assert abs(entry.logprob - float(hf[j, got_ids[j]])) < LOGPROB_TOLERANCE, (j, entry.logprob)
        top = torch.topk(hf[j], 5)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=LOGPROB_TOLERANCE)


def test_penalties_and_bias_change_the_output_and_are_taken(base):
    prompt = [{"role": "user", "content": "Write the word cat five times."}]
    plain = _chat(base, messages=prompt, max_tokens=16, return_token_ids=True)["choices"][0]["token_ids"]
    for fields in [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 2.0},
                   {"logit_bias": {str(plain[0]): -100}}]:
        got = _chat(base, messages=prompt, max_tokens=16, return_token_ids=True, **fields)["choices"][0]["token_ids"]
        assert got != plain, fields
    biased = _chat(base, messages=prompt, max_tokens=4, return_token_ids=True, logit_bias={"28": 100})
    assert biased["choices"][0]["token_ids"] == [28] * 4
    # min_tokens holds the end back; stop_token_ids end the output at one of them
    ended = _chat(base, messages=[{"role": "user", "content": "Say hi."}], max_tokens=40, return_token_ids=True)
    ids = ended["choices"][0]["token_ids"]
    assert ended["choices"][0]["finish_reason"] == "stop" and len(ids) < 40, ended
    longer = _chat(base, messages=[{"role": "user", "content": "Say hi."}], max_tokens=40, min_tokens=len(ids) + 4,
                   return_token_ids=True)["choices"][0]["token_ids"]
    assert len(longer) >= len(ids) + 4
    cut = _chat(base, messages=[{"role": "user", "content": "Say hi."}], max_tokens=40, stop_token_ids=[ids[2]],
                return_token_ids=True)["choices"][0]
    assert cut["token_ids"] == ids[:3] and cut["finish_reason"] == "stop"


def test_draft_length_zero_turns_speculation_off_and_changes_nothing_else(base):
    prompt = [{"role": "user", "content": PROMPTS[2][1]}]
    drafted = _chat(base, messages=prompt, max_tokens=24, return_token_ids=True, drafter="pld")
    plain = _chat(base, messages=prompt, max_tokens=24, return_token_ids=True, draft_length=0)
    assert plain["usage"]["draft_tokens"] == 0 and plain["usage"]["drafters"] == ["none"]
    assert plain["usage"]["target_forward_passes"] == 24
    assert plain["choices"][0]["token_ids"] == drafted["choices"][0]["token_ids"]


def _streamed_text(base: str, **fields) -> str:
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(
        {"model": MODEL, "temperature": 0, "stream": True, **fields}).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    text = []
    with urllib.request.urlopen(req, timeout=240) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += [c["delta"].get("content") or "" for c in event["choices"]]
    return "".join(text)


BAD = [  # (change to a good chat request, the param the 400 must name)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a{99999999}"}}, "structured_outputs.regex"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"json_schema": {}}}, "structured_outputs.json_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "no_such"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "tool", "content": "18 degrees"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 2}, "logprobs"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"logit_bias": {"12": 101}}, "logit_bias"),
    ({"logit_bias": {"twelve": 1}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 5}, "min_tokens"),
    ({"stop_token_ids": [49152]}, "stop_token_ids"),
    ({"draft_length": -1}, "draft_length"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize("change,param", BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_bad_values_get_a_400_naming_the_field(base, change, param):
    status, reply = _post(base, "/v1/chat/completions", {**CHAT, "max_tokens": 4, **change})
    assert status == 400, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"} and reply["error"]["param"] == param, reply
    assert param in reply["error"]["message"], reply


def test_completions_logprobs_over_twenty_names_logprobs(base):
    status, reply = _post(base, "/v1/completions", {**TEXT, "max_tokens": 4, "logprobs": 21})
    assert (status, reply["error"]["param"]) == (400, "logprobs"), reply
    status, reply = _post(base, "/v1/completions", {**TEXT, "max_tokens": 4, "tools": [WEATHER]})
    assert (status, reply["error"]["param"]) == (400, "tools"), reply


# -- the mapping and the shapes, without a server ------------------------------------------------
def _requests(body: dict, chat: bool = True):
    from deploy import openai_api as oa

    kind = oa.ChatCompletionRequest if chat else oa.CompletionRequest
    return oa.parse(kind, body).generate_requests("r")


@pytest.mark.parametrize("fields,kind,value", [
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}},
     "json_schema", PERSON),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "json_schema", {}),
    ({"guided_json": PERSON}, "json_schema", PERSON),
    ({"guided_json": json.dumps(PERSON)}, "json_schema", PERSON),
    ({"guided_regex": "a+"}, "regex", "a+"),
    ({"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
    ({"guided_grammar": 'start: "x"'}, "grammar", 'start: "x"'),
    ({"structured_outputs": {"json": PERSON}}, "json_schema", PERSON),
    ({"structured_outputs": {"json_object": True}}, "json_object", True),
    ({"structured_outputs": {"regex": "a+"}}, "regex", "a+"),
    ({"structured_outputs": {"choice": ["a"]}}, "choice", ["a"]),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, "grammar", 'start: "x"'),
])
def test_each_structured_output_field_maps_to_the_routers_constraint(fields, kind, value):
    for chat, body in [(True, CHAT), (False, TEXT)]:
        c = _requests({**body, **fields}, chat)[0].constraint
        assert c.WhichOneof("kind") == kind
        got = getattr(c, kind)
        got = json.loads(got) if kind == "json_schema" else list(got.options) if kind == "choice" else got
        assert got == value


def test_text_response_format_is_free_text():
    assert _requests({**CHAT, "response_format": {"type": "text"}})[0].constraint.WhichOneof("kind") is None


def test_penalties_logprobs_and_speculation_map_to_the_routers_request():
    req = _requests({**CHAT, "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.2,
                     "logit_bias": {"12": -100, "7": 2.5}, "min_tokens": 3, "stop_token_ids": [5, 6],
                     "logprobs": True, "top_logprobs": 4, "processed_logprobs": True, "draft_length": 0, "n": 2})
    for r in req:
        s = r.sampling
        assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == pytest.approx((0.5, -0.25, 1.2))
        assert dict(s.logit_bias) == {12: -100.0, 7: 2.5} and s.min_tokens == 3 and list(s.stop_token_ids) == [5, 6]
        assert (s.logprobs, s.processed_logprobs, r.draft_length) == (4, True, 0)
    plain = _requests(CHAT)[0]
    assert not plain.sampling.HasField("logprobs") and not plain.sampling.HasField("repetition_penalty")
    assert not plain.HasField("draft_length")
    assert _requests({**CHAT, "logprobs": True})[0].sampling.logprobs == 0
    assert _requests({**TEXT, "logprobs": 3}, chat=False)[0].sampling.logprobs == 3
    assert _requests({**TEXT, "logprobs": 0}, chat=False)[0].sampling.HasField("logprobs")


def test_tools_and_tool_turns_map_to_the_routers_messages():
    r = _requests({**CHAT, "tools": [WEATHER, {"type": "function", "function": {"name": "ping"}}],
                   "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                   "parallel_tool_calls": False, "messages": [
                       {"role": "user", "content": "weather?"},
                       {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                           {"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                       {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 C"}]}]})[0]
    assert [(t.name, json.loads(t.parameters) if t.parameters else None) for t in r.tools] == [
        ("get_weather", WEATHER["function"]["parameters"]), ("ping", None)]
    assert (r.tool_choice, r.parallel_tool_calls) == ("get_weather", False)
    assistant, tool = r.messages[1], r.messages[2]
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [("call_1", "get_weather",
                                                                            '{"city": "Paris"}')]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "18 C")
    for choice in ("none", "auto", "required"):
        assert _requests({**CHAT, "tools": [WEATHER], "tool_choice": choice})[0].tool_choice == choice
    assert not _requests({**CHAT, "tools": [WEATHER]})[0].HasField("parallel_tool_calls")


@pytest.mark.parametrize("field,chat,param", [
    ("constraint.json_schema", True, "response_format.json_schema.schema"),
    ("constraint.regex", True, "structured_outputs.regex"),
    ("prompt", True, "messages"), ("domain_hint", True, "domain"),
    ("messages[2].tool_calls[0].arguments", True, "messages[2].tool_calls[0].function.arguments"),
    ("top_logprobs", True, "top_logprobs"), ("top_logprobs", False, "logprobs"), ("prompt", False, "prompt"),
    ("logit_bias", False, "logit_bias"), (None, True, None)])
def test_the_routers_fields_are_named_as_the_request_spelt_them(field, chat, param):
    from deploy import openai_api as oa

    fields = ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {}}}}
              if field == "constraint.json_schema" else {"structured_outputs": {"regex": "x"}})
    req = oa.parse(oa.ChatCompletionRequest if chat else oa.CompletionRequest, {**(CHAT if chat else TEXT), **fields})
    assert req.http_param(field) == param


def test_answers_have_openais_shapes_for_calls_and_logprobs():
    from deploy import openai_api as oa
    from protos import specserve_pb2 as pb

    call = pb.ToolCall(id="call_x", name="get_weather", arguments='{"city": "Paris"}')
    lp = pb.TokenLogprob(token=5, logprob=-0.5, top_ids=[5, 9], top_logprobs=[-0.5, -math.inf], text="é",
                         token_bytes="é".encode(), top_texts=["é", "x"], top_bytes=["é".encode(), b"x"])
    chat = oa.Responses(True, "r", MODEL, logprobs=True)
    body = chat.whole([""], [[5]], ["tool_calls"], [pb.Usage(completion_tokens=1, forced_tokens=1)], [[call]], [[lp]])
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert entry == {"token": "é", "logprob": -0.5, "bytes": [195, 169], "top_logprobs": [
        {"token": "é", "logprob": -0.5, "bytes": [195, 169]}, {"token": "x", "logprob": -9999.0, "bytes": [120]}]}
    assert body["usage"]["forced_tokens"] == 1
    json.dumps(body, allow_nan=False)  # what the ingress's JSONResponse demands
    delta = chat.chunk(0, "", [5], "tool_calls", calls=[call])["choices"][0]["delta"]
    assert delta == {"tool_calls": [{"index": 0, "id": "call_x", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert chat.chunk(0, "hi", [5], None)["choices"][0]["logprobs"] is None  # no logprobs in that chunk
    text = oa.Responses(False, "r", MODEL, logprobs=True)
    first = text.chunk(0, "é", [5], None, logprobs=[lp])["choices"][0]["logprobs"]
    second = text.chunk(0, "é", [5], None, logprobs=[lp, lp])["choices"][0]["logprobs"]
    assert first == {"tokens": ["é"], "token_logprobs": [-0.5], "top_logprobs": [{"é": -0.5, "x": -9999.0}],
                     "text_offset": [0]}
    assert second["text_offset"] == [1, 2]  # counted from the choice's text so far
    plain = oa.Responses(True, "r", MODEL).whole(["hi"], [[5]], ["stop"], [pb.Usage()])
    assert plain["choices"][0]["logprobs"] is None and "tool_calls" not in plain["choices"][0]["message"]


def test_a_renamed_field_is_renamed_in_the_message_too():
    from deploy import openai_api as oa

    req = oa.parse(oa.ChatCompletionRequest, {**CHAT, "guided_regex": "("})
    e = oa.router_error("INVALID_ARGUMENT", "constraint.regex: is not a valid regex: unclosed", "constraint.regex")
    req.rename(e)
    assert (e.param, e.message) == ("guided_regex", "guided_regex: is not a valid regex: unclosed")
    e = oa.router_error("INVALID_ARGUMENT", "max_tokens: must be positive", "max_tokens")
    req.rename(e)
    assert (e.param, e.message) == ("max_tokens", "max_tokens: must be positive")
