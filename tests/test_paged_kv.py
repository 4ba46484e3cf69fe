"""The paged KV cache (runtime/paged_kv.py) and the verifier engine on it.

The block pool's bookkeeping alone: reference counts, the prefix index of full blocks keyed
by their tokens' hash chain, LRU eviction, namespaces. Then the model: attention through
block tables gives the contiguous cache's logits bit for bit in every precision, after
rejected tree nodes too.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runtime import loading
from runtime.cpu_tuning import apply_cpu_tuning
from runtime.model import attention_mask, causal_ancestors
from runtime.paged_kv import BlockPool, NoFreeBlocks, SequenceBlocks, block_digest, namespace_digest
from runtime.quantize import quantize
from speculative.batching import VerifyItem, verify_batch
from speculative.sampling import SamplingParams
from speculative.tree import DraftTree
from tiny import TINY, tiny_model

PRECISIONS = ("float32", "float32-native", "bfloat16", "int8", "int4")


@pytest.fixture(autouse=True)
def one_torch_thread(request):
    """The tiny models' tests on one torch thread (faster there, and several threads crawl on a
    busy machine); the default model's on every core."""
    from cluster.local import set_cpu_threads

    if "smollm2" in request.fixturenames or "hf_oracle" in request.fixturenames:
        set_cpu_threads()
    else:
        torch.set_num_threads(1)


def tiny_in(precision: str, seed: int = 0, max_positions: int = 256, logit_scale: float = 1.0):
    """A tiny model in `precision`; "float32-native": head size 16 and CPU-tuned, so that its
    passes take specserve's float32 products and attention kernel (the default model's path)."""
    native = precision == "float32-native"
    model = tiny_model(seed, logit_scale, max_positions=max_positions, shape=replace(TINY, head_dim=16) if native else TINY)
    if native:
        apply_cpu_tuning(model)
    elif precision != "float32":
        model = quantize(model.to(loading.parse_dtype(precision)), precision)
    return model


# ---- the bookkeeping -----------------------------------------------------------


def test_blocks_are_handed_out_referenced_and_given_back():
    pool = BlockPool(4, block_size=2)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.available() == 1 and pool.usage() == 0.75
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.available() == 1, "a refused allocation takes nothing"
    pool.release(a[:2])
    assert pool.available() == 3 and [pool.refs(b) for b in a] == [0, 0, 1]
    with pytest.raises(ValueError, match="not held"):
        pool.release([a[0]])
    assert sorted(pool.allocate(3)) == [0, 1, 3]


def test_a_full_blocks_prefix_is_taken_by_its_tokens_in_whole_blocks():
    pool = BlockPool(16, block_size=4)
    first = SequenceBlocks(pool)
    prompt = list(range(10))  # two full blocks and a partial one
    assert first.reuse(prompt, len(prompt) - 1) == 0
    first.reserve(10)
    first.commit(prompt, 10)
    assert pool.cached() == 2, "only the full blocks go to the index"
    assert first.digests == [block_digest(namespace_digest(""), prompt[:4]),
                             block_digest(first.digests[0], prompt[4:8])]

    # the same start, then something else: both full blocks, shared (referenced twice)
    second = SequenceBlocks(pool)
    assert second.reuse(prompt[:8] + [99, 98, 97], 10) == 8
    assert second.blocks == first.blocks[:2] and [pool.refs(b) for b in second.blocks] == [2, 2]
    # a prompt that is exactly the cached blocks leaves its last token to compute: one block less
    third = SequenceBlocks(pool)
    assert third.reuse(prompt[:8], 7) == 4
    # a difference inside the first block: nothing
    assert SequenceBlocks(pool).reuse([0, 1, 2, 5] + prompt[4:], 10) == 0
    # released, the blocks stay cached and a later request still takes them
    for seq in (first, second, third):
        seq.free()
    assert pool.held() == 0 and pool.cached() == 2
    assert SequenceBlocks(pool).reuse(prompt, 9) == 8


def test_unreferenced_cached_blocks_go_least_recently_released_first_a_chains_tail_first():
    pool = BlockPool(4, block_size=1)
    old, new = SequenceBlocks(pool), SequenceBlocks(pool)
    for seq, tokens in ((old, [1, 2]), (new, [3, 4])):
        seq.reserve(2)
        seq.commit(tokens, 2)
    old.free()
    new.free()
    assert pool.available() == 4 and pool.cached() == 4
    taken = pool.allocate(1)  # the least recently released: old's last block
    assert taken == [old.blocks[1] if old.blocks else 1] and pool.evictions == 1
    assert SequenceBlocks(pool).reuse([1, 2], 2) == 1, "old's head is still cached, its tail went"
    assert SequenceBlocks(pool).reuse([3, 4], 2) == 2


def test_two_namespaces_with_the_same_prompt_never_share_a_block():
    pool = BlockPool(8, block_size=2)
    prompt = [5, 6, 7, 8, 9]
    a = SequenceBlocks(pool, "tenant-a")
    a.reserve(5)
    a.commit(prompt, 5)
    b = SequenceBlocks(pool, "tenant-b")
    assert b.reuse(prompt, 4) == 0
    b.reserve(5)
    b.commit(prompt, 5)
    assert not set(a.blocks) & set(b.blocks) and pool.cached() == 4
    assert a.digests[0] != b.digests[0]
    assert SequenceBlocks(pool, "tenant-a").reuse(prompt, 4) == 4


def test_trimming_gives_back_the_blocks_of_rejected_nodes_and_duplicates_stay_private():
    pool = BlockPool(8, block_size=2)
    seq = SequenceBlocks(pool)
    seq.reserve(3 + 5)  # three committed tokens and a tree of five
    assert len(seq.blocks) == 4
    seq.trim(4)  # one node accepted
    assert len(seq.blocks) == 2 and pool.available() == 6
    seq.commit([1, 2, 3, 4], 4)
    with pytest.raises(ValueError, match="indexed"):
        seq.trim(2)
    # another request computing the same blocks meanwhile: the index keeps the first, the
    # second's stay its own and are freed, not cached, when it ends
    twin = SequenceBlocks(pool)
    twin.reserve(4)
    twin.commit([1, 2, 3, 4], 4)
    assert pool.cached() == 2
    twin.free()
    assert pool.cached() == 2 and pool.available() == 6


# ---- attention through block tables ---------------------------------------------


def _rows_scenario(model, paged: bool):
    """Three requests prefilled, four batched rounds of trees that reject nodes, then one
    token each scored alone and rolled back: every logit, and the rows' tokens."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist() for n in (37, 5, 100)]
    if paged:
        store, pool = model.new_paged_cache(64, 16), BlockPool(64, 16)
        tables = [SequenceBlocks(pool) for _ in prompts]
        for table, p in zip(tables, prompts):
            table.reserve(len(p) + 40)
        cache = store.rows([t.blocks for t in tables], [0] * 3)
    else:
        cache = model.new_cache(200, batch=3)
    out, rows = [], [list(p) for p in prompts]
    for r, p in enumerate(prompts):
        n = len(p) - 1
        out.append(model(torch.tensor([p[:-1]]), torch.arange(n)[None], cache.row_view(r),
                         attention_mask(0, causal_ancestors(n))))
    parents = [-1, -1, 0, 1, 1, 3]
    for round_ in range(4):
        scores = {}
        items = []
        for r in range(3):
            size = (r + round_) % 6 + 1
            tree = DraftTree(tokens=[1, 2, 3, 4, 5, 6][:size], parents=parents[:size])
            items.append(VerifyItem(r, rows[r][-1], tree, SamplingParams(), torch.Generator(),
                                    on_scores=lambda tokens, s, r=r: scores.__setitem__(r, s)))
        for r, verdict in enumerate(verify_batch(model, cache, items)):
            rows[r] += verdict.accepted + [verdict.bonus]
            out.append(scores[r])
    for r in range(3):
        start = cache.lengths[r]
        out.append(model(torch.tensor([[rows[r][-1]]]), torch.tensor([[start]]), cache.row_view(r),
                         attention_mask(start, causal_ancestors(1))))
        cache.rollback(start, row=r)
    return out, rows


@pytest.mark.parametrize("precision", PRECISIONS)
def test_attention_through_block_tables_is_the_contiguous_caches_bit_for_bit(precision):
    """Prefills, batched rounds of trees with rejected nodes (the accepted ones compacted within
    the blocks), single tokens: every logit equals the contiguous cache's exactly."""
    model = tiny_in(precision)
    want, want_rows = _rows_scenario(model, paged=False)
    got, got_rows = _rows_scenario(model, paged=True)
    assert got_rows == want_rows
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{precision}: logits {i} differ by {(a - b).abs().max():.2e}"


def test_attention_through_block_tables_is_the_contiguous_caches_on_the_default_model(smollm2):
    model, _ = smollm2
    want, want_rows = _rows_scenario(model, paged=False)
    got, got_rows = _rows_scenario(model, paged=True)
    assert got_rows == want_rows and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_kv_rollback_through_blocks_is_exact(precision):
    """A rejected branch scored across a block boundary, rolled back, another scored: exactly
    the logits of scoring that other one after a fresh prefill (and the rejected branch's
    blocks given back)."""
    model = tiny_in(precision)
    prefix, rejected, taken = list(range(1, 8)) * 2, [6, 7, 0, 1, 2], [3, 1]
    n = len(prefix)  # 14: the branch crosses into the second block of 8

    def run(rows, tokens, start):
        t = len(tokens)
        return model(torch.tensor([tokens]), torch.arange(start, start + t)[None], rows,
                     attention_mask(start, causal_ancestors(t)))

    pool, store = BlockPool(8, 8), model.new_paged_cache(8, 8)
    seq = SequenceBlocks(pool)
    seq.reserve(n + len(rejected))
    rows = store.rows([seq.blocks], [0])
    run(rows, prefix, 0)
    run(rows, rejected, n)
    rows.rollback(n)
    seq.trim(n)
    assert len(seq.blocks) == 2 and pool.available() == 6
    seq.reserve(n + len(taken))
    got = run(store.rows([seq.blocks], [n]), taken, n)
    fresh = SequenceBlocks(pool)
    fresh.reserve(n + len(taken))
    fresh_rows = store.rows([fresh.blocks], [0])
    run(fresh_rows, prefix, 0)
    assert torch.equal(got, run(fresh_rows, taken, n))
    contiguous = model.new_cache(32)
    run(contiguous, prefix, 0)
    assert torch.equal(got, run(contiguous, taken, n))
