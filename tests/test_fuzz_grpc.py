"""Fuzzing every gRPC service (issue 21): hypothesis programs of calls with requests
built from the proto's descriptors (tests/fuzzing.py) against a real router, verifier
and drafter pool served on loopback with the tiny target (no Ray), the internal two
with the cluster secret as `specserve serve` runs them. Each call ends OK or with a
status a client can act on (INVALID_ARGUMENT naming the field, RESOURCE_EXHAUSTED...),
never INTERNAL or UNKNOWN; afterwards nothing is held and valid requests still
succeed. scripts/fuzz.py runs the same for many more inputs; the inputs that found
bugs are kept below as regression tests."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings

from fuzzing import (TINY_KINDS, RawRequest, Strategies, Tally, Target, allowed_statuses, call, describe,
                     message_class, rpcs, still_serving, tiny_services)
from protos import specserve_pb2 as pb
from tiny import TINY

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
STRATEGIES = Strategies(TINY.vocab_size, TINY_KINDS)
TALLY = Tally()  # every call of the module's fuzz: (RPC, status) -> calls


@pytest.fixture(scope="module")
def target():
    with tiny_services() as target:
        yield target


def check(target: Target, program) -> None:
    bad = target.run(program, TALLY)
    assert not bad, "\n".join(f"{o.rpc} -> {o.status}: {o.details}\n  {describe(o.request)}" for o in bad)
    assert not target.leaks(), target.leaks()


def calls_of(name: str, status: str | None = None) -> int:
    return sum(n for (rpc, s), n in TALLY.counts.items() if rpc == name and status in (None, s))


def test_every_rpc_of_every_service_has_a_strategy():
    assert {r.name for r in rpcs()} == {
        "Specserve.Generate", "Specserve.GenerateStream", "Verifier.Prefill", "Verifier.Verify",
        "Verifier.Decode", "Verifier.Release", "Verifier.Stats", "Drafter.Prefill", "Drafter.Propose", "Drafter.Release"}
    for rpc in rpcs():
        @settings(FUZZ, max_examples=5)
        @given(STRATEGIES.request(rpc))
        def builds(request):
            message = request.message if isinstance(request, RawRequest) else request
            assert type(message) is message_class(rpc.request)

        builds()


@pytest.mark.parametrize("service", ["Verifier", "Drafter", "Specserve"])
def test_fuzzed_calls_never_crash_and_leave_nothing_held(target, service):
    @FUZZ
    @given(STRATEGIES.program(service))
    def fuzz(program):
        check(target, program)

    fuzz()
    # every RPC of the service was called, and the stateful ones got past validation too
    for rpc in rpcs(service):
        assert calls_of(rpc.name) >= 10, (rpc.name, TALLY.counts)
        if rpc.method in ("Generate", "Prefill", "Verify", "Decode", "Propose"):
            assert calls_of(rpc.name, "OK") >= 3, (rpc.name, TALLY.counts)
        assert calls_of(rpc.name) > calls_of(rpc.name, "OK") or rpc.method in ("Release", "Stats"), rpc.name


def test_after_the_fuzz_valid_requests_succeed_and_nothing_is_held(target):
    assert not still_serving(target)
    assert not target.leaks()
    assert not [k for k in TALLY.counts if k[1] not in allowed_statuses(k[0].split(".")[0])], TALLY.counts


# -- what the fuzz found: each input as it was first reported, now refused cleanly --------------
GENERATE = next(r for r in rpcs("Specserve") if r.method == "Generate")
FOUND = [  # (RPC, request, the field its INVALID_ARGUMENT must name)
    # a drafter name too long for a file name: the router's look-up of a drafter directory
    # raised OSError (ENAMETOOLONG), UNKNOWN
    (GENERATE, pb.GenerateRequest(prompt="hello", drafter="x" * 300, sampling=pb.SamplingParams(max_tokens=4)),
     "drafter"),
    # a drafter the router knows but no pool here serves: the pool refused it mid-request and
    # the router answered INTERNAL "downstream INVALID_ARGUMENT"
    (GENERATE, pb.GenerateRequest(prompt="0", drafter="small-math", sampling=pb.SamplingParams(max_tokens=4)),
     "drafter"),
    (GENERATE, pb.GenerateRequest(prompt="0", drafter="pld+small-math", sampling=pb.SamplingParams(max_tokens=4)),
     "drafter"),
    # a denormal temperature: logits / temperature overflowed, every probability was NaN and
    # the verifier's first draw raised (UNKNOWN; the router, trying another verifier, UNAVAILABLE)
    (GENERATE, pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=9, temperature=1.4013e-45)),
     "temperature"),
    (next(r for r in rpcs("Verifier") if r.method == "Prefill"), pb.VerifierPrefillRequest(
        request_id="r0", token_ids=[1, 2], sampling=pb.SamplingParams(temperature=1e-45, max_tokens=2)),
     "temperature"),
    (next(r for r in rpcs("Drafter") if r.method == "Prefill"), pb.DrafterPrefillRequest(
        request_id="r0", drafter="layerskip", token_ids=[1, 2], sampling=pb.SamplingParams(temperature=1e-45)),
     "temperature"),
    # an infinite temperature (HTTP's 1e309 too, or a float32 overflow: 1e39) was taken, and
    # sampled uniform noise
    (GENERATE, pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=4, temperature=math.inf)),
     "temperature"),
    (GENERATE, pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=4, temperature=1e39)),
     "temperature"),
    (next(r for r in rpcs("Verifier") if r.method == "Prefill"), pb.VerifierPrefillRequest(
        request_id="r0", token_ids=[1, 2], sampling=pb.SamplingParams(temperature=math.inf, max_tokens=2)),
     "temperature"),
    (next(r for r in rpcs("Drafter") if r.method == "Prefill"), pb.DrafterPrefillRequest(
        request_id="r0", drafter="layerskip", token_ids=[1, 2], sampling=pb.SamplingParams(temperature=math.inf)),
     "temperature"),
]


@pytest.mark.parametrize("rpc,request_,field", FOUND, ids=[f"{r.name}-{f}" for r, _, f in FOUND])
def test_inputs_the_fuzz_found_are_refused_naming_the_field(target, rpc, request_, field):
    errors = len(target.server_errors.records)
    status, details, _ = call(target.channel(rpc.service), rpc, request_, 20.0, target.secret)
    assert (status, details.partition(":")[0]) == ("INVALID_ARGUMENT", field), details
    assert not target.server_errors.since(errors)
    assert not target.leaks()


def test_a_served_drafter_and_the_smallest_temperature_still_generate(target):
    for drafter in ("", "pld", "suffix+recycle", "none"):
        status, details, resp = call(target.channel("Specserve"), GENERATE, pb.GenerateRequest(
            prompt="hello", drafter=drafter, sampling=pb.SamplingParams(max_tokens=4, temperature=1e-4, seed=1)),
            20.0)
        assert status == "OK" and 1 <= len(resp.token_ids) <= 4, (drafter, details)  # 0 is the end token


def test_the_role_error_lists_every_role_and_developer_is_the_system_role(target):
    """Found: the role error listed "assistant, system, user", though HTTP took "developer"."""
    status, details, _ = call(target.channel("Specserve"), GENERATE, pb.GenerateRequest(
        messages=[pb.ChatMessage(role="robot", content="hi")], sampling=pb.SamplingParams(max_tokens=4)), 20.0)
    assert status == "INVALID_ARGUMENT" and "assistant, developer, system, tool, user" in details, details
    status, details, resp = call(target.channel("Specserve"), GENERATE, pb.GenerateRequest(
        messages=[pb.ChatMessage(role="developer", content="be brief"), pb.ChatMessage(role="user", content="hi")],
        sampling=pb.SamplingParams(max_tokens=4)), 20.0)
    assert status == "OK" and resp.token_ids, details


@pytest.mark.parametrize("service", ["Specserve", "Verifier", "Drafter"])
def test_a_string_that_is_not_utf8_on_the_wire_is_invalid_argument(target, service):
    """Found: a protobuf string cannot hold a lone surrogate (the Python library refuses to set
    one), but a client may send its bytes (ED A0 80): gRPC answered INTERNAL, "Exception
    deserializing request!"."""
    rpc = next(r for r in rpcs(service) if r.method in ("Generate", "Prefill"))
    message = message_class(rpc.request)(request_id="x\x01\x02\x03y")
    raw = message.SerializeToString().replace(b"\x01\x02\x03", b"\xed\xa0\x80")
    status, details, _ = call(target.channel(service), rpc, RawRequest(message, raw), 20.0, target.secret)
    assert status == "INVALID_ARGUMENT" and details.startswith("request:"), (status, details)
    assert not target.server_errors.since(0)
