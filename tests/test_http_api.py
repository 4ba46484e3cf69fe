"""The OpenAI-compatible HTTP API, as users reach it: `specserve serve` (the README's
main job: a local Ray cluster, the Serve application, the embedded store) started
once for the module, and the official `openai` client, sync and async, streamed and
not. Greedy outputs must equal the Hugging Face oracle token for token; bad input
gets OpenAI's error shape with the field named, and the server keeps serving.
The server's cold start is the readiness test: a request sent while it starts
succeeds, and /health says ready only when a request would succeed."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import urllib.error
import urllib.request

import openai
import pytest

from oracle import MAX_TOKENS, PROMPTS, near_tie_or_equal
from serve_process import specserve_serve

MODEL = "SmolLM2-135M-Instruct"


def _json(raw: bytes) -> dict:
    try:
        return json.loads(raw)
    except ValueError:  # Serve's proxy answers in plain text before the application is up
        return {}


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, _json(r.read())
    except urllib.error.HTTPError as e:
        return e.code, _json(e.read())


def _post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class ColdStart:
    """What clients saw while the server started: health answers in order, and the outcome
    of a chat request sent as soon as the HTTP port took connections."""

    def __init__(self, base: str):
        self.base, self.health, self.early = base, [], None

    def send_early(self) -> None:
        try:
            client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="none", max_retries=0, timeout=240)
            self.early = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
        except Exception as e:  # noqa: BLE001 - the test reports it
            self.early = e


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cold = ColdStart("")
    early: list[threading.Thread] = []

    def while_starting(base: str) -> None:
        cold.base = base
        try:
            status, body = _get(f"{base}/health")
        except OSError:
            return
        ours = body == {"status": "ok"} or body.get("error", {}).get("code") == "not_ready"
        if not ours:  # the proxy, before our ingress is up
            return
        cold.health.append(status)
        if not early:  # the ingress answers: send a request now
            early.append(threading.Thread(target=cold.send_early))
            early[0].start()

    config = tmp_path_factory.mktemp("http") / "serve.toml"
    with specserve_serve(config, '[drafter_pools]\nkinds = ["pld", "suffix"]\n[verifiers]\nmax_len = 1024\n'
                                 'threads = 1\n', while_starting) as served:
        for thread in early:
            thread.join(timeout=240)
        yield served.http, cold, served.proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", timeout=240)


def test_request_sent_while_starting_succeeds_and_health_turns_ready_once(server):
    _, cold, _ = server
    assert cold.early is not None, "the ingress never answered before the server said it was serving"
    assert not isinstance(cold.early, Exception), repr(cold.early)
    assert cold.early.choices[0].message.content and cold.early.usage.completion_tokens == 8
    # health may say 503 while starting, then 200; never ready and then not ready again
    assert cold.health and set(cold.health) <= {200, 503}, cold.health
    first_ready = cold.health.index(200) if 200 in cold.health else len(cold.health)
    assert all(s == 200 for s in cold.health[first_ready:]), cold.health
    assert _get(f"{server[0]}/health") == (200, {"status": "ok"})


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.parametrize("i", [0, 1, 2])
def test_chat_greedy_equals_the_oracle(client, hf_oracle, i):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i][1]}],
                                       max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True})
    ids = r.choices[0].token_ids
    near_tie_or_equal(hf_oracle, i, ids, "HTTP chat")
    assert r.usage.completion_tokens == len(ids) and r.usage.total_tokens == r.usage.prompt_tokens + len(ids)
    assert r.choices[0].finish_reason in ("stop", "length")
    # the speculation figures ride along in usage
    assert r.usage.target_forward_passes >= 1 and r.usage.drafters
    assert r.usage.mean_accepted_tokens == pytest.approx(len(ids) / r.usage.target_forward_passes, rel=1e-3)


def test_async_stream_equals_the_oracle_and_ends_with_usage(server, hf_oracle):
    async def run(i: int):
        aclient = openai.AsyncOpenAI(base_url=f"{server[0]}/v1", api_key="none", timeout=240)
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[i][1]}], max_tokens=MAX_TOKENS,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"return_token_ids": True})
        chunks = [c async for c in stream]
        await aclient.close()
        return chunks

    for i in (3, 4):
        chunks = asyncio.run(run(i))
        assert chunks[0].choices[0].delta.role == "assistant"
        ids = [t for c in chunks for ch in c.choices for t in (getattr(ch, "token_ids", None) or [])]
        near_tie_or_equal(hf_oracle, i, ids, "HTTP async stream")
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
        assert all(c.usage is None for c in chunks[:-1])


def test_text_completion_sync_stream_matches_the_whole_answer(client):
    kwargs = dict(model=MODEL, prompt="The three primary colors are", max_tokens=24, temperature=0)
    whole = client.completions.create(**kwargs)
    parts = list(client.completions.create(stream=True, **kwargs))
    assert whole.object == "text_completion" and all(p.object == "text_completion" for p in parts)
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_string_ends_the_streamed_text_just_before_it(client):
    kwargs = dict(model=MODEL, prompt="The three primary colors are", max_tokens=24, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    words = whole.split()
    assert len(words) >= 4, whole
    stop = " " + words[2]  # a stop string the greedy output holds, a few tokens in
    assert whole.find(stop) > 0, whole
    parts = list(client.completions.create(stream=True, stop=[stop, "never in it"], **kwargs))
    assert "".join(p.choices[0].text for p in parts) == whole[:whole.find(stop)]
    assert parts[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_choices_differ(client):
    # the same seed draws the same tokens from the same drafts: a drafter that learns across
    # requests (or routing's exploration) drafts differently the second time, so pin one that does not
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Write a line about the sea."}],
                  max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, n=2, extra_body={"drafter": "pld"})
    a, b = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert texts[0] != texts[1]  # choice i samples with seed + i
    assert a.usage.completion_tokens > 0


BAD = [  # (change to a good request, the param the error must name, status)
    ({"temperature": -1}, "temperature", 400),
    ({"top_p": 0}, "top_p", 400),
    ({"max_tokens": 0}, "max_tokens", 400),
    ({"max_tokens": 100000}, "max_tokens", 400),
    ({"n": 0}, "n", 400),
    ({"seed": -1}, "seed", 400),
    ({"stop": ["x"] * 9}, "stop", 400),
    ({"messages": []}, "messages", 400),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", 400),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", 400),  # logprobs and tools are taken: bad values
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice", 400),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema", 400),
    ({"logit_bias": {"12": 101}}, "logit_bias", 400),
    ({"functions": [{"name": "f"}]}, "functions", 400),
    ({"frobnicate": 1}, "frobnicate", 400),
    ({"drafter": "no-such"}, "drafter", 400),
    ({"domain": "astrology"}, "domain", 400),
    ({"drafter": "eagle", "eagle_placement": "gpu"}, "eagle_placement", 400),
    ({"stream_options": {"include_usage": True}}, "stream_options", 400),
    ({"model": "gpt-4"}, "model", 404),
    ({"messages": [{"role": "user", "content": "word " * 5000}]}, "messages", 413),
]


@pytest.mark.parametrize("change,param,status", BAD, ids=[p for _, p, _ in BAD])
def test_bad_field_gets_openai_error_naming_it(server, change, param, status):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **change}
    got, reply = _post(f"{server[0]}/v1/chat/completions", json.dumps(body).encode())
    assert got == status, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"} and reply["error"]["param"] == param, reply
    assert isinstance(reply["error"]["code"], str) and reply["error"]["code"], reply  # every error has a code


def test_not_json_and_unknown_route_then_keeps_serving(server, client):
    status, reply = _post(f"{server[0]}/v1/chat/completions", b"{not json")
    assert status == 400 and reply["error"]["code"] == "invalid_json"
    status, reply = _post(f"{server[0]}/v1/completions", b"[1, 2]")
    assert status == 400 and "error" in reply
    assert _get(f"{server[0]}/v1/nothing-here")[0] == 404
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_metrics_count_requests_by_status(server):
    with urllib.request.urlopen(f"{server[0]}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'specserve_http_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert 'status="400"' in text and "specserve_time_to_first_token_seconds_bucket" in text
    # every service's metrics, gathered by the ingress and labelled with the service they came from
    for name, service in [("spec_decode_num_draft_tokens_total", "router"),
                          ("specserve_verifier_pass_seconds_count", "verifier"),
                          ("specserve_drafter_requests_held", "drafter")]:
        assert re.search(rf'^{name}{{[^}}]*service="{service}"', text, re.M), (name, text)


HTTP_FUZZ_EXAMPLES = 150


def test_fuzzed_requests_get_2xx_or_openai_errors_and_leave_nothing_held(server):
    """schemathesis over /openapi.json (tests/fuzzing.py; scripts/fuzz.py runs thousands):
    every operation, bodies valid by the document and not, most steered to reach the model,
    and one in three a hostile body (a lone surrogate, a non-finite float, a wrong JSON type,
    deep nesting, a body past the size limit) that must get the error naming its field.
    Never a 5xx; every 4xx in OpenAI's error shape; then no verifier row or pool request
    held, and a plain request still succeeds."""
    pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    from fuzzing import HOSTILE_KINDS, HttpFuzz

    fuzz = HttpFuzz(server[0], MODEL)
    assert {"POST /v1/chat/completions", "POST /v1/completions"} <= {op.label for op in fuzz.operations}

    @settings(max_examples=HTTP_FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzz.strategy())
    def run(case_and_aim):
        fuzz.run(*case_and_aim)

    run()
    # and every kind of hostile body on both routes, whatever the draws were
    for chat in (True, False):
        for kind in sorted(set(HOSTILE_KINDS)):
            fuzz.run_hostile(fuzz.hostile(chat, kind, 1))
    assert not fuzz.failures, "\n".join(f"{f.operation} -> {f.status}: {f.problem}\n  {f.body!r:.500}"
                                        for f in fuzz.failures)
    # the steered requests reached the model, and the others were refused in the error shape
    statuses = {status for (op, status) in fuzz.counts if op.startswith("POST")}
    assert 200 in statuses and 400 in statuses, fuzz.counts
    assert {400, 413} <= {status for (op, status) in fuzz.counts if op.endswith("[hostile]")}, fuzz.counts
    assert fuzz.leaks() == {}
    ok, reply = fuzz.still_serving()
    assert ok, reply


@pytest.mark.parametrize("change,param", [
    ({"seed": 2**64 - 1, "n": 2}, "seed"), ({"max_tokens": 2**40}, "max_tokens"), ({"top_k": -2**40}, "top_k"),
    ({"max_completion_tokens": 2**31}, "max_completion_tokens")])
def test_integers_past_the_wire_get_400_naming_them(change, param):
    """Found by the fuzz: integers the router's int32 / uint64 fields cannot carry made the
    ingress raise while building the request (a 500); now a 400 naming the field."""
    from deploy import openai_api as oa

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(oa.OpenAIError) as refused:
        oa.parse(oa.ChatCompletionRequest, body).generate_requests("r")
    assert (refused.value.status, refused.value.param) == (400, param)


# -- what a hostile or careless client found (issue 65) ------------------------------------------
def _refusal(body, chat: bool | None = None) -> tuple[int, str | None, str | None, str]:
    """(status, param, code, message) of the ingress's parse of `body` into router requests."""
    from deploy import openai_api as oa

    kind = oa.ChatCompletionRequest if (chat if chat is not None else "prompt" not in body) else oa.CompletionRequest
    with pytest.raises(oa.OpenAIError) as refused:
        oa.parse(kind, body).generate_requests("r")
    e = refused.value
    return e.status, e.param, e.code, e.message


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": MODEL, "prompt": "hi"}
SURROGATES = [  # (body, the param the 400 must name)
    ({**CHAT, "messages": [{"role": "user", "content": "x\ud800y"}]}, "messages[0].content"),
    ({**CHAT, "messages": [CHAT["messages"][0], {"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages[1].content[0].text"),
    ({**TEXT, "prompt": "x\ud800y"}, "prompt"),
    ({**TEXT, "prompt": ["x\ud800y"]}, "prompt[0]"),
    ({**TEXT, "stop": "x\ud800y"}, "stop"),
    ({**CHAT, "stop": ["a", "\ud83d"], "stream": True}, "stop[1]"),
    ({**CHAT, "user": "\ud800"}, "user"),
]


@pytest.mark.parametrize("body,param", SURROGATES, ids=[p for _, p in SURROGATES])
def test_a_lone_surrogate_is_a_400_naming_the_field(body, param):
    """Found: a lone surrogate made building the router's request raise UnicodeEncodeError
    (a 500 with a plain-text body), streamed or not."""
    status, got, code, message = _refusal(body)
    assert (status, got, code) == (400, param, "invalid_value") and param in message


WRONG_TYPES = [  # (change, param, code): refused as OpenAI refuses them, not coerced
    ({"max_tokens": True}, "max_tokens", "invalid_type"),
    ({"max_tokens": 4.0}, "max_tokens", "invalid_type"),
    ({"temperature": "0.5"}, "temperature", "invalid_type"),
    ({"top_p": False}, "top_p", "invalid_type"),
    ({"n": "2"}, "n", "invalid_type"),
    ({"stream": 1}, "stream", "invalid_type"),
    ({"seed": "7"}, "seed", "invalid_type"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text",
     "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "x"}]}, "messages[0].mood", "unknown_field"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "missing_required_parameter"),
    ({"model": None}, "model", "invalid_type"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"n": 9}, "n", "invalid_value"),
    ({"seed": -1}, "seed", "invalid_value"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
]


@pytest.mark.parametrize("change,param,code", WRONG_TYPES, ids=[f"{p}-{c}" for _, p, c in WRONG_TYPES])
def test_wrong_types_and_values_are_400s_with_openai_param_and_code(change, param, code):
    """Found: validation errors had code null and a pydantic path for param
    (messages.0.content.str); bool and string values were coerced (max_tokens: true was 1)."""
    status, got, got_code, message = _refusal({**CHAT, **change})
    assert (status, got, got_code) == (400, param, code), message
    assert message.startswith(f"{param}: "), message


def test_prompt_of_the_wrong_type_names_prompt():
    assert _refusal({**TEXT, "prompt": 5})[:3] == (400, "prompt", "invalid_type")
    assert _refusal({**TEXT, "prompt": [5]})[:3] == (400, "prompt[0]", "invalid_type")
    assert _refusal({**TEXT, "prompt": None})[:3] == (400, "prompt", "invalid_type")
    assert _refusal({"model": MODEL}, chat=False)[:3] == (400, "prompt", "missing_required_parameter")


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"a":' * 100_000, b"{not json", b"\xff\xfe\x00"],
                         ids=["deep-lists", "deep-objects", "not-json", "not-utf8"])
def test_deep_or_broken_json_is_invalid_json(raw):
    """Found: 100,000 `[` made json.loads raise RecursionError (a 500)."""
    from deploy import openai_api as oa

    with pytest.raises(oa.OpenAIError) as refused:
        oa.loads(raw)
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "invalid_json", None)


def test_valid_bodies_still_parse_as_before():
    from deploy import openai_api as oa

    req = oa.parse(oa.ChatCompletionRequest, oa.loads(json.dumps(
        {**CHAT, "temperature": 1, "top_p": 0.5, "max_tokens": 3, "seed": 2, "n": 2, "stop": ["é漢🙂"],
         "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "é漢🙂"}]}).encode()))
    first = req.generate_requests("r")[0]
    assert (first.sampling.temperature, first.sampling.max_tokens, first.sampling.seed) == (1.0, 3, 2)
    assert [m.content for m in first.messages] == ["be brief", "é漢🙂"] and list(first.stop) == ["é漢🙂"]


def _post_raw(base: str, path: str, head: bytes, size: int = 0, chunked: bool = False) -> tuple[int, dict, float]:
    from fuzzing import post_raw

    return post_raw(base, path, head, size, chunked)


def test_big_bodies_are_refused_at_once_and_do_not_stall_the_server(server):
    """Found: nothing bounded a body, and the prompt was tokenized before its length was checked:
    a 10 MB body got its 413 after 10.6 s; with three in flight, a "Hello!" took 58.8 s (1.5 s
    alone) and /health answered 503. Now each is a 413 before it is read whole (by its
    Content-Length, or counted as it comes, chunked), and the rest of the server serves on."""
    import time

    base = server[0]
    small = json.dumps({"model": MODEL, "prompt": "Hello!", "max_tokens": 4, "temperature": 0}).encode()
    started = time.monotonic()
    assert _post(f"{base}/v1/completions", small)[0] == 200
    alone = time.monotonic() - started
    big = 10 * 1024 * 1024
    head = json.dumps({"model": MODEL, "max_tokens": 1, "prompt": "a" * (big // 2)}).encode()
    results: list = []
    senders = [threading.Thread(target=lambda c=chunked: results.append(
        _post_raw(base, "/v1/completions", head, big, chunked=c))) for chunked in (False, False, True)]
    for sender in senders:
        sender.start()
    started = time.monotonic()
    health = _get(f"{base}/health")
    health_s = time.monotonic() - started
    started = time.monotonic()
    status, reply = _post(f"{base}/v1/completions", small)
    small_s = time.monotonic() - started
    for sender in senders:
        sender.join(timeout=120)
    assert health == (200, {"status": "ok"}) and health_s < 1.0, (health, health_s)
    assert status == 200 and small_s < alone + 3.0, (reply, small_s, alone)
    assert len(results) == 3
    for status_, body, answered in results:
        assert status_ == 413 and body["error"]["code"] == "request_too_large", body
        assert set(body["error"]) == {"message", "type", "param", "code"} and answered < 5.0, (answered, body)


def _raw_body(change: dict | str, chat: bool = True) -> bytes:
    """A good request's body with `change` over it; a str is spliced in as raw JSON text."""
    body = {"model": MODEL, "max_tokens": 4, **({"messages": [{"role": "user", "content": "hi"}]} if chat
                                                else {"prompt": "hi"})}
    if isinstance(change, dict):
        return json.dumps({**body, **change}).encode()  # ensure_ascii: "\ud800" escapes; NaN, Infinity
    return (json.dumps(body)[:-1] + ", " + change + "}").encode()


HOSTILE = [  # (body, status, code, param): refused, never a 500 nor an answer
    (_raw_body({"messages": [{"role": "user", "content": "x\ud800y"}]}), 400, "invalid_value", "messages[0].content"),
    (_raw_body({"messages": [{"role": "user", "content": "x\ud800y"}], "stream": True}), 400, "invalid_value",
     "messages[0].content"),
    (_raw_body({"prompt": "x\udc00"}, chat=False), 400, "invalid_value", "prompt"),
    (_raw_body({"prompt": "hi", "stop": ["\ud800"], "stream": True}, chat=False), 400, "invalid_value", "stop[0]"),
    (b"[" * 100_000, 400, "invalid_json", None),
    (b'{"model": ' + b"[" * 100_000, 400, "invalid_json", None),
    (_raw_body('"temperature": 1e309'), 400, "invalid_value", "temperature"),
    (_raw_body({"temperature": float("inf")}), 400, "invalid_value", "temperature"),
    (_raw_body({"temperature": float("-inf")}), 400, "invalid_value", "temperature"),
    (_raw_body({"temperature": float("nan")}), 400, "invalid_value", "temperature"),
    (_raw_body({"temperature": 1e39}), 400, "invalid_value", "temperature"),  # inf as the wire's float32
    (_raw_body({"top_p": float("inf")}), 400, "invalid_value", "top_p"),
    (_raw_body({"max_tokens": True}), 400, "invalid_type", "max_tokens"),
    (_raw_body({"temperature": "0.5"}), 400, "invalid_type", "temperature"),
    (_raw_body({"messages": [{"role": "user", "content": 5}]}), 400, "invalid_type", "messages[0].content"),
    (_raw_body({"prompt": [5]}, chat=False), 400, "invalid_type", "prompt[0]"),
    (_raw_body({"seed": -1}), 400, "invalid_value", "seed"),
]


@pytest.mark.parametrize("body,status,code,param", HOSTILE, ids=[f"{i}-{p}" for i, (_, _, _, p) in enumerate(HOSTILE)])
def test_hostile_bodies_get_openai_errors_naming_the_field(server, body, status, code, param):
    path = "/v1/chat/completions" if b'"messages"' in body or not body.startswith(b"{") else "/v1/completions"
    got, reply, _ = _post_raw(server[0], path, body)
    assert (got, reply.get("error", {}).get("code"), reply.get("error", {}).get("param")) == (status, code, param), \
        reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    if param:
        assert param in reply["error"]["message"], reply
