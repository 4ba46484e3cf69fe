"""The paged KV cache (runtime/paged_kv.py) and the verifier engine on it.

The block pool's bookkeeping alone: reference counts, the prefix index of full blocks keyed
by their tokens' hash chain, LRU eviction, namespaces. Then the model: attention through
block tables gives the contiguous cache's logits bit for bit in every precision, after
rejected tree nodes too; a request prefilled from a cached prefix scores as one prefilled
from nothing. Then the engine: a conversation's next turn takes its first turn's blocks,
a burst of four times the old row count on a cache too small for it completes with every
output the single-process loop's, preempting as it goes, and sampling across preemptions
keeps the target's distribution.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from core_workers import seed_shares
from drafter_service.registry import make_drafter
from runtime import loading
from runtime.cpu_tuning import apply_cpu_tuning, own_torch_threads
from runtime.model import attention_mask, causal_ancestors
from runtime.paged_kv import BlockPool, NoFreeBlocks, SequenceBlocks, block_digest, namespace_digest
from runtime.quantize import quantize
from speculative.batching import VerifyItem, verify_batch
from speculative.decoding import DraftRequest, generate
from speculative.sampling import SamplingParams, make_generator
from speculative.tree import DraftTree
from tiny import TINY, tiny_model
from verifier_service.engine import ResourceExhausted, VerifierEngine

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


# ---- the engine ----------------------------------------------------------------


def _logits(engine: VerifierEngine, tokens: list[int], namespace: str, last: int = 4):
    """The engine's prefill of `tokens` in `namespace` (its worker stopped): the logits after the
    last `last` tokens, and how many tokens came from the cache."""
    seq = SequenceBlocks(engine._pool, namespace)
    hits = engine.kv_stats()["prefix_cache_hits"]
    logits = engine._compute(seq, tokens, len(tokens) - last, last=last)
    return logits, engine.kv_stats()["prefix_cache_hits"] - hits


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_prefill_from_a_cached_prefix_scores_as_one_from_nothing(precision):
    """A prompt whose first blocks another request left cached (a shared system prompt), and a
    next turn whose cache holds the first turn's prompt and decoded answer: the logits the
    engine computes from the cache equal, bit for bit, those of the same tokens prefilled from
    nothing (in a namespace of their own, where the cache holds none of them).

    Bit for bit wherever a token's keys and values are the same whatever pass computes them:
    the row-exact precisions (bfloat16, int8, int4: row-exact products, float64 attention), and
    float32 on specserve's kernels for passes of up to 64 tokens (its attention kernel's; a
    longer pass attends by SDPA, which rounds unlike it). float32 on torch's BLAS rounds a row
    by the rows beside it: a cached prefix whose blocks were decoded token by token then
    differs from a prefill of them in the last bits (as a request resumed from its checkpoint
    always did), and only closeness is asserted."""
    model = tiny_in(precision)
    engine = VerifierEngine(model, max_len=200, max_batch_tokens=16, kv_blocks=64, kv_block_size=8)
    try:
        gen = torch.Generator().manual_seed(1)
        system, question = (torch.randint(0, 7, (n,), generator=gen).tolist() for n in (27, 9))
        first = engine.prefill("turn1", system + question, SamplingParams(max_tokens=40), namespace="chat")
        answer = [first.next_token]
        for out in engine.verify_rounds("turn1", DraftTree(), None,
                                        lambda o: DraftTree() if len(answer) < 20 else None):
            answer += out.accepted + [out.bonus]
        assert engine.release("turn1")
    finally:
        engine.close()
    other = torch.randint(0, 7, (5,), generator=gen).tolist()
    for tokens, least in ((system + other, 24), (system + question + answer + other, 56)):
        assert len(tokens) <= 64
        warm, hits = _logits(engine, tokens, "chat")
        cold, none = _logits(engine, tokens, f"cold-{len(tokens)}")
        assert none == 0 and hits >= least, (hits, none)
        if precision == "float32":
            assert torch.allclose(warm, cold, atol=1e-5), f"{len(tokens)} tokens: {(warm - cold).abs().max():.2e}"
        else:
            assert torch.equal(warm, cold), f"{precision}, {len(tokens)} tokens: {(warm - cold).abs().max():.2e}"


def prompt(i: int, shared: list[int], n: int = 6) -> list[int]:
    """A tiny-model prompt: a shared start, then one of its own with repeats (prompt lookup drafts)."""
    return shared + [(i + j * (i % 3 + 1)) % 7 for j in range(n)]


def single_run(model, prompt_ids, params: SamplingParams) -> list[int]:
    return generate(model, prompt_ids, params, make_drafter("pld", model), 5).token_ids


def run_request(engine: VerifierEngine, model, request_id: str, prompt_ids: list[int], params: SamplingParams,
                namespace: str = "") -> list[int]:
    """One request driven round by round as the single-process loop drives it (prompt lookup
    drafts), retrying its prefill while the verifier is full."""
    own_torch_threads(1)  # a client thread beside the engine's (many threads of several each: cpu_tuning)
    while True:
        try:
            first = engine.prefill(request_id, prompt_ids, params, namespace=namespace).next_token
            break
        except ResourceExhausted:
            time.sleep(0.005)
    tokens, drafter, rng = [first], make_drafter("pld", model), make_generator(params.seed, stream=1)
    while len(tokens) < params.max_tokens:
        budget = min(5, params.max_tokens - len(tokens) - 1)
        tree = DraftTree()
        if budget > 0:
            tree = drafter.propose(DraftRequest(prompt_ids + tokens, budget, params, rng)).truncated(budget)
        out = engine.verify(request_id, tree)
        tokens += (out.accepted + [out.bonus])[:params.max_tokens - len(tokens)]
    assert engine.release(request_id)
    return tokens


def burst_equals_one_process(engine: VerifierEngine, model, shared: list[int], params: list[SamplingParams]) -> dict:
    """Every request at once on `engine` (closed after): each one's tokens must be the
    single-process loop's on `model`; the engine's cache statistics after."""
    try:
        with ThreadPoolExecutor(len(params)) as pool:
            outputs = list(pool.map(lambda i: run_request(engine, model, f"r{i}", prompt(i, shared), params[i]),
                                    range(len(params))))
        stats = engine.kv_stats()
    finally:
        engine.close()
    for i, tokens in enumerate(outputs):
        assert tokens == single_run(model, prompt(i, shared), params[i]), f"request {i}"
    return stats


def test_a_burst_of_four_times_the_old_rows_completes_on_a_cache_too_small_for_it():
    """32 requests at once (today's default was 8 rows) sharing a prompt's first block, greedy
    and seeded sampling, on a cache that holds fewer than half of them at full length: every
    one completes with the single-process loop's tokens, requests are preempted and computed
    again (their shared and full blocks from the cache), and new ones wait while they do."""
    model = tiny_model(0)
    shared = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 6, 2, 6, 4, 3]
    n = 32
    params = [SamplingParams(max_tokens=30) if i % 2 else SamplingParams(max_tokens=30, temperature=1.0, seed=i)
              for i in range(n)]
    engine = VerifierEngine(model, max_len=64, max_batch_tokens=64, kv_blocks=24, kv_block_size=16,
                            batch_wait_s=0.01, threads=1)
    stats = burst_equals_one_process(engine, model, shared, params)
    assert stats["preemptions"] > 0 and stats["requests"] == 0 and stats["held_blocks"] == 0, stats
    assert stats["prefix_cache_hits"] >= 16 * (n - 1), stats  # every request after the first: the shared block
    metrics = {m.name: m for m in engine.metrics.registry.collect()}
    assert metrics["specserve_verifier_num_preemptions"].samples[0].value == stats["preemptions"]
    assert metrics["specserve_verifier_prefix_cache_hits"].samples[0].value == stats["prefix_cache_hits"]
    assert metrics["specserve_verifier_kv_cache_usage_perc"].samples[0].value == 0.0


def test_namespaces_do_not_share_blocks_through_the_engine():
    model = tiny_model(0)
    engine = VerifierEngine(model, max_len=64, max_batch_tokens=16, kv_blocks=32, kv_block_size=4)
    try:
        ids = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
        params = SamplingParams(max_tokens=4)
        a = engine.prefill("a", ids, params, namespace="tenant-a").next_token
        hits = engine.kv_stats()["prefix_cache_hits"]
        b = engine.prefill("b", ids, params, namespace="tenant-b").next_token
        assert engine.kv_stats()["prefix_cache_hits"] == hits == 0 and a == b
        held = {name: set(engine._requests[name].blocks.blocks) for name in ("a", "b")}
        assert not held["a"] & held["b"]
        engine.prefill("c", ids, params, namespace="tenant-a")
        assert engine.kv_stats()["prefix_cache_hits"] == 8  # tenant a's two full blocks
        with pytest.raises(Exception, match="namespace"):
            engine.prefill("d", ids, params, namespace="no spaces")
    finally:
        engine.close()


def test_a_request_too_long_for_the_cache_is_refused_at_the_start():
    with pytest.raises(ValueError, match="kv_blocks 4 holds 4 blocks of 16 tokens, fewer"):
        VerifierEngine(tiny_model(0), max_len=64, max_batch_tokens=16, kv_blocks=4, kv_block_size=16)


# ---- sampling across preemptions ---------------------------------------------------

SAMPLES = 1200  # 64 cells of the tiny vocabulary's token pairs: about 19 runs a cell


class PreemptingEngine(VerifierEngine):
    """Preempts every request before each pass: each round is verified on a cache computed
    again from the request's verified tokens."""

    def _make_room(self, ready):
        for request_id, state in list(self._requests.items()):
            if state.resident:
                self._preempt(request_id, state)
        return super()._make_room(ready)


def _preempted_counts(seeds: range, clients: int = 8) -> tuple[torch.Tensor, int, int]:
    """Unseeded runs through a PreemptingEngine (in a worker process), `clients` at once so that
    passes batch them, each run's random streams those of its seed: counts of (token 1, token 2),
    runs that drafted, preemptions."""
    import verifier_service.engine as engine_module
    from drafter_service.drafters import ModelDrafter
    from speculative import sampling
    from test_sampling_distribution import PROMPT

    torch.set_num_threads(1)
    target, draft_model = tiny_model(seed=0, logit_scale=0.5), tiny_model(seed=1, logit_scale=0.5)
    # the engine makes a request's verifier stream as it takes its prefill, one at a time: the
    # seeds of the prefills sent, one at a time, in the order it takes them
    streams, prefilling = [], threading.Lock()
    original = engine_module.make_generator
    engine_module.make_generator = lambda seed, device="cpu", stream=0, resumed=0: \
        sampling.make_generator(streams.pop(0), device, stream)
    engine = PreemptingEngine(target, max_len=64, max_batch_tokens=64, kv_blocks=64, kv_block_size=4,
                              batch_wait_s=0.002, threads=1)
    counts, drafted, counting = torch.zeros(TINY.vocab_size, TINY.vocab_size), [0], threading.Lock()

    def client(share: list[int]) -> None:
        own_torch_threads(1)
        drafter = ModelDrafter(draft_model, max_len=64)
        for seed in share:
            params, rng = SamplingParams(max_tokens=4, temperature=1.0), sampling.make_generator(seed, stream=1)
            request_id = f"r{seed}"
            with prefilling:
                streams.append(seed)
                tokens = [engine.prefill(request_id, PROMPT, params).next_token]
            first_drafted = None
            while len(tokens) < 3:
                tree = drafter.propose(DraftRequest(PROMPT + tokens, 2, params, rng))
                first_drafted = len(tree) > 0 if first_drafted is None else first_drafted
                out = engine.verify(request_id, tree)
                tokens += out.accepted + [out.bonus]
            engine.release(request_id)
            with counting:
                counts[tokens[1], tokens[2]] += 1
                drafted[0] += first_drafted

    try:
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, [list(seeds)[i::clients] for i in range(clients)]))
        preemptions = engine.kv_stats()["preemptions"]
    finally:
        engine.close()
        engine_module.make_generator = original
    return counts, drafted[0], preemptions


def preempted_jobs() -> list[tuple]:
    return [(_preempted_counts, seeds) for seeds in seed_shares(SAMPLES)]


def background_jobs(item) -> list[tuple]:
    """The calls this module's tests make of the worker processes: the runs across preemptions,
    Hugging Face's two-turn chats."""
    return {"test_sampling_keeps_the_targets_distribution_across_preemptions": preempted_jobs,
            "test_a_two_turn_chats_greedy_answers_are_hfs_with_the_second_turn_from_the_cache": oracle_jobs,
            }.get(item.originalname, list)()


def test_sampling_keeps_the_targets_distribution_across_preemptions(core_workers):
    """Speculative sampling (a model drafter's 2-token chains, rejection sampling) with every
    round's request preempted and computed again first: the second and third tokens still
    follow the target's joint distribution (chi-square, as tests/test_sampling_distribution.py)."""
    from test_sampling_distribution import ALPHA, chi_square_p, exact_drafted_joint

    counts, drafted, preemptions = map(sum, zip(*core_workers.results(preempted_jobs())))
    assert counts.sum() == SAMPLES and drafted > SAMPLES // 2 and preemptions >= SAMPLES
    expected = exact_drafted_joint(tiny_model(seed=0, logit_scale=0.5), SamplingParams(temperature=1.0))
    pvalue = chi_square_p(counts, expected)
    assert pvalue > ALPHA, f"sampled distribution across preemptions differs from the target's (p={pvalue:.2e})"


# ---- the oracle ----------------------------------------------------------------

CHATS = (0, 1)  # dev prompts whose two-turn chats are checked


def oracle_jobs() -> list[tuple]:
    from oracle import hf_greedy_turns

    return [(hf_greedy_turns, i) for i in CHATS]


def _greedy(engine: VerifierEngine, model, request_id: str, ids: list[int], eos: set[int], namespace: str,
            max_tokens: int) -> list[int]:
    """Greedy rounds drafted by prompt lookup until an end token or `max_tokens`."""
    params = SamplingParams(max_tokens=max_tokens)
    tokens, drafter = [engine.prefill(request_id, ids, params, namespace=namespace).next_token], make_drafter("pld", model)
    while len(tokens) < max_tokens and tokens[-1] not in eos:
        budget = min(5, max_tokens - len(tokens) - 1)
        tree = drafter.propose(DraftRequest(ids + tokens, budget, params)).truncated(budget) if budget > 0 \
            else DraftTree()
        out = engine.verify(request_id, tree)
        tokens += out.accepted + [out.bonus]
    engine.release(request_id)
    ends = [i for i, t in enumerate(tokens) if t in eos]
    return tokens[:ends[0] + 1] if ends else tokens[:max_tokens]


def test_a_two_turn_chats_greedy_answers_are_hfs_with_the_second_turn_from_the_cache(smollm2, hf_oracle):
    """Dev prompts as two-turn chats on the verifier: each turn's greedy answer is Hugging Face's
    (a difference only at a near-tie of HF's top two), and the second turn's prefill takes the
    first turn's blocks from the cache (the conversation so far, up to what the template
    writes differently after the answer)."""
    from oracle import FOLLOW_UP, MAX_TOKENS, PROMPTS, ids_near_tie_or_equal, turns_oracle

    model, tok = smollm2
    eos = set(tok.eos_token_ids or model.config.eos_token_ids)
    engine = VerifierEngine(model, max_len=1024, kv_cache_memory="256MiB")
    ties = []
    try:
        for i in CHATS:
            want1, logits1, answer, want2, logits2 = turns_oracle(hf_oracle, i)
            first = [{"role": "user", "content": PROMPTS[i][1]}]
            ids1 = tok.encode_chat(first)
            got1 = _greedy(engine, model, f"chat{i}-1", ids1, eos, f"chat{i}", MAX_TOKENS)
            ties.append(ids_near_tie_or_equal(want1, logits1, got1, f"prompt {i} turn 1"))
            ids2 = tok.encode_chat(first + [{"role": "assistant", "content": answer},
                                            {"role": "user", "content": FOLLOW_UP}])
            before = engine.kv_stats()
            got2 = _greedy(engine, model, f"chat{i}-2", ids2, eos, f"chat{i}", MAX_TOKENS)
            hits = engine.kv_stats()["prefix_cache_hits"] - before["prefix_cache_hits"]
            # the turn's prompt and what of the answer the template writes as generated
            assert hits >= len(ids1) // engine.block_size * engine.block_size > 0, (hits, len(ids1))
            ties.append(ids_near_tie_or_equal(want2, logits2, got2, f"prompt {i} turn 2"))
    finally:
        engine.close()
    ties = [tie for tie in ties if tie]
    if ties:
        import warnings

        warnings.warn("two-turn chats differ from HF only at near-ties: " + "; ".join(ties))


# ---- tensor-parallel ranks -------------------------------------------------------


def test_a_tensor_parallel_verifier_shares_prefixes_and_preempts_with_each_rank_holding_its_heads():
    """An engine on a 2-rank tiny target: each rank holds its KV heads' blocks, the block
    tables and the prefix index live on rank 0 and go with each forward, slot copies
    (accepted nodes compacted) are replayed; requests sharing a prefix and preempted on a small
    cache give the one-process tokens. (Across ranks the partial sums add in another order,
    so logits match one process to float32 rounding, not bit for bit; on one rank, bit for
    bit as above.)"""
    from test_tensor_parallel import TinyLoader
    from verifier_service import tp_group

    plain = TinyLoader(0)("cpu")
    shared = [3, 1, 4, 1, 5, 2, 6, 5]
    n = 6
    params = [SamplingParams(max_tokens=24) if i % 2 else SamplingParams(max_tokens=24, temperature=1.0, seed=i)
              for i in range(n)]
    with tp_group.LocalGroup(2, TinyLoader(0), TINY, tuning=None, threads=1) as group:
        engine = VerifierEngine(group.target, max_len=48, max_batch_tokens=16, kv_blocks=10, kv_block_size=8,
                                batch_wait_s=0.01, threads=1)
        stats = burst_equals_one_process(engine, plain, shared, params)
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] >= 8 * (n - 1), stats


def test_kv_cache_memory_is_a_share_or_bytes_and_anything_else_an_error_naming_it():
    from pydantic import ValidationError

    from verifier_service.settings import VerifierSettings, memory_bytes

    total = 10 * 2**30
    assert memory_bytes("0.1", total) == total // 10 and memory_bytes(0.5, total) == total // 2
    assert memory_bytes("4GiB", total) == 4 * 2**30 and memory_bytes("512MB", total) == 512 * 10**6
    assert memory_bytes(2e9, total) == 2 * 10**9 and memory_bytes("1", total) == total
    for bad in ("lots", "0", -1, True, "-2GiB"):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            memory_bytes(bad, total)
    with pytest.raises(ValidationError, match="kv_cache_memory"):
        VerifierSettings(kv_cache_memory="a lot")
    with pytest.raises(ValidationError, match="kv_block_size"):
        VerifierSettings(kv_block_size=0)
