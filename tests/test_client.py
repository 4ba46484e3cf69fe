"""specserve.client against a real gRPC server on loopback.

The server runs `FakeSpecserve`: deterministic tokens, plus the faults a real
router cannot be made to produce on cue (UNAVAILABLE for the first N calls or
after the first chunk, a slow answer, INVALID_ARGUMENT). Everything else is
real: channels, service-config retries, deadlines, metadata, TLS, the CLI
as a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import re

import pytest

from certs import self_signed_pem
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from specserve.client import AsyncClient, Chunk, Client, Completion, SpecserveError, TokenLogprob, ToolCall, Usage

ROOT = Path(__file__).resolve().parents[1]


class FakeSpecserve(pb_grpc.SpecserveServicer):
    """Token i of a reply is id 100+i with text " t{i}"; streams send 2 tokens per chunk."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.fail_first = 0  # answer UNAVAILABLE to this many calls
        self.fail_after_first_chunk = False
        self.sleep_s = 0.0
        self.invalid = False
        self.echo_metadata = False  # reply text = the x-* metadata received
        self.calls_and_logprobs = False  # replies carry a tool call and, when asked, each token's logprobs
        self.calls = 0
        self.requests: list[pb.GenerateRequest] = []

    def _start(self, request, context):
        self.calls += 1
        self.requests.append(request)
        if self.calls <= self.fail_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "overloaded, try again")
        if self.invalid:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: exceeds the model's\ncontext")
        end = time.monotonic() + self.sleep_s
        while time.monotonic() < end and context.is_active():  # stop early once the client gave up
            time.sleep(0.01)

    @staticmethod
    def _usage(request) -> pb.Usage:
        n = request.sampling.max_tokens
        passes = (n + 1) // 2
        words = request.prompt.split() + [w for m in request.messages for w in m.content.split()]
        return pb.Usage(prompt_tokens=len(words), completion_tokens=n, target_forward_passes=passes,
                        draft_tokens=3 * passes, accepted_draft_tokens=n - passes, mean_accepted_tokens=n / passes,
                        drafter=request.drafter or "pld")

    def Generate(self, request, context):
        self._start(request, context)
        n = request.sampling.max_tokens
        text = "".join(f" t{i}" for i in range(n))
        if self.echo_metadata:
            text = ";".join(f"{k}={v}" for k, v in context.invocation_metadata() if k.startswith("x-"))
        resp = pb.GenerateResponse(request_id=request.request_id or "srv", text=text,
                                   token_ids=[100 + i for i in range(n)], finish_reason="length",
                                   usage=self._usage(request))
        if self.calls_and_logprobs:
            self._add_calls_and_logprobs(resp, request, range(n), last=True)
        return resp

    @staticmethod
    def _add_calls_and_logprobs(out, request, ids, last: bool) -> None:
        if last:
            out.tool_calls.add(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
            out.finish_reason = "tool_calls"
        if request.sampling.HasField("logprobs"):
            k = request.sampling.logprobs
            for i in ids:
                out.logprobs.add(token=100 + i, logprob=-0.5 * i, text=f" t{i}", token_bytes=f" t{i}".encode(),
                                 top_ids=[100 + i + j for j in range(k)],
                                 top_logprobs=[-0.5 * i - j for j in range(k)],
                                 top_texts=[f" t{i + j}" for j in range(k)], top_bytes=[f" t{i + j}".encode()
                                                                                        for j in range(k)])

    def GenerateStream(self, request, context):
        self._start(request, context)
        n = request.sampling.max_tokens
        for lo in range(0, n, 2):
            ids = range(lo, min(lo + 2, n))
            last = ids[-1] == n - 1
            chunk = pb.GenerateChunk(request_id=request.request_id or "srv", text="".join(f" t{i}" for i in ids),
                                     token_ids=[100 + i for i in ids], finish_reason="length" if last else "",
                                     usage=self._usage(request) if last else None)
            if self.calls_and_logprobs:
                self._add_calls_and_logprobs(chunk, request, ids, last)
            yield chunk
            if self.fail_after_first_chunk:
                context.abort(grpc.StatusCode.UNAVAILABLE, "verifier lost")


class Server:
    def __init__(self):
        self.servicer = FakeSpecserve()
        self.cert, key = self_signed_pem()
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_SpecserveServicer_to_server(self.servicer, self.grpc)
        self.addr = f"127.0.0.1:{self.grpc.add_insecure_port('127.0.0.1:0')}"
        creds = grpc.ssl_server_credentials([(key, self.cert)])
        self.tls_addr = f"127.0.0.1:{self.grpc.add_secure_port('127.0.0.1:0', creds)}"
        self.grpc.start()


@pytest.fixture(scope="module")
def running():
    s = Server()
    yield s
    s.grpc.stop(grace=None)


@pytest.fixture
def server(running):
    running.servicer.reset()
    return running


def usage(n: int, prompt_tokens: int, drafter: str = "pld") -> Usage:
    passes = (n + 1) // 2
    float32_mean = struct.unpack("f", struct.pack("f", n / passes))[0]  # a float on the wire
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=n, target_forward_passes=passes,
                 draft_tokens=3 * passes, accepted_draft_tokens=n - passes, mean_accepted_tokens=float32_mean,
                 drafter=drafter)


# ---- blocking client ----------------------------------------------------------

def test_generate_maps_request_and_response(server):
    with Client(server.addr) as c:
        done = c.generate("one two three", max_tokens=4, temperature=0.5, top_p=0.9, top_k=7, seed=3,
                          stop=["\n\n"], domain_hint="code", drafter="layerskip", request_id="r1")
    assert done == Completion(text=" t0 t1 t2 t3", token_ids=(100, 101, 102, 103), finish_reason="length",
                              usage=usage(4, 3, "layerskip"), request_id="r1")
    assert done.usage.acceptance_rate == pytest.approx(2 / 6)
    req = server.servicer.requests[-1]
    assert (req.prompt, list(req.messages), list(req.stop), req.domain_hint, req.drafter) == \
        ("one two three", [], ["\n\n"], "code", "layerskip")
    s = req.sampling
    assert (s.max_tokens, s.top_k, s.seed) == (4, 7, 3)
    assert (s.temperature, s.top_p) == pytest.approx((0.5, 0.9))


def test_messages_are_sent_and_seed_left_unset(server):
    with Client(server.addr) as c:
        c.generate(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                   max_tokens=1)
    req = server.servicer.requests[-1]
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"), ("user", "hi")]
    assert req.prompt == "" and not req.sampling.HasField("seed")


def test_structured_output_tools_logprobs_and_penalties_are_sent(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                               "parameters": {"type": "object"}}}, {"name": "ping"}]
    with Client(server.addr) as c:
        c.generate("x", json_schema={"type": "object"}, logprobs=3, processed_logprobs=True, presence_penalty=0.5,
                   frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={12: -100.0}, min_tokens=2,
                   stop_token_ids=[7], draft_length=0)
        req = server.servicer.requests[-1]
        assert json.loads(req.constraint.json_schema) == {"type": "object"}
        s = req.sampling
        assert (s.logprobs, s.processed_logprobs, s.min_tokens, list(s.stop_token_ids)) == (3, True, 2, [7])
        assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == pytest.approx((0.5, -0.5, 1.2))
        assert dict(s.logit_bias) == {12: -100.0} and req.draft_length == 0
        for kwargs, kind, value in [({"json_object": True}, "json_object", True), ({"regex": "a+"}, "regex", "a+"),
                                    ({"choice": ["a", "b"]}, "choice", ["a", "b"]),
                                    ({"grammar": 'start: "x"'}, "grammar", 'start: "x"')]:
            c.generate("x", **kwargs)
            got = server.servicer.requests[-1].constraint
            assert got.WhichOneof("kind") == kind
            assert (list(got.choice.options) if kind == "choice" else getattr(got, kind)) == value
        c.generate(messages=[{"role": "user", "content": "weather?"},
                             {"role": "assistant", "tool_calls": [ToolCall("call_1", "get_weather", '{"city": "P"}')]},
                             {"role": "assistant", "content": "", "tool_calls": [
                                 {"id": "call_2", "type": "function",
                                  "function": {"name": "ping", "arguments": {"n": 1}}}]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}],
                   tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   parallel_tool_calls=False)
        req = server.servicer.requests[-1]
        assert [(t.name, t.description, t.parameters) for t in req.tools] == [
            ("get_weather", "weather", '{"type": "object"}'), ("ping", "", "")]
        assert (req.tool_choice, req.parallel_tool_calls) == ("get_weather", False)
        assert [[(k.id, k.name, k.arguments) for k in m.tool_calls] for m in req.messages] == [
            [], [("call_1", "get_weather", '{"city": "P"}')], [("call_2", "ping", '{"n": 1}')], []]
        assert (req.messages[3].role, req.messages[3].tool_call_id) == ("tool", "call_1")
        plain = c.generate("x") and server.servicer.requests[-1]
        assert not plain.sampling.HasField("logprobs") and not plain.HasField("draft_length")
        assert plain.constraint.WhichOneof("kind") is None and plain.tool_choice == ""


@pytest.mark.parametrize("kwargs", [{"regex": "a", "choice": ["a"]}, {"choice": "ab"},
                                    {"tools": [{"type": "function", "function": {}}]},
                                    {"tool_choice": {"type": "function"}},
                                    {"messages": [{"role": "user", "content": "x", "mood": "happy"}]}])
def test_bad_structured_and_tool_arguments_raise_before_sending(server, kwargs):
    with Client(server.addr) as c:
        with pytest.raises(ValueError):
            c.generate(**({"prompt": "x"} if "messages" not in kwargs else {}), **kwargs)
    assert server.servicer.calls == 0


def test_completion_and_chunks_carry_tool_calls_and_logprobs(server):
    server.servicer.calls_and_logprobs = True
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    with Client(server.addr) as c:
        done = c.generate("x", max_tokens=2, logprobs=2)
        chunks = list(c.stream("x", max_tokens=3, logprobs=1))
        without = c.generate("x", max_tokens=2)
    assert done.finish_reason == "tool_calls" and done.tool_calls == (call,)
    assert call.parsed_arguments() == {"city": "Paris"}
    assert done.logprobs[1] == TokenLogprob(101, -0.5, " t1", b" t1", (TokenLogprob(101, -0.5, " t1", b" t1"),
                                                                       TokenLogprob(102, -1.5, " t2", b" t2")))
    assert [len(ch.logprobs) for ch in chunks] == [2, 1] and chunks[-1].tool_calls == (call,)
    assert chunks[0].tool_calls == () and without.logprobs is None and without.tool_calls == (call,)


@pytest.mark.parametrize("kwargs", [{}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
                                    {"messages": []}, {"messages": [{"role": "user"}]}])
def test_bad_arguments_raise_before_sending(server, kwargs):
    with Client(server.addr) as c:
        with pytest.raises(ValueError):
            c.generate(**kwargs)
        with pytest.raises(ValueError):
            c.stream(**kwargs)
    assert server.servicer.calls == 0


@pytest.mark.parametrize("kwargs,name", [({"prompt": "x\ud800y"}, "prompt"), ({"prompt": "x", "stop": ["a", "\udfff"]},
                                          "stop[1]"),
                                         ({"messages": [{"role": "user", "content": "\ud83d"}]}, "messages[0].content")])
def test_a_lone_surrogate_is_refused_before_sending_naming_the_argument(server, kwargs, name):
    """A protobuf string cannot carry one: the library raised UnicodeEncodeError, naming nothing."""
    with Client(server.addr) as c:
        for call in (c.generate, c.stream):
            with pytest.raises(ValueError, match=rf"^{re.escape(name)}: "):
                call(**kwargs)
    assert server.servicer.calls == 0


def test_stream_yields_chunks_with_usage_on_the_last(server):
    with Client(server.addr) as c:
        chunks = list(c.stream("a b", max_tokens=5, request_id="s1"))
    assert [ch.text for ch in chunks] == [" t0 t1", " t2 t3", " t4"]
    assert [ch.token_ids for ch in chunks] == [(100, 101), (102, 103), (104,)]
    assert chunks[:-1] == [Chunk(text=ch.text, token_ids=ch.token_ids, finish_reason=None, usage=None,
                                 request_id="s1") for ch in chunks[:-1]]
    assert (chunks[-1].finish_reason, chunks[-1].usage) == ("length", usage(5, 2))


def test_unary_retries_unavailable(server):
    server.servicer.fail_first = 2
    with Client(server.addr) as c:
        assert c.generate("x", max_tokens=2).text == " t0 t1"
    assert server.servicer.calls == 3


def test_stream_retries_unavailable_before_the_first_chunk(server):
    server.servicer.fail_first = 2
    with Client(server.addr) as c:
        assert "".join(ch.text for ch in c.stream("x", max_tokens=3)) == " t0 t1 t2"
    assert server.servicer.calls == 3


def test_stream_failing_after_a_chunk_is_not_retried(server):
    server.servicer.fail_after_first_chunk = True
    got = []
    with Client(server.addr) as c:
        with pytest.raises(SpecserveError) as e:
            got.extend(ch.text for ch in c.stream("x", max_tokens=4))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.details == "verifier lost"
    assert got == [" t0 t1"] and server.servicer.calls == 1


@pytest.mark.parametrize("streaming", [False, True])
def test_retries_give_up_after_max_attempts(server, streaming):
    server.servicer.fail_first = 10
    with Client(server.addr, max_attempts=3) as c:
        with pytest.raises(SpecserveError) as e:
            list(c.stream("x")) if streaming else c.generate("x")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert server.servicer.calls == 3


def test_max_attempts_outside_grpc_limits_is_refused():
    with pytest.raises(ValueError):
        Client("127.0.0.1:1", max_attempts=6)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("where", ["call", "client"])
def test_deadline_exceeded(server, streaming, where):
    server.servicer.sleep_s = 5
    per_call = {"timeout": 0.3} if where == "call" else {}
    with Client(server.addr, timeout=0.3 if where == "client" else None) as c:
        start = time.monotonic()
        with pytest.raises(SpecserveError) as e:
            list(c.stream("x", **per_call)) if streaming else c.generate("x", **per_call)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 2


def test_metadata_from_client_and_call_arrives(server):
    server.servicer.echo_metadata = True
    with Client(server.addr, metadata=[("x-tenant", "acme")]) as c:
        assert c.generate("x", metadata=[("x-trace", "t-9")]).text == "x-tenant=acme;x-trace=t-9"


def test_tls_with_the_servers_certificate(server):
    with Client(server.tls_addr, tls=True, root_certificates=server.cert) as c:
        assert c.generate("x", max_tokens=1).text == " t0"


@pytest.mark.parametrize("tls", [False, True])  # plain text; TLS trusting only the system roots
def test_tls_server_refuses_untrusted_clients(server, tls):
    with Client(server.tls_addr, tls=tls, max_attempts=1, timeout=5) as c:
        with pytest.raises(SpecserveError) as e:
            c.generate("x", max_tokens=1)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert server.servicer.calls == 0


# ---- asyncio client -----------------------------------------------------------

def test_async_generate_and_stream(server):
    async def main():
        async with AsyncClient(server.addr) as c:
            done = await c.generate("a b", max_tokens=2, request_id="r2")
            chunks = [ch async for ch in c.stream(messages=[{"role": "user", "content": "hi"}], max_tokens=3)]
        return done, chunks

    done, chunks = asyncio.run(main())
    assert done == Completion(text=" t0 t1", token_ids=(100, 101), finish_reason="length", usage=usage(2, 2),
                              request_id="r2")
    assert [ch.text for ch in chunks] == [" t0 t1", " t2"]
    assert (chunks[0].usage, chunks[-1].usage) == (None, usage(3, 1))


@pytest.mark.parametrize("streaming", [False, True])
def test_async_retries_unavailable(server, streaming):
    server.servicer.fail_first = 2

    async def main():
        async with AsyncClient(server.addr) as c:
            if streaming:
                return "".join([ch.text async for ch in c.stream("x", max_tokens=2)])
            return (await c.generate("x", max_tokens=2)).text

    assert asyncio.run(main()) == " t0 t1"
    assert server.servicer.calls == 3


def test_async_deadline_and_metadata(server):
    async def main():
        async with AsyncClient(server.addr, metadata=[("x-tenant", "acme")], timeout=0.3) as c:
            server.servicer.echo_metadata = True
            echoed = (await c.generate("x", metadata=[("x-trace", "t-9")])).text
            server.servicer.sleep_s = 5
            with pytest.raises(SpecserveError) as e:
                await c.generate("x")
        return echoed, e.value.code

    start = time.monotonic()
    assert asyncio.run(main()) == ("x-tenant=acme;x-trace=t-9", grpc.StatusCode.DEADLINE_EXCEEDED)
    assert time.monotonic() - start < 2


# ---- specserve generate --server ---------------------------------------------

def specserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "commands.cli", "generate", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_cli_json_through_the_server(server):
    r = specserve("--server", server.addr, "--json", "--chat", "--prompt", "Name three colours.",
                  "--max-tokens", "4", "--seed", "7", "--namespace", "tenant-a")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out.pop("seconds") > 0 and out.pop("tokens_per_s") > 0
    assert out == {"text": " t0 t1 t2 t3", "token_ids": [100, 101, 102, 103], "finish_reason": "length",
                   "prompt_tokens": 3, "completion_tokens": 4, "drafter": "pld", "target_forward_passes": 2,
                   "mean_accepted_tokens": 2.0, "draft_tokens": 6, "accepted_draft_tokens": 2,
                   "acceptance_rate": 0.3333}
    req = server.servicer.requests[-1]
    assert [(m.role, m.content) for m in req.messages] == [("user", "Name three colours.")]
    assert (req.drafter, req.sampling.seed) == ("", 7)  # no --drafter: the router chooses
    assert req.namespace == "tenant-a"


def test_cli_structured_output_logprobs_and_penalties_through_the_server(server, tmp_path):
    server.servicer.calls_and_logprobs = True
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    r = specserve("--server", server.addr, "--json", "--prompt", "hi", "--max-tokens", "2", "--json-schema",
                  str(schema), "--logprobs", "1", "--presence-penalty", "0.5", "--frequency-penalty", "0.25",
                  "--repetition-penalty", "1.1", "--logit-bias", "12=-100", "--logit-bias", "13=2.5",
                  "--min-tokens", "1", "--draft-length", "0")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["logprobs"] == [{"token": 100, "text": " t0", "logprob": 0.0,
                                "top": [{"token": 100, "text": " t0", "logprob": 0.0}]},
                               {"token": 101, "text": " t1", "logprob": -0.5,
                                "top": [{"token": 101, "text": " t1", "logprob": -0.5}]}]
    req = server.servicer.requests[-1]
    assert json.loads(req.constraint.json_schema) == {"type": "object", "properties": {"a": {"type": "integer"}}}
    s = req.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == pytest.approx((0.5, 0.25, 1.1))
    assert dict(s.logit_bias) == {12: -100.0, 13: 2.5} and (s.min_tokens, s.logprobs, req.draft_length) == (1, 1, 0)
    for flags, kind, value in [(("--regex", "[0-9]+"), "regex", "[0-9]+"),
                               (("--choice", "yes", "--choice", "no"), "choice", ["yes", "no"]),
                               (("--grammar", 'start: "x"'), "grammar", 'start: "x"'),
                               (("--json-object",), "json_object", True)]:
        r = specserve("--server", server.addr, "--json", "--prompt", "hi", "--max-tokens", "1", *flags)
        assert r.returncode == 0, r.stderr
        got = server.servicer.requests[-1].constraint
        assert got.WhichOneof("kind") == kind
        assert (list(got.choice.options) if kind == "choice" else getattr(got, kind)) == value
    r = specserve("--server", server.addr, "--json", "--prompt", "hi", "--max-tokens", "1")
    plain = server.servicer.requests[-1]
    assert r.returncode == 0 and not plain.HasField("draft_length") and not plain.sampling.HasField("logprobs")
    assert not plain.sampling.HasField("repetition_penalty")


@pytest.mark.parametrize("flags,flag", [(("--json-schema", "{nope"), "--json-schema"),
                                        (("--logit-bias", "12"), "--logit-bias"),
                                        (("--logit-bias", "12=200"), "--logit-bias"),
                                        (("--presence-penalty", "3"), "--presence-penalty"),
                                        (("--logprobs", "2"), "--logprobs"),  # without --json
                                        (("--logprobs", "21", "--json"), "--logprobs"),
                                        (("--min-tokens", "9", "--max-tokens", "4"), "--min-tokens")])
def test_cli_bad_new_flags_are_one_line_naming_the_flag(server, flags, flag):
    r = specserve("--server", server.addr, "--prompt", "hi", *flags)
    assert r.returncode == 2 and r.stderr.startswith(f"specserve: error: {flag}: ") and \
        len(r.stderr.splitlines()) == 1, r.stderr
    assert server.servicer.calls == 0


def test_cli_streams_text_through_the_server(server):
    r = specserve("--server", server.addr, "--prompt", "hi", "--max-tokens", "3", "--drafter", "none")
    assert (r.returncode, r.stdout) == (0, " t0 t1 t2\n"), r.stderr
    assert server.servicer.requests[-1].drafter == "none"


@pytest.mark.parametrize("fault, code, status", [("invalid", "INVALID_ARGUMENT", 2), ("fail_first", "UNAVAILABLE", 1)])
def test_cli_server_errors_are_one_line(server, fault, code, status):
    setattr(server.servicer, fault, 100 if fault == "fail_first" else True)
    r = specserve("--server", server.addr, "--json", "--prompt", "hi", "--timeout", "10")
    assert r.returncode == status
    assert r.stderr.startswith(f"specserve: error: {code}: ") and len(r.stderr.splitlines()) == 1, r.stderr
