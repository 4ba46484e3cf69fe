"""specserve's own int4/int8 and float32 CPU products (runtime/cpu_kernels.py): right,
row-exact, and replaced by torch's kernels, with a warning, where they cannot be built."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace

import numpy as np
import pytest
import torch

from runtime import cpu_kernels, cpu_tuning
from runtime.cpu_tuning import LONG_ROWS_TIMED, PACKED_CHUNK_ROWS, CpuTuning, NativeLinear, NativeRMSNorm, \
    PackedLinear, apply_cpu_tuning
from runtime.model import FUSED_ATTENTION_MAX_TOKENS, Transformer, attention_mask, causal_ancestors
from runtime.quantize import Int4Linear, Int8Linear, quantize
from tiny import TINY, tiny_model

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs an x86 CPU with AVX2 and a C++ compiler")


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


@pytest.mark.parametrize("kind", ["int4", "int8", "int4/float32", "int8/float32", "float32"])
def test_a_row_gets_the_same_bits_in_every_tiling(kind):
    """int rows on 8-bit activations take a tile's blocks up to four at a time; on float32
    activations they are decoded against a channel's weights up to five at a time (eight in the
    AVX-512 build); float32 rows go through 4 channels' weights up to four at a time (two with
    AVX2): a row's sum must not depend on how many share its tile, nor where it sits in it."""
    q, d, m = gguf_like_int4(40, 576, seed=2)
    mode, _, activations = kind.partition("/")
    activations = activations or "int8"
    if mode == "int4":
        layer = Int4Linear(q, d, m, torch.float32, native=True, activations=activations)
    elif mode == "int8":
        layer = Int8Linear(torch.randint(-127, 128, (40, 576), dtype=torch.int8), torch.rand(40) * 0.01, native=True,
                           activations=activations)
    else:
        layer = NativeLinear(torch.nn.Linear(576, 40))
    assert getattr(layer, "native", True) and getattr(layer, "activations", activations) == activations
    x = torch.randn(23, 576)
    with torch.inference_mode():
        together = layer(x)
        for start in range(0, 12):
            for rows in range(1, 12):
                assert torch.equal(layer(x[start:start + rows]), together[start:start + rows]), (start, rows)
        assert torch.equal(layer(x[None]), together[None])  # a batch's rows as one pass


@pytest.mark.parametrize("kind", ["int4", "int8", "int4/float32", "int8/float32", "float32"])
def test_a_pass_of_no_rows_gives_no_rows(kind):
    """An empty pass (a batch whose rows hold no tokens) returns an empty result, not a crash."""
    q, d, m = gguf_like_int4(8, 64)
    activations = kind.partition("/")[2] or "int8"
    layer = {"int4": lambda: Int4Linear(q, d, m, torch.float32, native=True, activations=activations),
             "int8": lambda: Int8Linear(torch.ones(8, 64, dtype=torch.int8), torch.ones(8), native=True,
                                        activations=activations),
             "float32": lambda: NativeLinear(torch.nn.Linear(64, 8))}[kind.partition("/")[0]]()
    with torch.inference_mode():
        assert layer(torch.empty(1, 0, 64)).shape == (1, 0, 8)


# -- the products on 8-bit activations (q8_kernels.cpp): what they compute, exactly --------------

def q8_reference(x: torch.Tensor):
    """The activations' quantisation, in numpy: per block of 32, d = max|x| / 127, codes
    rint(x / d) (half to even; 0 for a block of zeros), d * sum(codes), sum(codes)."""
    rows, k = x.shape
    blocks = x.numpy().astype(np.float32).reshape(rows, k // 32, 32)
    d = np.abs(blocks).max(-1) / np.float32(127)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.clip(blocks / d[..., None], np.float32(-127), np.float32(127))
    codes = np.where(d[..., None] != 0, np.rint(ratio), 0).astype(np.int32)
    total = codes.sum(-1).astype(np.int32)
    return codes, d, (d * total.astype(np.float32)).astype(np.float32), total


def q8_product_reference(x: torch.Tensor, q: torch.Tensor, d=None, m=None, scales=None) -> torch.Tensor:
    """y = x @ W.T as q8_kernels.cpp defines it: each block's integer dot product of the weight
    codes and the activation codes (exact), then in float32, block by block, each operation
    rounded on its own: int4 (d, m) acc = (acc + dot * (d * xd)) + m * xs; int8 by a block's
    scale acc = acc + dot * (scale * xd); by a channel's acc = acc + dot * xd, then acc * scale."""
    codes, xd, xs, _ = q8_reference(x)
    rows, groups = xd.shape
    out = q.shape[0]
    dots = torch.einsum("rgi,ngi->rng", torch.from_numpy(codes).double().reshape(rows, groups, 32),
                        q.double().reshape(out, groups, 32)).numpy().astype(np.float32)  # integers, exact
    acc = np.zeros((rows, out), np.float32)
    for g in range(groups):
        x_scale = xd[:, g, None]
        if d is not None:
            acc = (acc + dots[..., g] * (d.numpy()[None, :, g] * x_scale)) + m.numpy()[None, :, g] * xs[:, g, None]
        elif scales.dim() == 2:
            acc = acc + dots[..., g] * (scales.numpy()[None, :, g] * x_scale)
        else:
            acc = acc + dots[..., g] * x_scale
    if d is None and scales.dim() == 1:
        acc = acc * scales.numpy()[None, :]
    return torch.from_numpy(acc)


def q8_input(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of magnitudes 10^-3 to 10^3, a block of zeros, and a block whose codes fall on
    halves (max 127: d = 1, x / d = 2.5, -0.5, ... round to even)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * (10.0 ** (torch.arange(rows) % 7 - 3))[:, None]
    x[0, :32] = 0
    if k >= 64:
        x[-1, 32:64] = torch.tensor([127.0, 2.5, -0.5, 1.5, -3.5, 0.5] + [4.0] * 26)
    return x


@pytest.fixture(scope="module")
def q8_libraries():
    """The library as built here, and builds that run the other CPUs' paths on this one: the
    VNNI path's arithmetic (the offset int8 codes and the sums it subtracts) and the AVX-512
    build's two tiles a vector (two AVX2 halves), each emulated with AVX2, and both together."""
    libs = {"built": cpu_kernels.library()}
    emulated = {"vnni": ["-DSPECSERVE_EMULATE_VNNI"], "avx512": ["-DSPECSERVE_EMULATE_AVX512"],
                "avx512 vnni": ["-DSPECSERVE_EMULATE_AVX512", "-DSPECSERVE_EMULATE_VNNI"]}
    for name, defines in emulated.items():
        libs[f"{name}, emulated"] = cpu_kernels.variant(defines)
    assert cpu_kernels.vnni(libs["vnni, emulated"]) and not cpu_kernels.vnni(libs["avx512, emulated"])
    return libs


def test_q8_activations_are_the_reference():
    x = q8_input(7, 96)
    got = cpu_kernels.q8_quantize(x)
    for ours, want in zip(got, q8_reference(x)):
        assert np.array_equal(ours.numpy(), want.reshape(ours.shape).astype(ours.numpy().dtype))
    assert got[0][-1, 32:38].tolist() == [127, 2, 0, 2, -4, 0]  # halves to even
    assert got[1][0, 0] == 0 and not got[0][0, :32].any()


def test_q8_activations_drop_nans_from_the_scale_and_give_them_the_low_end():
    """The vectorised quantisation keeps the scalar one's answer off the numbers too: max|x|
    ignores a NaN (fmaxf), a NaN's code is -127, and an infinite block's scale is infinite."""
    x = torch.zeros(1, 64)
    x[0, :4] = torch.tensor([float("nan"), 127.0, -2.5, 3.5])
    x[0, 32:34] = torch.tensor([float("inf"), 1.0])
    q, d, s, total = cpu_kernels.q8_quantize(x)
    assert q[0, :5].tolist() == [-127, 127, -2, 4, 0] and d[0, 0] == 1 and total[0, 0] == 2 and s[0, 0] == 2
    assert q[0, 32:35].tolist() == [-127, 0, 0] and d[0, 1] == float("inf") and s[0, 1] == float("-inf")


@pytest.mark.parametrize("shape", [(8, 32), (100, 576), (52, 1536), (13, 96), (104, 64)])
@pytest.mark.parametrize("kind", ["int4", "int8 channel", "int8 block"])
def test_q8_products_are_the_integer_reference_exactly(q8_libraries, kind, shape):
    """Bit for bit, in every build: each output is one lane's fixed sequence of float32
    operations on exact integer dot products, whatever the SIMD width or dot instruction.
    Output counts that leave a tile part full (100, 52, 13) included."""
    out, k = shape
    x = q8_input(11, k, seed=out)
    gen = torch.Generator().manual_seed(k)
    if kind == "int4":
        q, d, m = gguf_like_int4(out, k, seed=out)
        want = q8_product_reference(x, q, d, m)
        packed = cpu_kernels.int4_pack(q, d, m)
        run = lambda lib: cpu_kernels.int4_linear_q8(x, packed, out, lib)
    else:
        q = torch.randint(-128, 128, (out, k), generator=gen, dtype=torch.int8)  # -128 too
        scales = (torch.rand(out, k // 32, generator=gen) if kind == "int8 block" else torch.rand(out, generator=gen))
        want = q8_product_reference(x, q, scales=scales * 0.02)
        codes, packed_scales = cpu_kernels.int8_pack(q, scales * 0.02)
        run = lambda lib: cpu_kernels.int8_linear_q8(x, codes, packed_scales, out, lib)
    for name, lib in q8_libraries.items():
        assert torch.equal(run(lib), want), name


def test_q8_packing_keeps_the_weights():
    q, d, m = gguf_like_int4(100, 576, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(cpu_kernels.int4_unpack(cpu_kernels.int4_pack(q, d, m), 100),
                                                 (q, d, m)))
    layer = Int4Linear(q, d, m, torch.float32, native=True)
    assert layer.activations == "int8" and torch.equal(layer.dequantized(), weights_of(q, d, m))
    q8 = torch.randint(-128, 128, (52, 96), dtype=torch.int8)
    for scales in (torch.rand(52), torch.rand(52, 3)):
        unpacked = cpu_kernels.int8_unpack(*cpu_kernels.int8_pack(q8, scales), 52)
        assert torch.equal(unpacked[0], q8) and torch.equal(unpacked[1], scales)
        layer = Int8Linear(q8, scales, native=True)
        want = q8.float() * scales[:, None] if scales.dim() == 1 else \
            (q8.float().reshape(52, 3, 32) * scales[..., None]).reshape(52, 96)
        assert torch.equal(layer.quantized_weights()[0], q8) and torch.equal(layer.dequantized(), want)


# the default model's linear layers (out, in): q/k/v, o, gate/up, down, and the head
DEFAULT_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


@pytest.mark.parametrize("shape", DEFAULT_SHAPES)
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_a_q8_row_alone_and_among_2_to_17_rows_gets_the_same_bits(mode, shape):
    """The lossless contract on 8-bit activations: each row is quantised with its own scales, so
    a row's result alone equals its result beside others, bit for bit, for every layer shape of
    the default model (the head, int8 in both modes, with a scale per block as the GGUF's
    Q8_0). The rows' magnitudes differ by up to 10^6: scales shared across a pass's rows would
    change the small rows' codes, and this fails (checked by sharing them in q8_kernels.cpp)."""
    out, k = shape
    head = out == 49152
    if mode == "int4" and head:
        pytest.skip("the head is int8 in both modes")
    if mode == "int4":
        layer = Int4Linear(*gguf_like_int4(out, k, seed=1), torch.float32, native=True)
    else:
        gen = torch.Generator().manual_seed(2)
        scales = torch.rand(out, k // 32, generator=gen) * 0.01 if head else torch.rand(out, generator=gen) * 0.01
        layer = Int8Linear(torch.randint(-127, 128, (out, k), generator=gen, dtype=torch.int8), scales, native=True)
    assert layer.activations == "int8"
    x = q8_input(17, k, seed=3)
    with torch.inference_mode():
        alone = torch.cat([layer(x[r:r + 1]) for r in range(17)])
        for rows in (2, 6, 17):
            for start in range(0, 17 - rows + 1, 3 if rows < 17 else 1):
                assert torch.equal(layer(x[start:start + rows]), alone[start:start + rows]), (rows, start)
        assert torch.equal(layer(x[None, :6]), alone[None, :6])


def test_q8_products_are_near_the_float_ones():
    """8 bits per block of 32 cost a small relative error against float32 activations."""
    q, d, m = gguf_like_int4(576, 1536, seed=7)
    x = torch.randn(6, 1536)
    want = x.double() @ weights_of(q, d, m).double().t()
    with torch.inference_mode():
        got = Int4Linear(q, d, m, torch.float32, native=True)(x).double()
        old = Int4Linear(q, d, m, torch.float32, native=True, activations="float32")(x).double()
    assert (got - want).norm() / want.norm() < 1e-2
    assert (old - want).norm() / want.norm() < 1e-6


@pytest.mark.parametrize("shape", [(4, 32), (100, 576), (576, 1536)])
def test_float32_product_is_the_weights_times_the_input(shape):
    out, k = shape
    torch.manual_seed(0)
    w = torch.randn(out, k)
    x = torch.randn(9, k)
    got = cpu_kernels.float32_linear(x, cpu_kernels.float32_pack(w))
    assert torch.allclose(got.double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-4)


def test_float32_models_take_our_products_where_asked_and_score_like_the_plain_model(monkeypatch):
    """apply_cpu_tuning with our kernels packs every float32 layer for them and puts the norms on
    them: only long passes are timed (BLAS against ours), short passes run as they are (no
    padding), and the logits are the plain model's up to float32 rounding; with torch's
    kernels, oneDNN's packed layers and torch's norms."""
    asked = []

    def measured(layers, rows, packed_rows, repeats=5):
        asked.append((rows, {type(m) for m in layers}))
        return False

    monkeypatch.setattr(cpu_tuning, "_blas_wins", measured)
    plain = tiny_model(0)
    tuned = copy.deepcopy(plain)
    assert apply_cpu_tuning(tuned, CpuTuning(kernels="native"))
    layers = [m for m in tuned.modules() if isinstance(m, (NativeLinear, PackedLinear))]
    assert len(layers) == 4 * len(tuned.layers) + 1 and all(isinstance(m, NativeLinear) for m in layers)
    assert asked == [(LONG_ROWS_TIMED, {NativeLinear})]
    assert tuned.pad_short_rows is False
    assert isinstance(tuned.norm, NativeRMSNorm) and isinstance(tuned.layers[0].mlp_norm, NativeRMSNorm)
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.inference_mode():
        want, got = (model(tokens, torch.arange(6)[None], model.new_cache(6), attention_mask(0, causal_ancestors(6)))
                     for model in (plain, tuned))
    assert torch.allclose(got, want, atol=1e-4)
    other = copy.deepcopy(plain)
    apply_cpu_tuning(other, CpuTuning(kernels="torch"))
    assert all(isinstance(m, PackedLinear) for m in (other.lm_head, other.layers[0].mlp.down))
    assert not any(isinstance(m, NativeRMSNorm) for m in other.modules())


def test_float32_layers_our_products_cannot_take_stay_oneDNNs():
    """Our float32 product takes whole tiles of 4 output channels and inputs in steps of 32."""
    assert cpu_tuning._prepacked(torch.nn.Linear(64, 8), native=True).__class__ is NativeLinear
    assert cpu_tuning._prepacked(torch.nn.Linear(64, 6), native=True).__class__ is PackedLinear
    assert cpu_tuning._prepacked(torch.nn.Linear(48, 8), native=True).__class__ is PackedLinear
    assert cpu_tuning._prepacked(torch.nn.Linear(64, 8), native=False).__class__ is PackedLinear


@pytest.mark.parametrize("long_rows_blas", [True, False])
def test_long_float32_passes_take_the_path_chosen(long_rows_blas, monkeypatch):
    layer = NativeLinear(torch.nn.Linear(64, 8))
    layer.long_rows_blas = long_rows_blas
    rows_seen = []
    blas = torch.nn.functional.linear
    monkeypatch.setattr(cpu_tuning.F, "linear", lambda x, *a: rows_seen.append(x.numel() // x.shape[-1]) or blas(x, *a))
    with torch.inference_mode():
        for n in (PACKED_CHUNK_ROWS, PACKED_CHUNK_ROWS + 1):
            x = torch.randn(1, n, 64)
            assert torch.allclose(layer(x), blas(x, layer.weight, layer.bias), atol=1e-5)
    assert rows_seen == ([PACKED_CHUNK_ROWS + 1] if long_rows_blas else [])


@pytest.mark.parametrize("activations", ["int8", "float32"])
def test_long_passes_multiply_the_dequantised_weights_by_blas(activations):
    """Past PACKED_CHUNK_ROWS rows (a long prefill) the layer multiplies float32 weights by
    BLAS: the same weights, so on float32 activations the same values up to float32 rounding
    (on 8-bit ones, up to their quantisation)."""
    q, d, m = gguf_like_int4(64, 576, seed=3)
    layer = Int4Linear(q, d, m, torch.float32, native=True, activations=activations)
    x = torch.randn(PACKED_CHUNK_ROWS + 5, 576)
    with torch.inference_mode():
        long = layer(x)
        short = torch.cat([layer(part) for part in x.split(PACKED_CHUNK_ROWS)])
    tolerance = 1e-5 if activations == "float32" else 3e-2
    assert torch.allclose(long, short, rtol=tolerance, atol=tolerance)
    assert torch.allclose(long, torch.nn.functional.linear(x, weights_of(q, d, m)), rtol=1e-6, atol=1e-6)
    layer.long_rows_blas = False  # SPECSERVE_LONG_ROWS_LINEAR=packed: row-exact at any length
    with torch.inference_mode():
        assert torch.equal(layer(x)[-5:], layer(x[-5:]))
    model = quantize(tiny_model(0), "int4", tuning=CpuTuning(kernels="native", long_rows="packed"))
    assert not any(m.long_rows_blas for m in model.modules() if isinstance(m, Int4Linear))


def test_torch_kernels_where_asked():
    """`quantize` with `CpuTuning(kernels="torch")`, what SPECSERVE_CPU_KERNELS=torch asks for
    (cluster.env), and "native"."""
    assert not cpu_kernels.preferred("torch")
    model = quantize(tiny_model(0), "int4", tuning=CpuTuning(kernels="torch"))
    layers = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert layers and not any(m.native for m in layers)
    assert model.layers[0].attn.qkv.scales_and_zeros.dtype == torch.bfloat16
    native = quantize(tiny_model(0), "int4", tuning=CpuTuning(kernels="native"))
    assert all(m.native for m in native.modules() if isinstance(m, (Int4Linear, Int8Linear)))


def test_auto_takes_ours_wherever_they_build():
    assert cpu_kernels.preferred("auto") and cpu_kernels.preferred("native")
    assert not cpu_kernels.preferred("torch")


@pytest.fixture
def unbuildable(monkeypatch):
    """The kernels loaded anew on first use; the compiler to give them, one that fails."""
    monkeypatch.setattr(cpu_kernels, "_library", None)
    monkeypatch.setattr(cpu_kernels, "_error", None)
    return "/bin/false"


def test_without_a_compiler_auto_falls_back_to_torch_with_a_warning(unbuildable, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="runtime.cpu_kernels"):
        assert not cpu_kernels.preferred("auto", tmp_path, compiler=unbuildable)
    assert "unavailable" in caplog.text and "/bin/false failed" in caplog.text
    model = quantize(tiny_model(0), "int4")
    assert not any(m.native for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear)))


def test_native_kernels_asked_for_but_unbuildable_is_an_error(unbuildable, tmp_path):
    with pytest.raises(RuntimeError, match="asked for .native., but they cannot load"):
        cpu_kernels.preferred("native", tmp_path, compiler=unbuildable)


def test_an_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="auto, native, torch, got 'fast'"):
        cpu_kernels.preferred("fast")


def test_rms_norm_is_torchs_up_to_rounding_and_row_exact():
    norm = torch.nn.Module()
    norm.weight, norm.eps = torch.nn.Parameter(torch.rand(576) + 0.5), 1e-5
    native = NativeRMSNorm(norm)
    x = torch.randn(2, 20, 576) * 3
    with torch.inference_mode():
        together = native(x)
        assert torch.allclose(together, torch.nn.functional.rms_norm(x, (576,), norm.weight, 1e-5), rtol=1e-5, atol=1e-6)
        assert torch.equal(native(x[1:, 3:4]), together[1:, 3:4])


def sdpa_attention(qkv, cos, sin, k_cache, v_cache, start, mask, n_heads):
    """Attention.forward's own path for one sequence: RoPE in float32, the float32 caches written,
    SDPA in float64 over them widened."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    n_kv = k_cache.shape[0]
    heads = qkv.view(1, t, -1, d).transpose(1, 2)
    qk = heads[:, :n_heads + n_kv]
    qk = qk * cos + torch.roll(qk, d // 2, -1) * sin
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache[:, start:start + t] = qk[0, n_heads:]
    v_cache[:, start:start + t] = heads[0, n_heads + n_kv:]
    span = mask.shape[-1]
    out = torch.nn.functional.scaled_dot_product_attention(
        qk[:, :n_heads].double(), k_cache[None, :, :span].double(), v_cache[None, :, :span].double(), attn_mask=mask,
        enable_gqa=True)
    return out.float().transpose(1, 2).reshape(t, -1), k_cache, v_cache


def attention_case(t, start, n_heads=9, n_kv=3, d=64, seed=4):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (n_heads + 2 * n_kv) * d, generator=gen)
    angles = torch.rand(t, d // 2, generator=gen) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((-angles, angles), -1).sin()
    k_cache = torch.zeros(n_kv, 64, d)  # float32: float64 attention reads float32 caches
    v_cache = torch.zeros_like(k_cache)
    k_cache[:, :start] = torch.randn(n_kv, start, d, generator=gen)
    v_cache[:, :start] = torch.randn(n_kv, start, d, generator=gen)
    return qkv, cos, sin, k_cache, v_cache


def additive(allowed):
    return torch.zeros(allowed.shape, dtype=torch.float64).masked_fill_(~allowed, float("-inf"))


@pytest.mark.parametrize("d", [8, 12, 28, 64])  # 12, 28: part vectors of doubles with AVX-512
def test_fused_attention_is_sdpas_and_writes_the_same_cache(d):
    """cpu_kernels.attend against Attention.forward's SDPA path, on a tree's mask, bit for bit:
    the cache entries (the same float32 RoPE) and the outputs, which differ in float64's low
    bits only and round to the same float32. So a sequence attends alike alone (fused) and in
    a batch of several (SDPA)."""
    t, start = 6, 20
    qkv, cos, sin, k_cache, v_cache = attention_case(t, start, d=d)
    tree = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]], dtype=torch.bool)
    mask = additive(torch.cat((torch.ones(t, start, dtype=torch.bool), tree), 1))
    expected, k_expected, v_expected = sdpa_attention(qkv, cos, sin, k_cache, v_cache, start, mask, 9)
    got = cpu_kernels.attend(qkv, cos, sin, k_cache, v_cache, start, mask, 9)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    assert torch.equal(got, expected)


def test_fused_attention_gives_a_token_what_it_gets_alone():
    """The lossless contract's need: a query verified beside others (a tree, unseen slots
    masked) gets the bits it gets when its path is decoded one token at a time."""
    t, start = 5, 30
    qkv, cos, sin, k_cache, v_cache = attention_case(t, start)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 0, 1, 1, 1]],
                        dtype=torch.bool)
    together = cpu_kernels.attend(qkv, cos, sin, k_cache.clone(), v_cache.clone(), start,
                                  additive(torch.cat((torch.ones(t, start, dtype=torch.bool), tree), 1)), 9)
    path = [0, 2, 3, 4]  # a branch, decoded alone token by token
    for step, node in enumerate(path):
        alone = cpu_kernels.attend(qkv[node:node + 1], cos[node:node + 1], sin[node:node + 1], k_cache, v_cache,
                                   start + step, additive(torch.ones(1, start + step + 1, dtype=torch.bool)), 9)
        assert torch.equal(alone[0], together[node]), node


def rows_attention_case(dtype, spans=(5, 37, 0, 20), t=4, n_heads=6, n_kv=2, d=16, seed=5):
    """q [b, n_heads, t, d] in `dtype`, float32 caches [b, n_kv, 64, d] (in either dtype) and the
    additive mask [b, 1, t, span] of a pass of rows after `spans` cached slots each: row 0 a
    tree, row 1 a chain, the others one token and padding (which sees itself only), as
    verify_batch lays a pass out."""
    gen = torch.Generator().manual_seed(seed)
    b, span = len(spans), max(spans) + t
    q = torch.randn(b, n_heads, t, d, generator=gen, dtype=dtype)
    k_cache, v_cache = (torch.randn(b, n_kv, 64, d, generator=gen) for _ in range(2))
    allowed = torch.zeros(b, t, span, dtype=torch.bool)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    for r, start in enumerate(spans):
        allowed[r, :, :start] = True
        own = tree if r == 0 else causal_ancestors(t) if r == 1 else torch.eye(t, dtype=torch.bool)
        allowed[r, :, start:start + t] = own
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf")).unsqueeze(1)
    return q, k_cache, v_cache, mask, [start + t for start in spans]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_attention_is_sdpas(dtype):
    """cpu_kernels.attend_rows against SDPA over the batch's span, rows of different lengths,
    a tree, a chain and padding: each row sees its own slots only."""
    q, k_cache, v_cache, mask, limits = rows_attention_case(dtype)
    span = mask.shape[-1]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k_cache[:, :, :span].to(dtype), v_cache[:, :, :span].to(dtype), attn_mask=mask, enable_gqa=True)
    want = want.float().transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
    got = cpu_kernels.attend_rows(q, k_cache, v_cache, mask, limits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_attention_gives_each_row_what_it_gets_alone(dtype):
    """The lossless contract's need: a row's queries get the same bits in a batch as alone, over
    a span cut to its own slots, whatever the rows beside it; in float64 they are the bits the
    fused one-sequence attention (`attend`) gives, so an int model's token attends alike alone
    and in the verifier's batches."""
    q, k_cache, v_cache, mask, limits = rows_attention_case(dtype)
    together = cpu_kernels.attend_rows(q, k_cache, v_cache, mask, limits)
    for r, limit in enumerate(limits):
        alone = cpu_kernels.attend_rows(q[r:r + 1], k_cache[r:r + 1], v_cache[r:r + 1], mask[r:r + 1, ..., :limit],
                                        [limit])
        assert torch.equal(alone[0], together[r]), r
    if dtype == torch.float64:  # attend's layout: one sequence, RoPE'd queries from qkv (here: cos 1, sin 0)
        t, d, n_heads, n_kv = q.shape[2], q.shape[3], q.shape[1], k_cache.shape[1]
        r, start = 1, limits[1] - q.shape[2]
        qkv = torch.cat((q[r].float().transpose(0, 1).reshape(t, -1),
                         k_cache[r, :, start:start + t].transpose(0, 1).reshape(t, -1),
                         v_cache[r, :, start:start + t].transpose(0, 1).reshape(t, -1)), -1)
        keys, values = k_cache[r].clone(), v_cache[r].clone()
        q_rounded = q[r:r + 1].float().double()
        rows = cpu_kernels.attend_rows(q_rounded, keys[None], values[None], mask[r:r + 1, ..., :limits[r]],
                                       [limits[r]])
        fused = cpu_kernels.attend(qkv, torch.ones(t, d), torch.zeros(t, d), keys.clone(), values.clone(), start,
                                   mask[r, 0, :, :limits[r]].contiguous(), n_heads)
        assert n_kv == keys.shape[0] and torch.equal(fused, rows[0])


def test_a_tuned_float32_models_rows_score_in_a_batch_as_alone():
    """With our kernels a float32 model's batched rows (one padded) get exactly the logits they
    get alone: the products, the norms and the attention each take a row by itself."""
    model = Transformer(replace(TINY, head_dim=16)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    assert apply_cpu_tuning(model, CpuTuning(kernels="native"))
    assert all(layer.attn.rows_attention is cpu_kernels.attend_rows for layer in model.layers)
    rows, real = [[1, 2, 3, 4], [5, 6, 0, 0]], [4, 2]
    mask = torch.zeros(2, 4, 4, dtype=torch.bool)
    mask[0] = causal_ancestors(4)
    mask[1, :2, :2] = causal_ancestors(2)
    mask[1, 2:, 2:] = torch.eye(2, dtype=torch.bool)  # padding attends to itself only
    with torch.inference_mode():
        both = model(torch.tensor(rows), torch.arange(4).expand(2, 4), model.new_cache(8, batch=2), mask, real=real)
        alone = [model(torch.tensor([r[:n]]), torch.arange(n)[None], model.new_cache(8),
                       attention_mask(0, causal_ancestors(n)))[0] for r, n in zip(rows, real)]
    assert torch.equal(both, torch.cat(alone))


def test_int_models_attend_fused_only_where_it_applies():
    model = quantize(tiny_model(0), "int4", tuning=CpuTuning(kernels="native"))
    assert all(layer.attn.fused_attention is cpu_kernels.attend and layer.attn.rows_attention is cpu_kernels.attend_rows
               for layer in model.layers)
    assert all(layer.attn.fused_attention is None and layer.attn.rows_attention is None
               for layer in quantize(tiny_model(0), "int4", tuning=CpuTuning(kernels="torch")).layers)


def test_int_models_keep_float32_caches_that_attend_as_float64_ones():
    """Where specserve's kernels attend, an int model's caches are float32 (its keys and values
    are float32 values): half the bytes a token's attention reads. The passes that attend by
    SDPA (passes of more than FUSED_ATTENTION_MAX_TOKENS tokens: a prefill, a continuation)
    widen them and give the logits the same model gives over float64 caches, bit for bit."""
    model = quantize(tiny_model(0, max_positions=256), "int4", tuning=CpuTuning(kernels="native"))
    assert model.new_cache(8).k.dtype == torch.float32 and model.attention_dtype == torch.float64
    prompt = torch.arange(FUSED_ATTENTION_MAX_TOKENS + 10)[None] % 7 + 1
    more = torch.arange(FUSED_ATTENTION_MAX_TOKENS + 6)[None] % 5 + 2
    n, m = prompt.shape[1], more.shape[1]

    def passes(cache):
        with torch.inference_mode():
            first = model(prompt, torch.arange(n)[None], cache, attention_mask(0, causal_ancestors(n)))
            then = model(more, torch.arange(n, n + m)[None], cache, attention_mask(n, causal_ancestors(m)))
        return first, then

    ours = passes(model.new_cache(n + m + 2))
    for layer in model.layers:  # SDPA over float64 caches: the int model without the kernels' attention
        layer.attn.fused_attention = layer.attn.rows_attention = None
    model.cache_dtype = None
    wide = model.new_cache(n + m + 2)
    assert wide.k.dtype == torch.float64
    for got, want in zip(ours, passes(wide)):
        assert torch.equal(got, want)
