"""specserve's own int4/int8 CPU products (speculative/cpu_kernels.py): right, row-exact,
and replaced by torch's kernels, with a warning, where they cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from speculative import cpu_kernels
from speculative.cpu_tuning import PACKED_CHUNK_ROWS
from speculative.quantize import Int4Linear, Int8Linear

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs an x86 CPU with AVX2 and a C++ compiler")


@pytest.fixture(autouse=True)
def native(monkeypatch):
    """The layers here take the native products on any AVX2 CPU, AVX-512 ones included."""
    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "native")


def gguf_like_int4(out: int, k: int, seed: int = 0):
    """q, d, m as a Q4_1 GGUF holds them: d and m float16 values (so d * q is exact)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, k), generator=gen, dtype=torch.int32)
    d = (torch.rand(out, k // 32, generator=gen) * 0.01).half().float()
    m = (-8 * d + torch.randn(out, k // 32, generator=gen) * 1e-3).half().float()
    return q, d, m


def weights_of(q, d, m):
    out, k = q.shape
    return (q.float().reshape(out, k // 32, 32) * d[..., None] + m[..., None]).reshape(out, k)


@pytest.mark.parametrize("shape", [(96, 64), (100, 576), (576, 1536)])
def test_int4_product_is_the_blocks_weights_times_the_input(shape):
    out, k = shape
    q, d, m = gguf_like_int4(out, k)
    blocks = cpu_kernels.to_blocks(q, d, m)
    assert torch.equal(cpu_kernels.int4_dequantize(blocks), weights_of(q, d, m))
    x = torch.randn(9, k)
    expected = (x.double() @ weights_of(q, d, m).double().t())
    got = cpu_kernels.int4_linear(x, blocks)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_int8_product_scales_each_channel():
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (52, 96), generator=gen, dtype=torch.int8)
    scales = torch.rand(52, generator=gen) * 0.02
    x = torch.randn(7, 96)
    expected = x.double() @ (q.double() * scales.double()[:, None]).t()
    assert torch.allclose(cpu_kernels.int8_linear(x, q, scales).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_row_gets_the_same_bits_in_every_tiling(kind):
    """Rows are decoded against a channel's weights up to five at a time; a row's sum must not
    depend on how many share its tile, nor where it sits in it."""
    q, d, m = gguf_like_int4(40, 576, seed=2)
    layer = Int4Linear(q, d, m, torch.float32) if kind == "int4" else \
        Int8Linear(torch.randint(-127, 128, (40, 576), dtype=torch.int8), torch.rand(40) * 0.01)
    assert layer.native
    x = torch.randn(23, 576)
    with torch.inference_mode():
        together = layer(x)
        for start in range(0, 12):
            for rows in range(1, 12):
                assert torch.equal(layer(x[start:start + rows]), together[start:start + rows]), (start, rows)


def test_long_passes_multiply_the_dequantised_weights_by_blas():
    """Past PACKED_CHUNK_ROWS rows (a long prefill) the layer multiplies float32 weights by
    BLAS: the same weights, so the same values up to float32 rounding."""
    q, d, m = gguf_like_int4(64, 576, seed=3)
    layer = Int4Linear(q, d, m, torch.float32)
    x = torch.randn(PACKED_CHUNK_ROWS + 5, 576)
    with torch.inference_mode():
        long = layer(x)
        short = torch.cat([layer(part) for part in x.split(PACKED_CHUNK_ROWS)])
    assert torch.allclose(long, short, rtol=1e-5, atol=1e-5)
    assert torch.allclose(long, torch.nn.functional.linear(x, weights_of(q, d, m)), rtol=1e-6, atol=1e-6)


@pytest.fixture
def fresh_kernels(monkeypatch, tmp_path):
    """The kernels loaded anew on first use, built in an empty cache."""
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_library", None)
    monkeypatch.setattr("speculative.loading.cache_root", lambda cache_dir=None: tmp_path)
    return monkeypatch


def test_torch_kernels_where_asked(fresh_kernels):
    fresh_kernels.setenv("SPECSERVE_CPU_KERNELS", "torch")
    q, d, m = gguf_like_int4(16, 64)  # torch's packer takes 16 channels at a time
    layer = Int4Linear(q, d, m, torch.bfloat16)
    assert not layer.native and layer.scales_and_zeros.dtype == torch.bfloat16


def test_a_missing_compiler_falls_back_to_torch_with_a_warning(fresh_kernels, caplog):
    fresh_kernels.setenv("SPECSERVE_CPU_KERNELS", "auto")
    fresh_kernels.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    fresh_kernels.setenv("CXX", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="speculative.cpu_kernels"):
        assert not cpu_kernels.available()
    assert "unavailable" in caplog.text and "torch's" in caplog.text
    q, d, m = gguf_like_int4(16, 64)  # torch's packer takes 16 channels at a time
    assert not Int4Linear(q, d, m, torch.bfloat16).native


def test_native_kernels_asked_for_but_unbuildable_is_an_error(fresh_kernels):
    fresh_kernels.setenv("CXX", "/bin/false")
    fresh_kernels.setenv("SPECSERVE_CPU_KERNELS", "native")
    with pytest.raises(RuntimeError, match="SPECSERVE_CPU_KERNELS=native"):
        cpu_kernels.available()


def test_an_unknown_choice_names_the_variable(fresh_kernels):
    fresh_kernels.setenv("SPECSERVE_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match="SPECSERVE_CPU_KERNELS"):
        cpu_kernels.available()
