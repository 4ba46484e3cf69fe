"""Low precision (runtime/quantize.py, `load(dtype=...)`): lossless within each precision.

In bfloat16, int8 and int4 greedy speculative decoding gives exactly the tokens of plain
decoding in that same precision, for every kind of drafter and for fused trees, on the
default model; speculative sampling keeps a low-precision target's distribution; the KV
cache rolls back exactly; batched rows score as they would alone; and the int4 model's
weights are the shipped GGUF's 4-bit blocks exactly as gguf dequantises them. What makes
greedy exact rather than near: each precision's matmul kernel gives a row the same result
whatever the number of rows beside it, checked first.
"""

from __future__ import annotations

import pytest
import torch

from conftest import dev_prompts
from core_workers import seed_shares
from drafter_service.drafters import ModelDrafter
from drafter_service.registry import make_drafter
from runtime import loading
from speculative.decoding import generate
from runtime.gguf_blocks import cached_int4_blocks
from runtime.gguf_convert import converted_gguf_dir
from runtime.model import attention_mask, causal_ancestors
from runtime.quantize import (LINEAR_PARTS, Int4Linear, Int8Linear, RowSlicedLinear, cuda_inner_k_tiles,
                                  quantize)
from speculative.sampling import SamplingParams
from test_sampling_distribution import PROMPT, chi_square_p, exact_drafted_joint
from tiny import TINY, tiny_model

PRECISIONS = ("bfloat16", "int8", "int4")
PROMPTS = [prompt for _, prompt in dev_prompts(2)]
MAX_TOKENS = 16
# every drafter kind: model-free (prompt lookup, suffix index), the target's own layers,
# a shipped small model, and a fused tree of three
DRAFTERS = [("pld", None), ("suffix", None), ("layerskip", None), ("small-general", None),
            ("pld+suffix+small-general", 8)]


def tiny_in(precision: str, seed: int = 0, logit_scale: float = 1.0):
    """A tiny random model in `precision` (its linear layers quantised for int8/int4)."""
    return quantize(tiny_model(seed, logit_scale).to(loading.parse_dtype(precision)), precision)


@pytest.mark.parametrize("layer", ["bfloat16", "int8/float32", "int8/bfloat16", "int4/float32", "int4/bfloat16"])
def test_a_row_scores_the_same_whatever_rows_are_beside_it(layer):
    """Each layer's rows are independent of the rows beside them (float32 BLAS's are not:
    PackedLinear's docs; bfloat16's are up to BF16_EXACT_ROWS rows, and one row is summed
    unlike several on some CPUs, hence RowSlicedLinear). The default model's q/k/v and down shapes."""
    torch.manual_seed(0)
    mode, _, act = layer.partition("/")
    dtype = getattr(torch, act or mode)
    for inputs, outputs in ((576, 960), (1536, 576)):
        linear = torch.nn.Linear(inputs, outputs, bias=False)
        module = {"int8": lambda: Int8Linear.quantized(linear, dtype),
                  "int4": lambda: Int4Linear.quantized(linear, dtype),
                  "bfloat16": lambda: RowSlicedLinear(linear.to(dtype))}[mode]()
        x = torch.randn(48, inputs).to(dtype)
        with torch.inference_mode():
            together = module(x)
            for rows in (2, 3, 4, 7, 16, 33, 47):
                for start in (0, 1):
                    alone = module(x[start:start + rows])
                    assert torch.equal(alone, together[start:start + rows]), f"{inputs}: {rows} rows from {start}"
            for row in range(48):
                assert torch.equal(module(x[row:row + 1]), together[row:row + 1]), f"{inputs}: row {row} alone"


@pytest.mark.parametrize("activations", ["int8", "float32"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantised_layers_compute_with_their_quantised_weights(mode, activations):
    """The layer's weights are within half a step of the float ones, and it multiplies by them:
    on float32 activations up to float32 rounding; on 8-bit ones (each block of 32 inputs
    rounded to steps of max|x| / 127) within what rounding each input by half a step costs."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=True)
    module = (Int8Linear if mode == "int8" else Int4Linear).quantized(linear, torch.float32, activations=activations)
    w = module.dequantized()
    step = (linear.weight.abs().amax(1, keepdim=True) / 127 if mode == "int8" else
            (lambda g: (g.amax(-1) - g.amin(-1)).repeat_interleave(32, 1) / 15)(linear.weight.reshape(96, 2, 32)))
    assert ((w - linear.weight).abs() <= step / 2 + 1e-6).all(), "quantisation error beyond half a step"
    x = torch.randn(5, 64)
    input_step = x.reshape(5, 2, 32).abs().amax(-1).repeat_interleave(32, 1) / 127
    bound = (input_step / 2) @ w.abs().t() if getattr(module, "activations", None) == "int8" else 0
    with torch.inference_mode():
        assert ((module(x) - (x @ w.t() + linear.bias)).abs() <= bound + 1e-4).all()


def test_bfloat16_attends_in_float64_off_the_cpu_too():
    """A bfloat16 model elsewhere than on a CPU (meta stands in for a GPU here) keeps its
    layers as they are but attends in float64: CUDA's bfloat16 attention rounds a query among
    others unlike the query alone (scripts/gpu_check.py found speculative output leaving
    plain decoding's)."""
    model = quantize(tiny_model(0).to(device="meta", dtype=torch.bfloat16), "bfloat16")
    assert model.attention_dtype == torch.float64
    assert type(model.lm_head) is torch.nn.Linear
    assert model.new_cache(8).k[0].dtype == torch.float64


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_on_a_cpu_without_bfloat16_kernels_says_it_will_be_slow(smollm2, monkeypatch, caplog, native):
    monkeypatch.setattr(loading, "cpu_has_bfloat16", lambda: native)
    with caplog.at_level("WARNING", logger="runtime.loading"):
        loading.load(dtype="bfloat16")
    warned = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    assert (warned == []) if native else ("float32 or int4 is faster here" in warned[0])


def test_cuda_int4_tiling_fits_every_row_width_of_whole_groups():
    """The CUDA packer lays a row out in tiles of 16 inputs, 2, 4 or 8 at a time, which must
    divide the row: the default model's 576-wide layers take 4, not the 8 gpt-fast uses."""
    assert [cuda_inner_k_tiles(k) for k in (576, 1536, 960, 32, 4096)] == [4, 8, 4, 2, 8]
    assert all(k % (16 * cuda_inner_k_tiles(k)) == 0 for k in range(32, 8192, 32))


@pytest.fixture(scope="module")
def models(smollm2):
    """The default model in each precision, loaded as `specserve --dtype` loads it."""
    return {p: loading.load(dtype=p)[0] for p in PRECISIONS}


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    _, tokenizer = smollm2
    return [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


def test_precisions_load_as_asked(models, smollm2):
    target, _ = smollm2
    assert {p: m.dtype for p, m in models.items()} == {"bfloat16": torch.bfloat16, "int8": torch.float32,
                                                        "int4": torch.float32}
    assert all(type(layer.get_submodule(part)) is RowSlicedLinear and layer.get_submodule(part).weight.dtype
               == torch.bfloat16 for layer in models["bfloat16"].layers for part in LINEAR_PARTS)
    for mode, cls in (("int8", Int8Linear), ("int4", Int4Linear)):
        assert all(type(layer.get_submodule(part)) is cls for layer in models[mode].layers for part in LINEAR_PARTS)
        assert type(models[mode].lm_head) is Int8Linear
    # the quantised models still decode the float32 model's text, mostly
    with torch.inference_mode():
        tokens = torch.arange(1000, 1032)[None]
        want = _scores(target, tokens).argmax(-1)
        for p, m in models.items():
            agree = (_scores(m, tokens).argmax(-1) == want).float().mean().item()
            assert agree >= 0.6, f"{p}: next-token argmax agrees with float32 on {agree:.0%} of positions"


def _scores(model, tokens):
    t = tokens.shape[1]
    return model(tokens, torch.arange(t)[None], model.new_cache(t + 4), attention_mask(0, causal_ancestors(t)))[0]


def test_int4_weights_are_the_gguf_blocks_exactly(models):
    """Every layer's int4 codes are the shipped Q4_1 blocks as they are: built from them, a
    layer computes with exactly gguf's own dequantisation of the blocks (the float32
    conversion in the cache is gguf.quants.dequantize's output), and the loaded model holds
    the same blocks (with torch's kernels, its scales rounded to its bfloat16 activations)."""
    directory = converted_gguf_dir(loading.default_gguf_path())
    converted = loading.load_hf_dir(directory)
    blocks = cached_int4_blocks(loading.default_gguf_path(), directory)
    for i, (ours, theirs) in enumerate(zip(models["int4"].layers, converted.layers)):
        for part in LINEAR_PARTS:
            exact = Int4Linear.from_blocks(*blocks[f"layers.{i}.{part}"], torch.float32)
            if exact.native or i == 0:  # torch's kernel dequantises by an identity pass: minutes for every layer
                assert torch.equal(exact.dequantized(), theirs.get_submodule(part).weight), f"layer {i} {part}"
            loaded = ours.get_submodule(part)
            assert loaded.native == exact.native
            assert torch.equal(loaded.weight, exact.weight), f"layer {i} {part}: codes"
            if not loaded.native:
                assert torch.equal(loaded.scales_and_zeros, exact.scales_and_zeros.to(torch.bfloat16)), f"layer {i} {part}"


def test_the_int4_models_head_is_the_gguf_q8_0_blocks_exactly(models):
    """With the native CPU product, the int4 model's int8 head is the shipped Q8_0 head's
    blocks as they are (a scale per 32 inputs): its weights equal the float32 embedding,
    gguf's dequantisation of the same blocks, bit for bit. (torch's int8 kernel takes one
    scale per channel, so elsewhere the head is quantised again.)"""
    model = models["int4"]
    if not model.lm_head.native:
        pytest.skip("torch's int8 kernel here")
    assert model.lm_head.quantized_weights()[1].shape == (model.config.vocab_size, model.config.hidden_size // 32)
    assert torch.equal(model.lm_head.dequantized(), model.embed.weight)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_greedy_speculation_equals_plain_decoding_in_each_precision(models, prompt_ids, precision):
    target = models[precision]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    accepted = dict.fromkeys((name for name, _ in DRAFTERS), 0)
    for i, ids in enumerate(prompt_ids):
        plain = generate(target, ids, params).token_ids
        for name, tree_budget in DRAFTERS:
            drafter = make_drafter(name, target, namespace=f"precision-{precision}-{name}")
            result = generate(target, ids, params, drafter, 2 if name == "layerskip" else 5, tree_budget=tree_budget)
            assert result.token_ids == plain, f"{precision}, {name}, prompt {i}"
            accepted[name] += result.accepted_draft_tokens
    # verification really kept drafted tokens (model-free drafters may find nothing in a short answer)
    assert all(accepted[name] for name in ("layerskip", "small-general", "pld+suffix+small-general")), accepted


@pytest.mark.parametrize("precision", PRECISIONS)
def test_kv_rollback_is_exact(precision):
    """Scoring a rejected branch, rolling back and scoring another gives exactly the
    logits of scoring that other one on a fresh cache."""
    model = tiny_in(precision)
    prefix, rejected, taken = [1, 2, 3, 4, 5], [6, 7, 0], [3, 1]
    n = len(prefix)

    def run(cache, tokens, start):
        t = len(tokens)
        return model(torch.tensor([tokens]), torch.arange(start, start + t)[None], cache,
                     attention_mask(start, causal_ancestors(t)))

    cache = model.new_cache(16)
    run(cache, prefix, 0)
    run(cache, rejected, n)
    cache.rollback(n)
    got = run(cache, taken, n)
    fresh = model.new_cache(16)
    run(fresh, prefix, 0)
    assert torch.equal(got, run(fresh, taken, n))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_pass_of_several_tokens_scores_each_as_decoding_it_alone(models, precision):
    """What greedy losslessness rests on, on the default model: the logits of a token
    verified among others in one pass are exactly those of decoding it alone, linear
    layers and attention alike (attention over several queries rounds unlike one query
    on some CPUs, so the low precisions attend in float64)."""
    model = models[precision]
    prefix, new = list(range(1000, 1020)), [7, 300, 41, 9, 1200, 5]
    n = len(prefix)
    with torch.inference_mode():
        cache = model.new_cache(n + len(new) + 4)
        model(torch.tensor([prefix]), torch.arange(n)[None], cache, attention_mask(0, causal_ancestors(n)))
        together = model(torch.tensor([new]), torch.arange(n, n + len(new))[None], cache,
                         attention_mask(n, causal_ancestors(len(new))))[0]
        cache.rollback(n)
        for i, token in enumerate(new):
            alone = model(torch.tensor([[token]]), torch.tensor([[n + i]]), cache,
                          attention_mask(n + i, causal_ancestors(1)))[0, 0]
            assert torch.equal(alone, together[i]), f"{precision}: token {i} of the pass"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_batched_rows_score_as_they_would_alone(precision):
    """Two requests in one pass, one padded (what the verifier's batches are), give each
    row the logits it gets alone (within the precision's attention rounding)."""
    model = tiny_in(precision)
    rows = [[1, 2, 3, 4], [5, 6, 0, 0]]
    real = [4, 2]
    cache = model.new_cache(8, batch=2)
    mask = torch.zeros(2, 4, 4, dtype=torch.bool)
    mask[0] = causal_ancestors(4)
    mask[1, :2, :2] = causal_ancestors(2)
    mask[1, 2:, 2:] = torch.eye(2, dtype=torch.bool)  # padding attends to itself only
    both = model(torch.tensor(rows), torch.arange(4).expand(2, 4), cache, mask, real=real)
    alone = [model(torch.tensor([r[:n]]), torch.arange(n)[None], model.new_cache(8),
                   attention_mask(0, causal_ancestors(n)))[0] for r, n in zip(rows, real)]
    assert torch.allclose(both, torch.cat(alone), atol=1e-2, rtol=1e-2)


SAMPLES = 3000


def _sampled_counts(precision: str, seeds: range) -> tuple[torch.Tensor, int]:
    """Seeded runs (in a worker process): counts of (token 1, token 2), runs that drafted."""
    target, drafter_model = tiny_in(precision, 0, 0.5), tiny_in(precision, 1, 0.5)
    counts, drafted = torch.zeros(TINY.vocab_size, TINY.vocab_size), 0
    for seed in seeds:
        p = SamplingParams(max_tokens=4, temperature=1.0, seed=seed)
        result = generate(target, PROMPT, p, ModelDrafter(drafter_model, max_len=64), 2)
        counts[result.token_ids[1], result.token_ids[2]] += 1
        drafted += result.draft_tokens > 0
    return counts, drafted


def sampled_jobs(precision: str) -> list[tuple]:
    """SAMPLES seeded runs, as calls for the worker processes: one share of the seeds each."""
    return [(_sampled_counts, precision, seeds) for seeds in seed_shares(SAMPLES)]


def background_jobs(item) -> list[tuple]:
    """The calls this module's tests make of the worker processes."""
    if item.originalname == "test_speculative_sampling_keeps_a_low_precision_targets_distribution":
        return sampled_jobs(item.callspec.params["precision"])
    return []


@pytest.mark.parametrize("precision", ["bfloat16", "int4"])
def test_speculative_sampling_keeps_a_low_precision_targets_distribution(core_workers, precision):
    """Seeded runs of a model drafter at temperature 1 against a low-precision tiny
    target: the second and third tokens (the first a draft covers) follow the target's
    own joint distribution in that precision (chi-square, as tests/test_sampling_distribution.py).
    The runs are split over the worker processes."""
    counts, drafted = map(sum, zip(*core_workers.results(sampled_jobs(precision))))
    assert drafted > SAMPLES // 2
    target = tiny_in(precision, 0, 0.5)
    assert chi_square_p(counts, exact_drafted_joint(target, SamplingParams(temperature=1.0))) > 1e-3
