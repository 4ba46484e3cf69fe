"""Static-shape passes (runtime/static_pass.py) and their capture bookkeeping (runtime/graphs.py)
on the CPU: the bucket a pass takes, the inputs copied into the bucket's buffers, the outputs
sliced to the real rows, and the logits of every real row equal to the eager pass's (and to
the same pass in another bucket) in float32, bfloat16, int8 and int4, with trees and batches.
What only a GPU shows (the capture, replays, the fused attention kernel) is
scripts/gpu_check.py's: `test_gpu_check_dry_run` runs its CPU-reachable parts."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from drafter_service.registry import make_drafter
from runtime import loading
from runtime.cpu_tuning import CpuTuning, apply_cpu_tuning
from runtime.graphs import SharedPasses, StaticPasses
from runtime.model import attention_mask, causal_ancestors
from runtime.quantize import quantize
from runtime.static_pass import Bucket, Buckets
from speculative.batching import VerifyItem, verify_batch
from speculative.decoding import generate
from speculative.sampling import SamplingParams, make_generator
from speculative.tree import DraftTree
from tiny import TINY, tiny_model

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("float32", "float32-tuned", "bfloat16", "int8", "int4")
# the largest difference a real row's logits may show against the eager pass: the plain float32
# model multiplies by torch's BLAS and attends by SDPA, neither of which gives a row the same
# low bits among other rows (and over a longer span of masked slots); every other precision
# runs row-exact kernels there (specserve's products and attention, float64 attention)
BOUND = {"float32": 1e-5}


# heads of 64 features, which specserve's CPU attention takes (the tiny model's 8 it does not)
WIDE_HEADS = replace(TINY, hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1, head_dim=64)


def model_in(precision: str, seed: int = 0):
    if precision == "float32-tuned":  # specserve's CPU products and attention, where they build
        model = tiny_model(seed, max_positions=256, shape=WIDE_HEADS, num_kv_heads=1)
        apply_cpu_tuning(model, CpuTuning())
        return model
    model = tiny_model(seed, max_positions=256)
    if precision == "float32":
        return model
    if precision == "float32":
        return model
    return quantize(model.to(loading.parse_dtype(precision)), precision)


def same(a: torch.Tensor, b: torch.Tensor, precision: str) -> None:
    bound = BOUND.get(precision, 0.0)
    gap = float((a - b).abs().max())
    assert gap <= bound, f"{precision}: logits {gap:.2e} apart"
    if not bound:
        assert torch.equal(a, b)


def prefilled(model, prompts, slots=64):
    cache = model.new_cache(slots, batch=len(prompts))
    for row, p in enumerate(prompts):
        view = cache.row_view(row)
        model(torch.tensor([p]), torch.arange(len(p))[None], view, attention_mask(0, causal_ancestors(len(p))))
    return cache


def test_a_pass_takes_the_smallest_bucket_that_holds_it():
    buckets = Buckets()
    assert buckets.of(3, 5, 200, 1024) == Bucket(4, 8, 256)
    assert buckets.of(1, 1, 10, 1024) == Bucket(1, 1, 128)  # spans from MIN_SPAN up
    assert buckets.of(1, 1, 300, 400) == Bucket(1, 1, 400)  # never past the cache
    assert buckets.of(1, 1, 400, 400) is None  # the last slot is the trash slot
    assert buckets.of(65, 1, 10, 1024) is None and buckets.of(1, 65, 10, 1024) is None


def test_inputs_are_copied_into_the_buckets_buffers_and_outputs_sliced():
    model = tiny_model(0, max_positions=256)
    cache = prefilled(model, [[1, 2, 3], [4, 5, 6, 7, 1]], slots=40)
    static = StaticPasses(model, cache)
    assert not static.graphs  # off CUDA the same bookkeeping runs eagerly
    tokens = torch.tensor([[3, 4], [5, 6]])
    positions = torch.tensor([[5, 6], [3, 4]])
    mask = torch.zeros(2, 2, 7, dtype=torch.bool)
    mask[0, :, :5] = True
    mask[0, :, 5:7] = causal_ancestors(2)
    mask[1, 0, :4] = True
    mask[1, 1, 3] = True  # row 1's second token is padding (real = [2, 1])
    logits = static(tokens, positions, mask, rows=[1, 0], real=[2, 1])
    assert logits.shape == (3, 8)  # packed: row 1's two tokens, then row 0's one
    bucket = Bucket(2, 2, 40)  # spans stop at the cache's slots
    assert static.passes == {bucket: 1}
    inputs = static._inputs[bucket]
    assert inputs.tokens.tolist() == [[3, 4], [5, 0]]
    assert inputs.read_rows.tolist() == [1, 0]
    assert inputs.write_rows.tolist() == [[1, 1], [0, 0]]
    assert inputs.write_slots.tolist() == [[5, 6], [3, 39]]  # padding to the trash slot, the row's last
    assert inputs.mask[1, 0, 1].nonzero().flatten().tolist() == [0]  # a padding query sees slot 0 alone
    assert cache.lengths == [3 + 2, 5 + 2]  # as Transformer.forward moves them
    with pytest.raises(ValueError):
        StaticPasses(model, cache, graphs=True)  # the capture is CUDA's


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_static_pass_scores_a_row_as_the_eager_pass(precision):
    """One row, one token and a tree of five: the static pass (bucket 1 x 1, 1 x 8, span 128)
    against the eager forward over an equal cache."""
    model = model_in(precision)
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    eager, ours = prefilled(model, [prompt]), prefilled(model, [prompt])
    static = StaticPasses(model, ours)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    for tokens, ancestors in (([4], causal_ancestors(1)), ([5, 6, 7, 0, 1], tree)):
        n, start = len(tokens), eager.lengths[0]
        depths = ancestors.sum(1) - 1
        args = (torch.tensor([tokens]), (start + depths)[None], attention_mask(start, ancestors))
        want = model(args[0], args[1], eager, args[2])
        got = static(*args, rows=[0])
        assert got.shape == want.shape
        same(got, want, precision)
    assert eager.lengths == ours.lengths
    n = eager.lengths[0]
    same(ours.k[:, :, :, :n].float(), eager.k[:, :, :, :n].float(), precision)  # the same entries written


def _items(trees, rows, seed=0):
    gen = make_generator(seed, "cpu")
    return [VerifyItem(row, root, DraftTree(tokens, parents), SamplingParams(), gen)
            for row, (root, tokens, parents) in zip(rows, trees)]


BATCH_PROMPTS = [[1, 2, 3, 4], [5, 5, 5], [6, 1, 6, 1, 6, 1], [2, 7, 3]]
BATCH_TREES = [(3, [4, 5, 6], [-1, 0, 1]), (2, [1, 3, 0, 2, 4], [-1, -1, 0, 1, 3]), (0, [], [])]


def two_rounds(model, cache, static) -> tuple[list, list]:
    """Three requests in rows 0, 2 and 3 (row 1 idle), a chain, a tree and an empty tree, two
    rounds over `cache` (a KVCache, or a paged cache's rows): every node's scores, the verdicts."""
    scores, verdicts = [], []
    for _ in range(2):
        items = _items(BATCH_TREES, [0, 2, 3])
        for it in items:
            it.on_scores = lambda tokens, s: scores.append(s.clone())
        verdicts += [(v.path, v.bonus) for v in verify_batch(model, cache, items, static=static)]
    if static is not None:
        assert static.serves(cache) and sum(static.passes.values()) == 2
    return scores, verdicts


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_batch_of_trees_verifies_alike_static_and_eager(precision):
    """The same scores for every node, the same verdicts, the same kept cache entries."""
    model = model_in(precision)
    runs = {}
    for kind in ("eager", "static"):
        cache = prefilled(model, BATCH_PROMPTS)
        runs[kind] = *two_rounds(model, cache, StaticPasses(model, cache) if kind == "static" else None), cache
    (s_eager, v_eager, c_eager), (s_static, v_static, c_static) = runs["eager"], runs["static"]
    assert v_static == v_eager
    for a, b in zip(s_static, s_eager):
        same(a, b, precision)
    assert c_static.lengths == c_eager.lengths
    for row, n in enumerate(c_eager.lengths):
        same(c_static.k[:, row, :, :n].float(), c_eager.k[:, row, :, :n].float(), precision)


def paged_prefilled(model, prompts, blocks_a_row=4, block_size=8):
    """A paged cache whose row r holds blocks r * blocks_a_row.., each prompt prefilled eagerly."""
    cache = model.new_paged_cache(blocks_a_row * len(prompts), block_size)
    tables = [list(range(r * blocks_a_row, (r + 1) * blocks_a_row)) for r in range(len(prompts))]
    view = cache.rows(tables, [0] * len(prompts))
    for row, p in enumerate(prompts):
        model(torch.tensor([p]), torch.arange(len(p))[None], view.row_view(row),
              attention_mask(0, causal_ancestors(len(p))))
    return cache, view


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_batch_of_trees_over_a_paged_cache_verifies_alike_static_and_eager(precision):
    """As above over a paged cache (the verifier's): the rows' block tables become the static
    pass's slot indices; the same scores, verdicts, lengths and kept keys as the eager pass."""
    model = model_in(precision)
    runs = {}
    for kind in ("eager", "static"):
        cache, view = paged_prefilled(model, BATCH_PROMPTS)
        runs[kind] = *two_rounds(model, view, StaticPasses(model, cache) if kind == "static" else None), cache, view
    (s_eager, v_eager, c_eager, w_eager), (s_static, v_static, c_static, w_static) = runs["eager"], runs["static"]
    assert v_static == v_eager
    for a, b in zip(s_static, s_eager):
        same(a, b, precision)
    assert list(w_static.lengths) == list(w_eager.lengths)
    for row, n in enumerate(w_eager.lengths):
        slots = torch.tensor(w_eager.slot_ids(row, range(n)))
        same(c_static.k[:, :, slots].float(), c_eager.k[:, :, slots].float(), precision)


def test_the_verifier_engine_verifies_through_static_passes_when_asked():
    """`cuda_graphs` on (on the CPU: the static passes run eagerly, over the paged cache's
    blocks): the same outcomes, round after round, as the engine's eager passes; off by
    default on the CPU."""
    from verifier_service.engine import VerifierEngine

    model = model_in("int8")
    engine = VerifierEngine(model, max_len=64, kv_blocks=80, kv_block_size=8)
    assert engine._static is None
    engine.close()
    outcomes = {}
    for on in (False, True):
        engine = VerifierEngine(model, max_len=64, kv_blocks=80, kv_block_size=8, cuda_graphs=on)
        try:
            got = [engine.prefill(r, p, SamplingParams()).next_token for r, p in (("a", [1, 2, 3]), ("b", [4, 5]))]
            for _ in range(3):
                for r in ("a", "b"):
                    o = engine.verify(r, DraftTree([3, 4, 1], [-1, 0, -1]))
                    got.append((o.accepted, o.bonus))
            outcomes[on] = got
            assert (engine._static is not None) == on
            if on:
                assert sum(engine._static.passes.values()) >= 3  # rounds batched or not
        finally:
            engine.close()
    assert outcomes[True] == outcomes[False]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_padding_rows_and_slots_never_change_a_real_rows_logits(precision):
    """The same pass in its own bucket and in a much larger one (8 rows, 16 tokens, 256 slots):
    bit for bit where the kernels are row-exact."""
    model = model_in(precision)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    trees = [(3, [4, 5], [-1, 0]), (2, [1, 3, 0], [-1, -1, 0])]
    out = []
    for buckets in (Buckets(), Buckets(rows=(8,), tokens=(16,), min_span=256)):
        cache = prefilled(model, prompts)
        static = StaticPasses(model, cache, buckets)
        scores = []
        items = _items(trees, [0, 1])
        for it in items:
            it.on_scores = lambda tokens, s: scores.append(s.clone())
        verify_batch(model, cache, items, static=static)
        out.append(scores)
        assert len(static.passes) == 1
    for a, b in zip(*out):
        same(a, b, precision)


@pytest.mark.parametrize("drafter", ["pld", "layerskip"])
def test_generation_through_static_passes_equals_plain_generation(drafter):
    """Rounds verified (and layer-skip drafts drafted) at static shapes: the same tokens as the
    eager loop, greedy, with int4's row-exact kernels (so bit for bit, not near). Requests one
    after another reuse the target's passes and the drafters' (SharedPasses)."""
    model = model_in("int4")
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    params = SamplingParams(max_tokens=12)
    static, shared = StaticPasses.for_requests(model, 64), SharedPasses()
    want = generate(model, prompt, params, make_drafter(drafter, model, cuda_graphs=False), 3).token_ids
    for _ in range(2):  # the second request finds the caches the first left
        d = make_drafter(drafter, model, cuda_graphs=True, shared_passes=shared)
        got = generate(model, prompt, params, d, 3, static=static)
        assert got.token_ids == want
    plain = generate(model, prompt, params, None, static=static)
    assert plain.token_ids == want
    assert sum(static.passes.values()) == 2 * (got.target_forward_passes - 1) + plain.target_forward_passes - 1
    if drafter == "layerskip":
        [passes] = shared._passes.values()
        assert d._static is passes and sum(passes.passes.values()) > 0


def test_gpu_check_dry_run(tmp_path):
    """scripts/gpu_check.py's CPU-reachable parts: the bucket checks and one tiny model's
    drafters against plain decoding, on the CPU."""
    out = tmp_path / "check.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    for cache in ("float32", "float32-paged"):  # a drafter's contiguous cache, the verifier's paged one
        assert report["buckets"][cache]["checked"] > 0 and not report["buckets"][cache]["errors"]
        assert not report["buckets"][cache]["differ"]


class _FakeGraph:
    """A CUDA graph's contract on the CPU: capture records the pass (its input buffers, its output
    tensor), replay runs it again over the same buffers into the same output, in place."""

    capturing = None

    def __init__(self):
        self.recorded = None

    def pool(self):
        return "pool"

    def replay(self):
        fn, args, out = self.recorded
        with torch.inference_mode():
            out.copy_(fn(*args))


def test_the_capture_path_replays_each_buckets_graph_with_new_inputs(monkeypatch):
    """The CUDA-only calls stubbed with _FakeGraph: a bucket is captured once (after the warm-up
    passes), every later pass of it replays with the request's inputs copied into the same
    buffers, and the logits (sliced from the graph's output) are each request's own."""
    import contextlib

    from runtime import graphs

    calls = []
    real_forward = graphs.static_forward

    def forward(*args):
        calls.append("capture" if _FakeGraph.capturing else "eager")
        out = real_forward(*args)
        if _FakeGraph.capturing is not None:
            _FakeGraph.capturing.recorded = (real_forward, args, out)
        return out

    @contextlib.contextmanager
    def capture(graph, pool=None, capture_error_mode=None):
        _FakeGraph.capturing = graph
        try:
            yield
        finally:
            _FakeGraph.capturing = None

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(graphs, "static_forward", forward)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    model = model_in("int8")
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    eager_cache, cache = prefilled(model, prompts), prefilled(model, prompts)
    static = StaticPasses(model, cache)
    static.graphs = True  # as on CUDA
    for round_ in range(3):
        trees = [(round_ + 1, [4, 5][:round_ + 1], [-1, 0][:round_ + 1]), (2, [1], [-1])]
        want, got = [], []
        for c, s, out in ((eager_cache, None, want), (cache, static, got)):
            items = _items(trees, [0, 1])
            for it in items:
                it.on_scores = lambda tokens, scores, out=out: out.append(scores.clone())
            verify_batch(model, c, items, static=s)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    # rounds of 2, 3 and 3 tokens a row: buckets 2x2 and 2x4, each captured once after its warm-up
    assert calls == ["eager", "eager", "capture"] * 2
    assert static.captured() == [Bucket(2, 2, 64), Bucket(2, 4, 64)]
    assert static.replays == 3 and cache.lengths == eager_cache.lengths


def test_the_in_process_engine_and_bench_time_passes_through_static_passes():
    """LocalEngine's `cuda_graphs` (off on a CPU by default) gives the requests one StaticPasses
    and the bench's --micro times one pass through it (each size's first, a capture on CUDA,
    untimed)."""
    from bench.harness import forward_ms
    from cluster.local import LocalEngine

    model = tiny_model(0, max_positions=256)
    assert LocalEngine(model, None).static_passes() is None
    engine = LocalEngine(model, None, cuda_graphs=True)
    static = engine.static_passes()
    assert static is engine.static_passes() and engine.drafter_passes() is not None
    times = forward_ms(engine, sizes=(1, 4), repeats=2, static=static)
    assert set(times) == {"1", "4"} and static.passes == {Bucket(1, 1, 256): 3, Bucket(1, 4, 256): 3}


def test_a_paged_rows_tokens_past_its_blocks_write_to_the_trash_slot_alone():
    """As the eager paged pass drops them: a row of one 8-slot block holding 6, given 4 tokens,
    writes its first 2 to its block and the rest (and padding) to the trash slot."""
    from runtime.static_pass import pad_paged

    cache = model_in("float32").new_paged_cache(4, 8)
    view = cache.rows([[2]], [6])
    t = 4
    padded = pad_paged(Bucket(2, 4, 128), torch.zeros(1, t, dtype=torch.long), torch.arange(6, 10)[None],
                       torch.ones(1, t, 10, dtype=torch.bool), view, [0], [t])
    assert padded.write_slots[0].tolist() == [2 * 8 + 6, 2 * 8 + 7, cache.trash_slot, cache.trash_slot]
    assert padded.write_slots[1].tolist() == [cache.trash_slot] * 4  # a padding row
    assert padded.read_slots[0, :8].tolist() == list(range(16, 24)) and set(padded.read_slots[0, 8:].tolist()) == {
        cache.zero_slot}
