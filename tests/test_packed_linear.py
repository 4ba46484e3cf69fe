"""CPU tuning (runtime.cpu_tuning): prepacked linear layers give the same logits as
the plain model, the paths of one row, of 2-3 rows and of long passes are chosen by what
this CPU does faster, and a short row runs padded (or by BLAS, unpadded) with the plain
model's results. oneDNN's packed layers (`PackedLinear`, what `kernels="torch"` asks for);
specserve's own (`NativeLinear`) are tested in test_cpu_kernels.py."""

from __future__ import annotations

import copy
import gc
import time
import weakref

import pytest
import torch

from runtime import cpu_tuning
from runtime.cpu_tuning import (LONG_ROWS_TIMED, PACKED_CHUNK_ROWS, PAD_ROWS_TO, CpuTuning, PackedLinear,
                                    apply_cpu_tuning)
from runtime.model import Transformer, attention_mask, causal_ancestors
from tiny import tiny_model


def logits(model, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(len(tokens) + 1)
    prefix = tokens[:-1]
    model(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache, attention_mask(0, causal_ancestors(len(prefix))))
    # the last token alone: a one-row pass
    one = model(torch.tensor([tokens[-1:]]), torch.tensor([[len(prefix)]]), cache,
                attention_mask(len(prefix), causal_ancestors(1)))
    return torch.cat((one[0], model(torch.tensor([tokens]), torch.arange(len(tokens))[None], model.new_cache(len(tokens)),
                                    attention_mask(0, causal_ancestors(len(tokens))))[0]))


@pytest.mark.parametrize("one_row_blas", [True, False])
@pytest.mark.parametrize("short_rows_blas", [True, False])
def test_packed_model_scores_like_the_plain_one(one_row_blas, short_rows_blas, monkeypatch):
    plain = tiny_model(0)
    packed = copy.deepcopy(plain)
    asked = []

    def measured(layers, rows, packed_rows, repeats=5):
        asked.append((rows, packed_rows, len(layers)))
        return one_row_blas if rows == 1 else short_rows_blas if rows == 3 else not short_rows_blas

    monkeypatch.setattr(cpu_tuning, "_blas_wins", measured)
    if not apply_cpu_tuning(packed, CpuTuning(kernels="torch")):
        pytest.skip("this torch has no oneDNN packed linear")
    every, first_layer = 4 * len(packed.layers) + 1, 4
    # one row as it is; 3 rows against their padded 4; a long pass through the first layer
    assert asked == [(1, 1, every), (3, PAD_ROWS_TO, every), (LONG_ROWS_TIMED, LONG_ROWS_TIMED, first_layer)]
    layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == every
    assert {m.one_row_blas for m in layers} == {one_row_blas}
    assert {m.short_rows_blas for m in layers} == {short_rows_blas}
    assert {m.long_rows_blas for m in layers} == {not short_rows_blas}
    assert packed.pad_short_rows is not short_rows_blas
    tokens = [1, 2, 3, 4, 5, 6]
    assert torch.allclose(logits(packed, tokens), logits(plain, tokens), atol=1e-4)


@pytest.mark.parametrize("short_rows", ["blas", "padded"])
@pytest.mark.parametrize("t", [2, 3])
def test_short_rows_take_the_path_chosen_and_score_like_the_plain_model(short_rows, t, monkeypatch):
    """Packed, one row of 2-3 new tokens runs through BLAS as it is (`short_rows` blas) or
    padded to PAD_ROWS_TO through the packed layers; either way with the plain model's
    logits and cache."""
    plain = tiny_model(0)
    tuned = copy.deepcopy(plain)
    if not apply_cpu_tuning(tuned, CpuTuning(short_rows=short_rows, kernels="torch")):
        pytest.skip("this torch has no oneDNN packed linear")
    prefix, new = [1, 2, 3], [4, 5, 6][:t]
    caches = []
    for model in (plain, tuned):
        cache = model.new_cache(len(prefix) + PAD_ROWS_TO)
        model(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache,
              attention_mask(0, causal_ancestors(len(prefix))))
        caches.append(cache)
    rows_seen = []
    blas = torch.nn.functional.linear
    monkeypatch.setattr(cpu_tuning.F, "linear", lambda x, *a: rows_seen.append(x.numel() // x.shape[-1]) or blas(x, *a))
    got = tuned(torch.tensor([new]), torch.arange(len(prefix), len(prefix) + t)[None], caches[1],
                attention_mask(len(prefix), causal_ancestors(t)))
    monkeypatch.undo()
    want = plain(torch.tensor([new]), torch.arange(len(prefix), len(prefix) + t)[None], caches[0],
                 attention_mask(len(prefix), causal_ancestors(t)))
    layers = 4 * len(tuned.layers) + 1
    assert rows_seen == ([t] * layers if short_rows == "blas" else [])
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4)
    n = len(prefix) + t
    assert caches[1].lengths == caches[0].lengths == [n]
    assert torch.allclose(caches[1].k[:, :, :, :n], caches[0].k[:, :, :, :n], atol=1e-5)


@pytest.mark.parametrize("long_rows", ["blas", "packed"])
def test_long_passes_take_the_path_chosen_and_score_like_the_plain_layer(long_rows, monkeypatch):
    """A pass of more than PACKED_CHUNK_ROWS rows (a long prefill) runs by BLAS in one call
    (`long_rows` blas) or packed in slices; either way with nn.Linear's results up to
    float32 rounding. Shorter passes stay packed whatever the choice."""
    plain = tiny_model(0, max_positions=2 * PACKED_CHUNK_ROWS)
    tuned = copy.deepcopy(plain)
    if not apply_cpu_tuning(tuned, CpuTuning(long_rows=long_rows, kernels="torch")):
        pytest.skip("this torch has no oneDNN packed linear")
    layer = tuned.layers[0].mlp.gate_up
    assert layer.long_rows_blas is (long_rows == "blas")
    rows_seen = []
    blas = torch.nn.functional.linear
    monkeypatch.setattr(cpu_tuning.F, "linear", lambda x, *a: rows_seen.append(x.numel() // x.shape[-1]) or blas(x, *a))
    for n in (PACKED_CHUNK_ROWS, PACKED_CHUNK_ROWS + 1, 2 * PACKED_CHUNK_ROWS):
        x = torch.randn(1, n, layer.in_features)
        with torch.inference_mode():
            assert torch.allclose(layer(x), blas(x, layer.weight), atol=1e-5)
    assert rows_seen == ([PACKED_CHUNK_ROWS + 1, 2 * PACKED_CHUNK_ROWS] if long_rows == "blas" else [])


@pytest.mark.parametrize("blas_wins", [True, False])
def test_the_paths_are_timed_as_a_forward_meets_the_layers(blas_wins, monkeypatch):
    """Each sweep runs every layer once, in order, by one path, the two paths' sweeps
    alternating (a layer timed alone runs from the CPU's cache); the cheaper sweep
    decides for every layer, and is measured once."""
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        pytest.skip("this torch has no oneDNN packed linear")
    layers = [PackedLinear(torch.nn.Linear(4, n, bias=False)) for n in (4, 8, 16)]
    calls = []
    slow = 0.002

    def timed(path, fn):
        def run(x, *args):
            calls.append((path, x.shape[0]))
            time.sleep(slow if (path == "blas") != blas_wins else 0)
            return fn(x, *args)
        return run

    monkeypatch.setattr(cpu_tuning, "_path_seconds", {})
    monkeypatch.setattr(cpu_tuning.F, "linear", timed("blas", torch.nn.functional.linear))
    for m in layers:
        monkeypatch.setattr(m, "_packed", timed("packed", m._packed))
    assert cpu_tuning._blas_wins(layers, 3, PAD_ROWS_TO, repeats=2) is blas_wins
    sweep = [("blas", 3)] * len(layers) + [("packed", PAD_ROWS_TO)] * len(layers)
    assert calls == sweep * 3  # a warm-up round, then 2 timed
    assert cpu_tuning._blas_wins(layers, 3, PAD_ROWS_TO, repeats=2) is blas_wins
    assert len(calls) == len(sweep) * 3


@pytest.mark.parametrize("t", [2, 3])
def test_a_short_row_runs_padded_and_scores_like_the_plain_model(t, monkeypatch):
    """One row of 2-3 tokens runs as PAD_ROWS_TO tokens; the logits (also of `logits_from`
    and `real`), the cache's length and its entries are the plain model's."""
    plain = tiny_model(0)
    tuned = copy.deepcopy(plain)
    apply_cpu_tuning(tuned, CpuTuning(packed_linear=False))  # the padding alone
    widths = []
    forward = Transformer.forward

    def spy(model, tokens, *args, **kwargs):
        widths.append((model is tuned, tokens.shape[1]))
        return forward(model, tokens, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", spy)
    prefix, new = [1, 2, 3], [4, 5, 6][:t]
    mask = attention_mask(len(prefix), causal_ancestors(t))
    positions = torch.arange(len(prefix), len(prefix) + t)[None]
    for kwargs in ({}, {"logits_from": 1}, {"real": [t]}):
        results = []
        for model in (plain, tuned):
            cache = model.new_cache(len(prefix) + PAD_ROWS_TO)
            model(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache,
                  attention_mask(0, causal_ancestors(len(prefix))))
            widths.clear()
            results.append((model(torch.tensor([new]), positions, cache, mask, **kwargs), cache))
            assert widths == [(model is tuned, PAD_ROWS_TO if model is tuned else t)]
        (want, plain_cache), (got, tuned_cache) = results
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
        assert tuned_cache.lengths == plain_cache.lengths == [len(prefix) + t]
        n = len(prefix) + t
        assert torch.allclose(tuned_cache.k[:, :, :, :n], plain_cache.k[:, :, :, :n], atol=1e-5)


def test_a_tuned_model_is_freed_when_dropped():
    """No reference cycle keeps a tuned model (and its weights) alive until the cyclic
    collector runs: a process that loads models one after another would pile them up."""
    model = tiny_model(0)
    apply_cpu_tuning(model)
    gone = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert gone() is None
    finally:
        gc.enable()


@pytest.fixture
def onednn_shapes(monkeypatch) -> list[tuple[int, ...]]:
    """The input shapes oneDNN's packed linear is called with, in order."""
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        pytest.skip("this torch has no oneDNN packed linear")
    seen = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        seen.append(tuple(x.shape))
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    return seen


def test_a_packed_layer_runs_few_shapes_and_gives_every_row_its_result(onednn_shapes):
    """oneDNN keeps a primitive (with scratch memory) per shape: every row count from 1 to
    well past a chunk must reach it as one of a few shapes, and still give nn.Linear's rows."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40)
    layer = PackedLinear(linear)
    with torch.inference_mode():
        for n in range(1, 3 * cpu_tuning.PACKED_CHUNK_ROWS + 40):
            x = torch.randn(1, n, 24)
            got = layer._packed(x)
            assert got.shape == (1, n, 40)
            if n % 37 == 0 or n in (cpu_tuning.PACKED_CHUNK_ROWS, cpu_tuning.PACKED_CHUNK_ROWS + 1):
                torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
    seen = set(onednn_shapes)
    assert all(rows <= cpu_tuning.PACKED_CHUNK_ROWS for rows, _ in seen)
    assert len(seen) <= 80, f"{len(seen)} shapes reached oneDNN"
    assert all(cpu_tuning.packed_rows(n) - n <= n / 16 for n in range(1, cpu_tuning.PACKED_CHUNK_ROWS + 1))


def test_a_pass_of_a_few_tokens_reaches_onednn_as_it_is_and_gives_every_row_its_result(onednn_shapes):
    """Up to 16 rows in all (a verification pass, batched or not) skip the reshape, padding and
    slice of longer passes: oneDNN gets the input as it is, at most 16 rows of it."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40)
    layer = PackedLinear(linear)
    layer.one_row_blas = layer.short_rows_blas = False  # every row count through the packed path
    with torch.inference_mode():
        for b, t in ((1, 1), (1, 3), (1, 16), (2, 5), (4, 4), (16, 1)):
            x = torch.randn(b, t, 24)
            torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
            assert onednn_shapes[-1] == (b, t, 24)
    assert len(onednn_shapes) == 6
