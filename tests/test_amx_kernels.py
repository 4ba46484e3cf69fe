"""The 8-bit-activation products on AMX's tile multiply (runtime/q8_amx.cpp): bit for bit the
VNNI products and the numpy formula, and row-exact. Skipped where the CPU has no AMX-INT8."""

from __future__ import annotations

import pytest
import torch

from cluster.env import cpu_tuning_from_env
from runtime import cpu_kernels
from test_cpu_kernels import DEFAULT_SHAPES, gguf_like_int4, q8_input, q8_product_reference

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.available() and cpu_kernels.amx()),
    reason="needs an x86 CPU with AMX-INT8 (amx_int8 in /proc/cpuinfo), Linux's tile permission "
           "and a compiler with -mamx-int8")

ROWS = list(range(1, 18)) + [32]


@pytest.fixture
def amx_all_rows():
    """AMX for every pass, one row too (the default leaves short passes to VNNI); restored after."""
    cpu_kernels.use_amx(True, min_rows=1)
    yield
    cpu_kernels.use_amx(True)


def product(kind: str, out: int, k: int):
    """(run(x), reference(x)) of a random layer of this kind and shape."""
    gen = torch.Generator().manual_seed(out + k)
    if kind == "int4":
        q, d, m = gguf_like_int4(out, k, seed=out)
        packed = cpu_kernels.int4_pack(q, d, m)
        return (lambda x: cpu_kernels.int4_linear_q8(x, packed, out)), (lambda x: q8_product_reference(x, q, d, m))
    q = torch.randint(-128, 128, (out, k), generator=gen, dtype=torch.int8)  # -128 too
    scales = torch.rand(out, k // 32, generator=gen) if kind == "int8 block" else torch.rand(out, generator=gen)
    codes, packed_scales = cpu_kernels.int8_pack(q, scales * 0.02)
    return (lambda x: cpu_kernels.int8_linear_q8(x, codes, packed_scales, out),
            lambda x: q8_product_reference(x, q, scales=scales * 0.02))


def cases():
    """Every layer shape of the default model in each int kind it can take (the head int8 with
    Q8_0's block scales, as both modes load it), and 100 channels: a last odd 8-channel tile."""
    for out, k in DEFAULT_SHAPES + [(100, 576)]:
        for kind in (["int8 block"] if out == 49152 else ["int4", "int8 channel", "int8 block"]):
            yield pytest.param(kind, (out, k), id=f"{kind}-{out}x{k}")


@pytest.mark.parametrize("kind, shape", list(cases()))
def test_amx_products_are_the_vnni_ones_and_the_formula_bit_for_bit(amx_all_rows, kind, shape):
    out, k = shape
    run, reference = product(kind, out, k)
    x = q8_input(32, k, seed=k)
    want = reference(x)  # row by row: the first n rows' reference is this one's first n rows
    for rows in ROWS:
        cpu_kernels.use_amx(True, min_rows=1)
        amx = run(x[:rows])
        cpu_kernels.use_amx(False)
        vnni = run(x[:rows])
        assert torch.equal(amx, want[:rows]), rows
        assert torch.equal(vnni, want[:rows]), rows


def test_passes_of_more_than_64_rows_take_several_row_chunks(amx_all_rows):
    """Over 64 rows a pair of tiles goes over its blocks once per 64 rows (kChunkGroups)."""
    run, reference = product("int4", 100, 576)
    x = q8_input(70, 576, seed=9)
    assert torch.equal(run(x), reference(x))


@pytest.mark.parametrize("kind, shape", [c for c in cases() if c.values[1] != (100, 576)])
def test_an_amx_row_alone_and_among_2_to_17_rows_gets_the_same_bits(amx_all_rows, kind, shape):
    """The lossless contract on AMX: a row alone (a tile of one row) equals that row in any
    pass of 2-17 rows (tiles of up to 16 rows, 17 as 9 + 9 with a zero row). The rows'
    magnitudes differ by up to 10^6: activation scales shared across rows make this fail
    (checked by sharing them in q8_kernels.cpp's quantize_rows)."""
    out, k = shape
    run, _ = product(kind, out, k)
    x = q8_input(17, k, seed=3)
    alone = torch.cat([run(x[r:r + 1]) for r in range(17)])
    for rows in range(2, 18):
        for start in range(0, 17 - rows + 1, 5):
            assert torch.equal(run(x[start:start + rows]), alone[start:start + rows]), (rows, start)


def test_amx_turns_off_and_on():
    assert not cpu_kernels.use_amx(False)
    assert not cpu_kernels.amx()
    assert cpu_kernels.use_amx(True) and cpu_kernels.amx()


def test_specserve_amx_sets_the_tuning(monkeypatch):
    monkeypatch.delenv("SPECSERVE_PACKED_LINEAR", raising=False)
    monkeypatch.delenv("SPECSERVE_AMX", raising=False)
    assert cpu_tuning_from_env().amx
    monkeypatch.setenv("SPECSERVE_AMX", "0")
    assert not cpu_tuning_from_env().amx
    monkeypatch.setenv("SPECSERVE_AMX", "off")
    with pytest.raises(ValueError, match="SPECSERVE_AMX must be 0 or 1"):
        cpu_tuning_from_env()


def test_a_compiler_without_the_amx_flags_builds_without_them(monkeypatch, tmp_path, caplog):
    """gcc before 11 has no -mamx-int8: the library builds without AMX, a warning says so, and
    its products are VNNI's."""
    monkeypatch.setattr(cpu_kernels, "AMX_FLAGS", (cpu_kernels.AMX_FLAGS[0], ["-mamx-no-such-flag"]))
    with caplog.at_level("WARNING", logger="runtime.cpu_kernels"):
        lib = cpu_kernels._load(tmp_path, None)
    assert "build without -mamx-no-such-flag" in caplog.text
    assert not cpu_kernels.amx(lib) and cpu_kernels.vnni(lib)
    _, reference = product("int4", 100, 576)  # the same weights (seeded by the shape) packed again
    packed = cpu_kernels.int4_pack(*gguf_like_int4(100, 576, seed=100))
    x = q8_input(17, 576)
    assert torch.equal(cpu_kernels.int4_linear_q8(x, packed, 100, lib), reference(x))
