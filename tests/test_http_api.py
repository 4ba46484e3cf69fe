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
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", 400),
    ({"logprobs": True}, "logprobs", 400),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", 400),
    ({"frobnicate": 1}, "frobnicate", 400),
    ({"drafter": "no-such"}, "drafter", 400),
    ({"domain": "astrology"}, "domain", 400),
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
    every operation, bodies valid by the document and not, most steered to reach the model.
    Never a 5xx; every 4xx in OpenAI's error shape; then no verifier row or pool request
    held, and a plain request still succeeds."""
    pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    from fuzzing import HttpFuzz

    fuzz = HttpFuzz(server[0], MODEL)
    assert {"POST /v1/chat/completions", "POST /v1/completions"} <= {op.label for op in fuzz.operations}

    @settings(max_examples=HTTP_FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzz.strategy())
    def run(case_and_aim):
        fuzz.run(*case_and_aim)

    run()
    assert not fuzz.failures, "\n".join(f"{f.operation} -> {f.status}: {f.problem}\n  {f.body!r:.500}"
                                        for f in fuzz.failures)
    # the steered requests reached the model, and the others were refused in the error shape
    statuses = {status for (op, status) in fuzz.counts if op.startswith("POST")}
    assert 200 in statuses and 400 in statuses, fuzz.counts
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
