"""Tensor-parallel targets (runtime/tp.py, verifier_service/tp_group.py): every rank a
spawned process in a gloo group, checked against the same model in one process."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from runtime import loading
from speculative.batching import VerifyItem, verify_batch
from runtime.errors import InvalidArgument
from runtime.model import attention_mask, causal_ancestors
from runtime.quantize import quantize, quantized_weights
from speculative.sampling import SamplingParams
from runtime.tp import TensorParallelTarget, check_tp, head_shard, serve_rank, shard_plan, shard_weights
from speculative.tree import DraftTree
from tiny import TINY, tiny_model
from verifier_service import tp_group

TOLERANCE = 1e-4  # float32: the ranks' partial sums add up in another order
# low precision, of the largest magnitude: each rank's partial sums round before they add up
RELATIVE = {"bfloat16": 0.03, "int8": 0.03, "int4": 0.03}
# int4's groups of 32 inputs: each rank's share of o's and down's inputs whole groups at 2 ranks
WIDE = replace(TINY, hidden_size=64, intermediate_size=128, head_dim=32)


@dataclass(frozen=True)
class TinyLoader:
    """The plain tiny model of `seed`, built alike in every process; `dtype` is the precision
    its ranks run (verifier_service.tp_group.load_shard), quantised from its float weights."""
    seed: int
    num_kv_heads: int = TINY.num_kv_heads
    logit_scale: float = 1.0
    dtype: str = "float32"
    wide: bool = False  # WIDE's widths, not TINY's

    def __call__(self, device: str):
        model = tiny_model(self.seed, self.logit_scale, num_kv_heads=self.num_kv_heads,
                           shape=WIDE if self.wide else TINY)
        return model.to(device, loading.parse_dtype(self.dtype))


def one_process(loader: TinyLoader):
    """The loader's model in its precision, as one process runs it (`loading.load`'s order)."""
    model = loader("cpu")
    return model if loader.dtype == "float32" else quantize(model, loader.dtype)


def scenario(model, prompts: list[list[int]], tree_tokens: list[list[int]]):
    """Two rows prefilled, a batched tree verification that rejects nodes (the trees branch:
    at most one of each level's siblings is kept), a row that takes 3 tokens and is rolled
    back, then the next pass of both rows; each row's tokens and the logits of each step,
    and a fresh prefill of each row's tokens for comparison. `model`: a Transformer or a
    rank-0 TensorParallelTarget. Returns (results, the cache, to keep it alive)."""
    out: dict[str, torch.Tensor | list] = {}
    cache = model.new_cache(48, batch=2)
    rows = []
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        logits = model(torch.tensor([prompt]), torch.arange(n)[None], cache.row_view(row),
                       attention_mask(0, causal_ancestors(n)))
        out[f"prefill{row}"] = logits[0]
        rows.append(list(prompt) + [int(logits[0, -1].argmax())])
    trees = [DraftTree(tokens, parents=[-1, -1, 0, 1]) for tokens in tree_tokens]
    scores: dict[int, torch.Tensor] = {}

    def keep_scores(row):
        return lambda tokens, s: scores.__setitem__(row, s)

    items = [VerifyItem(row, rows[row][-1], trees[row], SamplingParams(), torch.Generator(),
                        on_scores=keep_scores(row)) for row in range(2)]
    out["accepted"] = []
    for row, verdict in enumerate(verify_batch(model, cache, items)):
        path, bonus = verdict.path, verdict.bonus
        out[f"tree{row}"] = scores[row]
        out["accepted"].append(len(path))
        rows[row] += [trees[row].tokens[node] for node in path] + [bonus]
    start = cache.lengths[1]  # row 1: three tokens in, then rolled back
    model(torch.tensor([[1, 2, 3]]), torch.arange(start, start + 3)[None], cache.row_view(1),
          attention_mask(start, causal_ancestors(3)))
    cache.rollback(start, row=1)
    items = [VerifyItem(row, rows[row][-1], DraftTree(), SamplingParams(), torch.Generator(),
                        on_scores=keep_scores(row)) for row in range(2)]
    for row, verdict in enumerate(verify_batch(model, cache, items)):
        bonus = verdict.bonus
        out[f"next{row}"] = scores[row][-1]
        rows[row].append(bonus)
    for row in range(2):
        fresh = model.new_cache(48)
        n = len(rows[row]) - 1  # up to the token the next pass scored
        out[f"fresh{row}"] = model(torch.tensor([rows[row][:n]]), torch.arange(n)[None], fresh,
                                   attention_mask(0, causal_ancestors(n)))[0, -1]
    out["rows"] = rows
    return out, cache


def _rank_main(rank: int, world: int, store_dir: str, loaders, prompts, tree_tokens, out_dir: str,
               check_shards: bool) -> None:
    """One rank: for each of `loaders` in turn, its shard runs `scenario` (rank 0) or replays it;
    with `check_shards` the other ranks compare their KV shards with a one-process run's."""
    torch.set_num_threads(1)
    tp_group.join_group(rank, world, store_dir, "cpu")
    try:
        for i, loader in enumerate(loaders):
            model = tp_group.load_shard(loader, rank, world, "cpu", None)
            tp_group.COUNTS.reset()
            if rank == 0:
                target = TensorParallelTarget(model, tp_group.send)
                results, cache = scenario(target, prompts, tree_tokens)
                target.stop()
                results["forwards"] = tp_group.COUNTS.broadcasts - 1  # one message a forward, then stop
            else:
                caches = serve_rank(model, tp_group.receive)
                results = _shard_check(model, caches[0], loader, prompts, tree_tokens) if check_shards else {}
            results["all_reduces"] = tp_group.COUNTS.all_reduces
            torch.save(results, Path(out_dir) / f"model{i}-rank{rank}.pt")
    finally:
        tp_group.leave_group()


def _shard_check(model, mine, loader, prompts, tree_tokens) -> dict:
    """How this rank's shard of rank 0's first cache, after every rollback and compaction,
    differs from the one-process cache's KV heads it should hold."""
    reference, ref_cache = scenario(one_process(loader), prompts, tree_tokens)
    _, kv = head_shard(model.config, torch.distributed.get_rank(), torch.distributed.get_world_size())
    lengths = ref_cache.lengths
    error = max(float((mine.k[:, row, :, :n] - ref_cache.k[:, row, kv.start:kv.stop, :n]).abs().max())
                + float((mine.v[:, row, :, :n] - ref_cache.v[:, row, kv.start:kv.stop, :n]).abs().max())
                for row, n in enumerate(lengths))
    scale = max(float(ref_cache.k[:, row, :, :n].abs().max()) + float(ref_cache.v[:, row, :, :n].abs().max())
                for row, n in enumerate(lengths))
    return {"lengths": mine.lengths == lengths, "kv_error": error, "kv_scale": scale}


def run_ranks(world: int, loaders, prompts, tree_tokens, tmp_path: Path, check_shards: bool) -> list[list[dict]]:
    """Each loader's results, by rank."""
    store = tmp_path / "store"
    store.mkdir()
    mp.spawn(_rank_main, args=(world, str(store), loaders, prompts, tree_tokens, str(tmp_path), check_shards),
             nprocs=world)
    return [[torch.load(tmp_path / f"model{i}-rank{r}.pt") for r in range(world)] for i in range(len(loaders))]


def close(got: torch.Tensor, want: torch.Tensor, dtype: str) -> bool:
    return error(got, want) <= tolerance(want, dtype)


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max())


def tolerance(want: torch.Tensor | float, dtype: str) -> float:
    """TOLERANCE in float32; in low precision RELATIVE[dtype] of the largest magnitude."""
    if dtype == "float32":
        return TOLERANCE
    return RELATIVE[dtype] * (want if isinstance(want, float) else float(want.float().abs().max()))


def check_against_one_process(ranks: list[dict], want: dict, num_layers: int, check_shards: bool,
                              dtype: str = "float32", row_exact: bool = False) -> None:
    """`dtype` sets the tolerance against one process; `row_exact`: the layers give a row the
    same result whatever rows are beside it (low precision), so a row rolled back scores
    exactly as if prefilled afresh."""
    got = ranks[0]
    assert got["rows"] == want["rows"]
    assert min(got["accepted"]) < 2, "a tree had nodes rejected"  # two levels of two siblings
    for key in ("prefill0", "prefill1", "tree0", "tree1", "next0", "next1"):
        assert close(got[key], want[key], dtype), (key, error(got[key], want[key]))
    for row in range(2):  # after rejected nodes and a rollback: as if the row were prefilled afresh
        assert torch.equal(got[f"next{row}"], got[f"fresh{row}"]) if row_exact else \
            close(got[f"next{row}"], got[f"fresh{row}"], "float32")
        assert close(got[f"next{row}"], want[f"fresh{row}"], dtype)
    for rank in ranks[1:] if check_shards else []:  # each KV shard is the one-process cache's heads
        assert rank["lengths"] and rank["kv_error"] <= tolerance(rank["kv_scale"], dtype), rank
    for rank in ranks:  # two all-reduces per decoder layer per forward, on every rank
        assert rank["all_reduces"] == 2 * num_layers * got["forwards"]


def test_tiny_models_logits_match_one_process_at_two_ranks(tmp_path):
    prompts, trees = [[1, 5, 2, 7, 3, 3, 0], [4, 4, 6, 1, 2]], [[0, 1, 2, 3], [5, 6, 7, 0]]
    # 2 KV heads split, one a rank; 1 KV head replicated on both
    loaders = [TinyLoader(3), TinyLoader(4, num_kv_heads=1)]
    results = run_ranks(2, loaders, prompts, trees, tmp_path, check_shards=True)
    for loader, ranks in zip(loaders, results):
        want, _ = scenario(loader("cpu"), prompts, trees)
        check_against_one_process(ranks, want, TINY.num_layers, check_shards=True)


def test_tiny_models_in_each_precision_match_one_process_at_two_ranks(tmp_path):
    """bfloat16, int8 and int4 ranks: batched trees, rejected nodes and a rollback as in one
    process in that precision, within its rounding; a row rolled back scores exactly as if
    prefilled afresh (each precision's kernels are row-exact, as in one process)."""
    prompts, trees = [[1, 5, 2, 7, 3, 3, 0], [4, 4, 6, 1, 2]], [[0, 1, 2, 3], [5, 6, 7, 0]]
    loaders = [TinyLoader(seed, dtype=dtype, wide=True) for seed, dtype in ((3, "bfloat16"), (5, "int8"),
                                                                             (6, "int4"))]
    results = run_ranks(2, loaders, prompts, trees, tmp_path, check_shards=True)
    for loader, ranks in zip(loaders, results):
        model = one_process(loader)
        want, _ = scenario(model, prompts, trees)
        # specserve's own int products compute in float32: only the order of the sums differs
        dtype = "float32" if getattr(model.layers[0].attn.o, "native", False) else loader.dtype
        check_against_one_process(ranks, want, TINY.num_layers, check_shards=True, dtype=dtype, row_exact=True)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_each_rank_holds_its_slice_of_the_one_process_weights(dtype):
    """The ranks' int weights, put back together where `shard_plan` says each slice lies, are
    the whole model's as one process quantises it: int4 groups kept whole, and each int8
    row's one scale over its whole row where ranks split its inputs."""
    def weight(tensors):  # w = scale * q (int8), w = d * q + m per group of 32 (int4)
        q = tensors[0].float()
        if dtype == "int8":
            return q * tensors[1][:, None]
        d, m = tensors[1], tensors[2]
        return (q.unflatten(1, (-1, 32)) * d[..., None] + m[..., None]).flatten(1)

    whole = quantized_weights(TinyLoader(6, wide=True)("cpu"), dtype)
    for world in (2, 4):
        for name, tensors in whole.items():
            part, again = name.split(".", 2)[2], torch.full_like(weight(tensors), float("nan"))
            for rank in range(world):
                how, index = shard_plan(WIDE, rank, world)[part]
                piece = weight(shard_weights(WIDE, {name: tensors}, rank, world)[name])
                if how == "rows":
                    again[index] = piece
                else:
                    again[:, index] = piece
            assert torch.equal(again, weight(tensors)), (world, name)


def test_killed_rank_fails_the_pass_and_the_request_resumes_on_a_new_group():
    """A rank SIGKILLed mid-request: the pass fails at once (no hang); a new group (what a
    served verifier's restart builds, cluster/tp_ranks.py) resumes the request from its
    checkpoint, and the output is the one-process output. (Before the default-model tests:
    this process can be rank 0 of one group at a time, and theirs lives to the module's end.)"""
    import os
    import signal

    import grpc

    from cluster.state import EmbeddedStateStore
    from speculative.sampling import SamplingParams
    from test_verifier_service import Remote, prompt, served, single_run
    from verifier_service.engine import VerifierEngine

    plain, params, ids = TinyLoader(0)("cpu"), SamplingParams(max_tokens=30), prompt(4, 12)
    store = EmbeddedStateStore()
    with tp_group.LocalGroup(2, TinyLoader(0), TINY, tuning=None) as group:
        with served(VerifierEngine(group.target, max_len=60, checkpoints=store)) as stub:
            remote = Remote(stub, "r", ids, params, plain)
            remote.step()
            os.kill(group.processes[0].pid, signal.SIGKILL)
            group.processes[0].join()
            with pytest.raises(grpc.RpcError):
                remote.step()
    assert 0 < len(remote.tokens) < params.max_tokens
    with tp_group.LocalGroup(2, TinyLoader(0), TINY, tuning=None) as group:
        with served(VerifierEngine(group.target, max_len=60, checkpoints=store)) as stub:
            remote.stub = stub
            assert remote.run() == single_run(plain, ids, params)


@pytest.fixture(scope="module")
def default_group():
    """The default model on 3 ranks, rank 0 in this process, untuned (the one-process
    reference is too): one group for this module's default-model tests, for time."""
    from runtime import loading

    loader = tp_group.checkpoint_loader(None)
    tokenizer, cfg = loading.load_tokenizer(loader.directory)
    with tp_group.LocalGroup(3, loader, cfg, tuning=None) as group:
        yield group, loader, tokenizer


def test_default_model_at_three_ranks_matches_one_process(default_group):
    from conftest import dev_prompts

    group, loader, tokenizer = default_group
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}])[:24] for _, q in dev_prompts(2)]
    trees = [[1024, 28, 30, 2000], [17, 3000, 9, 45]]
    want, _ = scenario(loader("cpu"), prompts, trees)
    tp_group.COUNTS.reset()
    got, _ = scenario(group.target, prompts, trees)
    got["forwards"], got["all_reduces"] = tp_group.COUNTS.broadcasts, tp_group.COUNTS.all_reduces
    check_against_one_process([got], want, group.target.config.num_layers, check_shards=False)


def test_rank_counts_that_do_not_split_the_model_are_refused():
    from dataclasses import replace

    default = replace(TINY, num_heads=9, num_kv_heads=3, intermediate_size=1536)  # SmolLM2-135M's heads
    check_tp(default, 3)
    with pytest.raises(InvalidArgument, match="tensor_parallel: 2 ranks cannot split") as e:
        check_tp(default, 2)
    assert "rank counts that fit: 1, 3" in str(e.value)  # 9 would split the heads, not the MLP
    check_tp(replace(TINY, num_kv_heads=1), 4)  # one query head a rank, the KV head on every rank
    with pytest.raises(InvalidArgument, match="tensor_parallel"):
        check_tp(TINY, 3)
    with pytest.raises(InvalidArgument, match="tensor_parallel"):
        check_tp(TINY, 0)
    # int4 also needs each rank's inputs of o and down in whole groups of 32
    tp_group.check_precision(replace(default, head_dim=64), 3, "int4")  # 192 and 512 inputs a rank
    tp_group.check_precision(TINY, 2, "int8")
    with pytest.raises(InvalidArgument, match="tensor_parallel: 2 ranks give each rank 16 inputs of attn.o, not "
                                              "whole groups of 32"):
        tp_group.check_precision(TINY, 2, "int4")


GENERATED = 24  # tokens: short generations, the oracle's first ones


def test_generate_tensor_parallel_3_matches_hf(hf_oracle, default_group):
    """`specserve generate --tensor-parallel 3` (CPU-tuned ranks, a drafter's trees) and a
    3-rank engine driving the layer-skip drafter on the target's own sharded layers, and the
    feature-level head (`eagle`) on the 3-rank target's features."""
    import json
    import subprocess
    import sys

    from cluster.local import LocalEngine, Request
    from oracle import PROMPTS, near_tie_or_equal, oracle
    from speculative.sampling import SamplingParams

    def check(i: int, got: list[int], label: str) -> None:
        want, _ = oracle(hf_oracle, i)
        assert len(got) == GENERATED
        near_tie_or_equal(hf_oracle, i, got + want[GENERATED:], label)  # the oracle runs longer

    run = subprocess.run([sys.executable, "-m", "commands.cli", "generate", "--tensor-parallel", "3", "--chat",
                          "--json", "--prompt", PROMPTS[0][1], "--max-tokens", str(GENERATED), "--drafter", "pld"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    check(0, json.loads(run.stdout)["token_ids"], "generate --tensor-parallel 3")

    group, _, tokenizer = default_group
    result = LocalEngine(group.target, tokenizer).run(Request(
        PROMPTS[1][1], chat=True, params=SamplingParams(max_tokens=GENERATED), drafter="layerskip", draft_length=3))
    assert result.draft_tokens > 0
    check(1, result.token_ids, "layerskip on 3 ranks")
    # the feature-level head, its features captured on rank 0 (the residual stream is whole there)
    result = LocalEngine(group.target, tokenizer).run(Request(
        PROMPTS[2][1], chat=True, params=SamplingParams(max_tokens=GENERATED), drafter="eagle", draft_length=4,
        tree_budget=8))
    assert result.accepted_draft_tokens > 0
    check(2, result.token_ids, "eagle on 3 ranks")


def test_served_tensor_parallel_verifier_matches_hf(hf_oracle, default_group):
    """A VerifierEngine on a 3-rank target behind gRPC, driven round by round with prompt
    lookup drafts (as a router drives it), two requests at once sharing its passes."""
    from concurrent.futures import ThreadPoolExecutor

    from oracle import PROMPTS, near_tie_or_equal, oracle
    from speculative.sampling import SamplingParams
    from test_verifier_service import Remote, served
    from verifier_service.engine import VerifierEngine

    group, _, tokenizer = default_group
    eos = tokenizer.eos_token_ids or group.target.config.eos_token_ids
    with served(VerifierEngine(group.target, max_batch=2, max_len=512)) as stub:
        def run(i: int) -> list[int]:
            ids = tokenizer.encode_chat([{"role": "user", "content": PROMPTS[i][1]}])
            return Remote(stub, f"r{i}", ids, SamplingParams(max_tokens=GENERATED), group.target, eos).run()

        with ThreadPoolExecutor(2) as pool:
            outputs = list(pool.map(run, [2, 3]))
    for i, got in zip([2, 3], outputs):
        want, _ = oracle(hf_oracle, i)
        near_tie_or_equal(hf_oracle, i, got + want[len(got):], f"served 3-rank verifier, prompt {i}")


def test_served_tensor_parallel_verifier_drafts_eagle_in_its_decode_rounds(hf_oracle, default_group):
    """Placement "verifier" on a 3-rank target: prefilled with its eagle head (the features
    captured on rank 0), the verifier drafts every Decode round itself, and the tokens are
    Hugging Face's."""
    from oracle import PROMPTS, near_tie_or_equal, oracle
    from protos import specserve_pb2 as pb
    from protos.convert import params_to_pb
    from test_verifier_service import served
    from verifier_service.engine import VerifierEngine

    group, _, tokenizer = default_group
    eos = list(tokenizer.eos_token_ids or group.target.config.eos_token_ids)
    i, params = 4, SamplingParams(max_tokens=GENERATED)
    ids = tokenizer.encode_chat([{"role": "user", "content": PROMPTS[i][1]}])
    with served(VerifierEngine(group.target, max_batch=2, max_len=512)) as stub:
        first = stub.Prefill(pb.VerifierPrefillRequest(
            request_id="tp-eagle", token_ids=ids, sampling=params_to_pb(params), max_len=len(ids) + GENERATED + 16,
            verifier_drafter="eagle"), timeout=300)
        got = [first.next_token]
        rounds = list(stub.Decode(pb.DecodeRequest(request_id="tp-eagle", token_ids=ids + got, drafter="eagle",
                                                   draft_length=4, max_nodes=8, max_tokens=GENERATED - 1,
                                                   eos_token_ids=eos), timeout=300))
    assert rounds and not any(r.state_lost for r in rounds)
    for r in rounds:
        got += [*r.accepted, r.bonus]
    assert sum(r.drafted for r in rounds) > 0 and sum(len(r.accepted) for r in rounds) > 0, "eagle drafted nothing"
    assert len(got) <= GENERATED and len(rounds) < len(got)
    want, _ = oracle(hf_oracle, i)
    near_tie_or_equal(hf_oracle, i, got + want[len(got):], "eagle Decode rounds on a 3-rank verifier")


PRECISION_TOKENS = 16
# every kind of drafter: model-free, the target's own (sharded) layers, and a fused tree with a small model
TP_DRAFTERS = [("pld", None), ("suffix", None), ("layerskip", None), ("pld+suffix+small-general", 8)]


def _precision_rank(rank: int, world: int, store_dir: str, dtype: str, activations: str, prompts: list[list[int]],
                    out: str) -> None:
    """One rank of the default model in `dtype`, CPU-tuned as served but for the int products'
    `activations`; rank 0 decodes each prompt plainly and with each of TP_DRAFTERS: their
    token ids, and the tokens they accepted."""
    from drafter_service.registry import make_drafter
    from runtime.cpu_tuning import CpuTuning
    from speculative.decoding import generate

    torch.set_num_threads(1)
    tp_group.join_group(rank, world, store_dir, "cpu")
    try:
        model = tp_group.load_shard(tp_group.checkpoint_loader(None, dtype), rank, world, "cpu",
                                    CpuTuning(int_activations=activations))
        if rank:
            serve_rank(model, tp_group.receive)
            return
        target, params = TensorParallelTarget(model, tp_group.send), SamplingParams(max_tokens=PRECISION_TOKENS)
        results = {"native": bool(getattr(model.layers[0].attn.o, "native", False))}
        for i, ids in enumerate(prompts):
            results[(i, "plain")] = (generate(target, ids, params).token_ids, 0)
            for name, budget in TP_DRAFTERS:
                drafter = make_drafter(name, target, namespace=f"tp-{dtype}-{name}")
                r = generate(target, ids, params, drafter, 2 if name == "layerskip" else 5, tree_budget=budget)
                results[(i, name)] = (r.token_ids, r.accepted_draft_tokens)
        target.stop()
        torch.save(results, out)
    finally:
        tp_group.leave_group()


@pytest.mark.parametrize("dtype,activations", [("int4", "int8"), ("int4", "float32")])
def test_greedy_speculation_on_a_low_precision_tensor_parallel_target_equals_its_plain_decoding(
        dtype, activations, smollm2, tmp_path):
    """The lossless contract in a precision holds on 3 ranks: every drafter's output is the
    3-rank target's plain decoding in that precision, token for token. With the int products
    on float32 activations (specserve's own), that is also one process's plain decoding; on
    8-bit ones (the default) it need not be: the ranks' partial sums add in another order, and
    a last-bit difference in a layer's input can round an activation to the next 8-bit code."""
    from conftest import dev_prompts
    from speculative.decoding import generate

    _, tokenizer = smollm2
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for _, q in dev_prompts(2)]
    (tmp_path / "store").mkdir()
    out = tmp_path / "results.pt"
    mp.spawn(_precision_rank, args=(3, str(tmp_path / "store"), dtype, activations, prompts, str(out)), nprocs=3)
    results = torch.load(out)
    accepted = dict.fromkeys((name for name, _ in TP_DRAFTERS), 0)
    for i in range(len(prompts)):
        plain, _ = results[(i, "plain")]
        assert len(plain) == PRECISION_TOKENS
        for name, _ in TP_DRAFTERS:
            tokens, kept = results[(i, name)]
            assert tokens == plain, f"{dtype}, {name}, prompt {i}"
            accepted[name] += kept
    assert all(accepted[name] for name in ("layerskip", "pld+suffix+small-general")), accepted
    if results["native"] and activations == "float32":
        from runtime.cpu_tuning import CpuTuning

        one, _ = loading.load(dtype=dtype, cpu_tuning=CpuTuning(int_activations=activations))
        params = SamplingParams(max_tokens=PRECISION_TOKENS)
        assert [results[(i, "plain")][0] for i in range(len(prompts))] == \
            [generate(one, ids, params).token_ids for ids in prompts]


SAMPLED_RUNS = 2_000
SAMPLING_GROUPS = 2  # 2-rank groups sampling side by side: the runs wait on gloo's loopback sockets


def _sampling_rank(index: int, world: int, store_dirs: list[str], out_dir: str) -> None:
    """Process `index` is rank index % world of group index // world; each group's rank 0
    samples its share of SAMPLED_RUNS unseeded runs of the distribution test's "chain" case
    (a 2-token model draft at temperature 1) on its 2-rank target: counts of tokens 1 and 2."""
    import speculative.decoding as decoding
    import speculative.sampling as sampling
    from test_sampling_distribution import CASES, PROMPT

    group, rank = divmod(index, world)
    torch.set_num_threads(1)
    tp_group.join_group(rank, world, store_dirs[group], "cpu")
    try:
        model = tp_group.load_shard(TinyLoader(0, logit_scale=0.5), rank, world, "cpu", None)
        if rank:
            serve_rank(model, tp_group.receive)
            return
        target = TensorParallelTarget(model, tp_group.send)
        make, params, draft_length = CASES["chain"]
        drafter_model = tiny_model(seed=1, logit_scale=0.5)
        run = {"seed": 0}  # each run's random streams come from its number, as in the distribution test
        decoding.make_generator = lambda _, device="cpu", stream=0: sampling.make_generator(run["seed"], device, stream)
        counts, drafted = torch.zeros(TINY.vocab_size, TINY.vocab_size), 0
        for seed in range(group, SAMPLED_RUNS, SAMPLING_GROUPS):
            run["seed"] = seed
            result = decoding.generate(target, PROMPT, SamplingParams(max_tokens=draft_length + 2, temperature=1.0),
                                       make(drafter_model), draft_length)
            counts[result.token_ids[1], result.token_ids[2]] += 1
            drafted += result.draft_tokens > 0
        target.stop()
        torch.save({"counts": counts, "drafted": drafted}, Path(out_dir) / f"sampled-{group}.pt")
    finally:
        tp_group.leave_group()


def test_sampling_distribution_holds_on_a_tensor_parallel_target(tmp_path):
    from test_sampling_distribution import ALPHA, CASES, chi_square_p, exact_drafted_joint

    stores = [tmp_path / f"store-{group}" for group in range(SAMPLING_GROUPS)]
    for store in stores:
        store.mkdir()
    mp.spawn(_sampling_rank, args=(2, [str(s) for s in stores], str(tmp_path)), nprocs=2 * SAMPLING_GROUPS)
    parts = [torch.load(tmp_path / f"sampled-{group}.pt") for group in range(SAMPLING_GROUPS)]
    sampled = {"counts": sum(p["counts"] for p in parts), "drafted": sum(p["drafted"] for p in parts)}
    assert sampled["drafted"] == SAMPLED_RUNS  # a model drafter always drafts
    expected = exact_drafted_joint(TinyLoader(0, logit_scale=0.5)("cpu"), CASES["chain"][1])
    pvalue = chi_square_p(sampled["counts"], expected)
    assert pvalue > ALPHA, f"sampled distribution differs from the target's (p={pvalue:.2e})"
