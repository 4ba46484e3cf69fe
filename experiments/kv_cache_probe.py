"""What the paged KV cache's prefix caching and admission by memory buy the verifier engine
(verifier_service/engine.py), on the default model, side by side in one run:

- `ttft`: the time to the first token of an mt_bench conversation's second turn (the engine's
  prefill of the whole conversation so far) with the first turn's blocks cached, against the
  same prefill cold (another memory namespace, where the cache holds none of it);
- `shared`: concurrent clients whose prompts share a ~1,000-token system prompt, each
  prefilled and then decoded plainly for a few tokens, with prefix caching and without:
  prompt tokens computed, TTFT p50/p99, wall time and output tokens a second;
- `admission`: the most requests of a given length the cache admits at `kv_cache_memory`
  (the engine's own rule: a prompt's blocks and a block of headroom per request held),
  against the old fixed 8 rows.

    python experiments/kv_cache_probe.py [ttft shared admission] [--conversations 4] [--clients 16]

The machine may be shared: `ttft` alternates its two sides; `shared` runs one after the other
(`--off-first` swaps them, for a second run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from runtime import loading
from runtime.paged_kv import BlockPool, SequenceBlocks
from speculative.sampling import SamplingParams
from speculative.tree import DraftTree
from verifier_service.engine import VerifierEngine, device_memory
from verifier_service.settings import VerifierSettings, memory_bytes

DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "dev.jsonl"
SYSTEM = ("You are the support assistant of a company that sells garden tools. Answer politely, briefly and "
          "accurately. Never invent a product, a price or a policy. ")


def decode(engine: VerifierEngine, request_id: str, ids: list[int], tokens: int, namespace: str = "") -> list[int]:
    """Prefill, then plain greedy rounds on the verifier (no drafts): the output."""
    out = [engine.prefill(request_id, ids, SamplingParams(max_tokens=tokens), namespace=namespace).next_token]
    left = iter(range(tokens - 1))
    for verdict in engine.verify_rounds(request_id, DraftTree(), None,
                                        lambda _: DraftTree() if next(left, None) is not None else None):
        out += [*verdict.accepted, verdict.bonus]
    engine.release(request_id)
    return out[:tokens]


def timed_prefill(engine: VerifierEngine, request_id: str, ids: list[int], namespace: str) -> tuple[float, int]:
    hits = engine.kv_stats()["prefix_cache_hits"]
    start = time.perf_counter()
    engine.prefill(request_id, ids, SamplingParams(max_tokens=1), namespace=namespace)
    seconds = time.perf_counter() - start
    engine.release(request_id)
    return seconds, engine.kv_stats()["prefix_cache_hits"] - hits


def second_turns(model, tok, conversations: int, answer_tokens: int) -> None:
    chats = [q for q in map(json.loads, DEV.read_text().splitlines()) if len(q["turns"]) > 1][:conversations]
    engine = VerifierEngine(model, max_len=4096, kv_cache_memory="1GiB")
    rows = []
    try:
        for i, chat in enumerate(chats):
            first = [{"role": "user", "content": chat["turns"][0]}]
            answer = decode(engine, f"c{i}", tok.encode_chat(first), answer_tokens, namespace=f"chat{i}")
            ids = tok.encode_chat(first + [{"role": "assistant", "content": tok.decode(answer)},
                                           {"role": "user", "content": chat["turns"][1]}])
            warm, cold = [], []
            for repeat in range(3):  # alternating; the cold side in a namespace of its own each time
                for side, times in ((("chat%d" % i), warm), (f"cold{i}-{repeat}", cold))[::1 if repeat % 2 else -1]:
                    seconds, hits = timed_prefill(engine, f"t{i}", ids, side)
                    times.append((seconds, hits))
            rows.append((chat["question_id"], len(ids), min(warm)[1], min(s for s, _ in cold), min(s for s, _ in warm)))
    finally:
        engine.close()
    print(f"\n### TTFT of a second turn ({torch.get_num_threads()} torch threads; the fastest of 3 each, alternated)\n")
    print("| mt_bench question | prompt tokens | cached | cold ms | cached ms | speedup |")
    print("| --- | --- | --- | --- | --- | --- |")
    for qid, n, hits, cold, warm in rows:
        print(f"| {qid} | {n} | {hits} | {cold * 1e3:.0f} | {warm * 1e3:.0f} | {cold / warm:.1f}x |")


def shared_prompt(model, tok, clients: int, system_tokens: int, output_tokens: int,
                  order: tuple[bool, ...] = (True, False)) -> None:
    system = SYSTEM * (system_tokens // len(tok.encode(SYSTEM)) + 1)
    questions = [q["turns"][0] for q in map(json.loads, DEV.read_text().splitlines())][:clients]
    prompts = [tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    results = {}
    for caching in order:
        engine = VerifierEngine(model, max_len=4096, kv_cache_memory="2GiB", prefix_caching=caching)
        ttft = [0.0] * clients

        def client(i: int) -> int:
            start = time.perf_counter()
            first = engine.prefill(f"s{i}", prompts[i], SamplingParams(max_tokens=output_tokens)).next_token
            ttft[i] = time.perf_counter() - start
            left = iter(range(output_tokens - 1))
            n = 1
            for verdict in engine.verify_rounds(f"s{i}", DraftTree(), None,
                                                lambda _: DraftTree() if next(left, None) is not None else None):
                n += 1 + len(verdict.accepted)
            engine.release(f"s{i}")
            return n

        try:
            start = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                generated = sum(pool.map(client, range(clients)))
            wall = time.perf_counter() - start
            kv = engine.kv_stats()
        finally:
            engine.close()
        ttft.sort()
        results[caching] = (kv["prefix_cache_queries"] - kv["prefix_cache_hits"], kv["prefix_cache_hits"],
                            statistics.median(ttft), ttft[min(clients - 1, int(0.99 * clients))], wall,
                            generated / wall)
    n = len(prompts[0])
    print(f"\n### {clients} clients sharing a {n - len(tok.encode_chat([{'role': 'user', 'content': questions[0]}]))}"
          f"-token system prompt ({n}-token first prompt, {output_tokens} tokens each, "
          f"{torch.get_num_threads()} torch threads)\n")
    print("| prefix caching | prompt tokens computed | from the cache | TTFT p50 s | TTFT p99 s | wall s | tokens/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for caching, (computed, hits, p50, p99, wall, rate) in results.items():
        print(f"| {'on' if caching else 'off'} | {computed} | {hits} | {p50:.2f} | {p99:.2f} | {wall:.1f} | {rate:.1f} |")


def admitted(blocks: int, block_size: int, n: int) -> int:
    """Requests of `n` tokens the engine admits at once into `blocks` blocks: each its blocks,
    and a block of headroom for each request held (its rule for a prefill)."""
    pool, held = BlockPool(blocks, block_size), 0
    while True:
        seq = SequenceBlocks(pool)
        if seq.needed(n) + held > pool.available():
            return held
        seq.reserve(n)
        held += 1


def admission(model, memory: str, lengths: list[int], block_size: int) -> None:
    block = model.kv_block_bytes(block_size)
    total = memory_bytes(memory, device_memory(model.device))
    blocks = total // block
    # the old engine: max_batch 8 rows of max_len 4096 + max_batch_tokens 256 slots
    old_slots = 8 * (4096 + 256)
    old_blocks = old_slots * block // block_size // block
    print(f"\n### Requests held at once at kv_cache_memory {memory!r} ({total / 2**30:.2f} GiB here: {blocks} "
          f"blocks of {block_size} tokens, {block / 1024:.0f} KiB each) and at the old rows' memory "
          f"({old_slots * block // block_size / 2**30:.2f} GiB: 8 rows of 4,352 slots)\n")
    print(f"| request tokens (prompt and output) | at {memory!r} | at the old rows' memory | old fixed rows |")
    print("| --- | --- | --- | --- |")
    for n in lengths:
        print(f"| {n} | {admitted(blocks, block_size, n)} | {admitted(old_blocks, block_size, n)} | 8 |")


def admission_check(model, blocks: int, block_size: int, n: int) -> None:
    """The engine itself: distinct requests of `n` tokens prefilled one after another into a
    cache of `blocks` blocks until it refuses one; the count beside the rule's (`admitted`)."""
    from verifier_service.engine import ResourceExhausted

    engine = VerifierEngine(model, max_len=n + 64, max_batch_tokens=64, kv_blocks=blocks, kv_block_size=block_size)
    held = 0
    try:
        while True:
            ids = [(held * 7919 + j * 104729) % model.config.vocab_size for j in range(n)]  # no shared prefix
            try:
                engine.prefill(f"a{held}", ids, SamplingParams(max_tokens=1))
            except ResourceExhausted:
                break
            held += 1
    finally:
        engine.close()
    print(f"\n{blocks} blocks of {block_size}: the engine held {held} requests of {n} tokens before refusing "
          f"one; the rule says {admitted(blocks, block_size, n)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("parts", nargs="*", default=["ttft", "shared", "admission"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--memory", default=VerifierSettings().kv_cache_memory)
    p.add_argument("--off-first", action="store_true", help="shared: run without prefix caching first")
    p.add_argument("--check-blocks", type=int, default=344,
                   help="admission-check: the cache's blocks (a tenth of what 0.1 of the machine gave here)")
    args = p.parse_args()
    model, tok = loading.load(dtype=args.dtype)
    print(f"{args.dtype}, default model, {torch.get_num_threads()} torch threads")
    if "ttft" in args.parts:
        second_turns(model, tok, args.conversations, args.answer_tokens)
    if "shared" in args.parts:
        shared_prompt(model, tok, args.clients, args.system_tokens, args.output_tokens,
                      (False, True) if args.off_first else (True, False))
    if "admission-check" in args.parts:
        admission_check(model, args.check_blocks, VerifierSettings().kv_block_size, 256)
    if "admission" in args.parts:
        admission(model, args.memory, [256, 512, 1024, 4096], VerifierSettings().kv_block_size)


if __name__ == "__main__":
    main()
