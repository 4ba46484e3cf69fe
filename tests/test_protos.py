"""The generated gRPC code is what the .proto files give today."""

from __future__ import annotations

from protos.build import PROTO_DIR, generate


def test_generated_code_is_up_to_date(tmp_path):
    fresh = generate(tmp_path)
    assert fresh, "no generated files"
    stale = [p.name for p in fresh if p.read_bytes() != (PROTO_DIR / p.name).read_bytes()]
    missing = [p.name for p in fresh if not (PROTO_DIR / p.name).exists()]
    assert not missing and not stale, (
        f"generated code is out of date with the .proto ({missing or stale}); run: python -m protos.build")


def test_unset_optional_fields_take_their_defaults_and_zero_is_a_value():
    """Fields whose absence means "the default" are `optional` on the wire: unset reads as the
    default, and an explicit 0 is kept (so it can be refused, not silently replaced)."""
    from protos import specserve_pb2 as pb
    from protos.convert import params_from_pb, params_to_pb
    from speculative.sampling import SamplingParams

    unset = params_from_pb(pb.SamplingParams(temperature=0.5), default_max_tokens=77)
    assert (unset.max_tokens, unset.top_p, unset.seed) == (77, 1.0, None)
    zero = params_from_pb(pb.SamplingParams(max_tokens=0, top_p=0.0))
    assert (zero.max_tokens, zero.top_p) == (0, 0.0)
    params = SamplingParams(max_tokens=9, temperature=0.5, top_p=0.75, top_k=5, seed=0)  # exact in float32
    assert params_from_pb(params_to_pb(params)) == params
    for message, field in [(pb.DrafterPrefillRequest(), "stream"), (pb.ProposeRequest(), "max_nodes"),
                           (pb.VerifierPrefillRequest(), "max_len")]:
        assert not message.HasField(field)
        setattr(message, field, 0)
        assert message.HasField(field)
        # wire-compatible: an unset field is absent from the bytes, as proto3's zero was
        message.ClearField(field)
        assert message.SerializeToString() == b""
