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
