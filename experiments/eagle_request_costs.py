"""What an eagle request costs the verifier beside a plain one, drafting or not.

A request with an eagle head on the verifier (`[router] eagle_placement = "verifier"`)
asks every pass for the target's features of three layers, feeds them to its head,
prefills the head over the prompt, and takes no cached prefix (a cached position has no
forward, so no features). This times each on the default target and the shipped head, one
request alone, medians of `--repeats`:

- the prompt's prefill: plain with the prefix cached (the same prompt again), plain with
  the prefix cache off, and capturing the features;
- the head's start: its fused features of the prompt, and its first sync over them;
- a one-row pass verifying the bonus token alone, plain against capturing, and feeding
  the captured features to the head;
- the head's drafting on the verifier by depth, as a chain and within 16 nodes.

    python experiments/eagle_request_costs.py --question 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from cluster.local import set_cpu_threads
from runtime import loading
from speculative.sampling import SamplingParams
from speculative.tree import DraftTree
from verifier_service.drafting import VerifierDrafting
from verifier_service.engine import VerifierEngine

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "dev.jsonl"


def median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", default=str(QUESTIONS))
    parser.add_argument("--question", type=int, default=40, help="which dev question's first turn is the prompt")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--passes", type=int, default=30)
    args = parser.parse_args()

    set_cpu_threads()
    model, tokenizer = loading.load()
    questions = [json.loads(line) for line in open(args.questions)]
    prompt = tokenizer.encode_chat([{"role": "user", "content": questions[args.question]["turns"][0]}])
    engine = VerifierEngine(model, max_batch=4, max_len=2048)
    drafting = VerifierDrafting(engine.vocab_size, target=model)
    layers = list(drafting.eagle_layers("eagle"))
    params = SamplingParams(max_tokens=128)
    ids = iter(range(10**9))
    print(f"prompt: {len(prompt)} tokens (dev question {args.question})")

    def prefill(capture):
        request_id = f"r{next(ids)}"
        return request_id, engine.prefill(request_id, prompt, params, 130, 0, 0, None, "default", capture)

    def prefilled_and_released(capture):
        def run():
            request_id, _ = prefill(capture)
            engine.release(request_id)
        return run

    for capture in (None, layers):  # warm-up
        prefilled_and_released(capture)()
    print(f"prefill, plain, prefix cached: {median_ms(prefilled_and_released(None), args.repeats):.1f} ms")
    engine.prefix_caching = False
    print(f"prefill, plain, no prefix cache: {median_ms(prefilled_and_released(None), args.repeats):.1f} ms")
    engine.prefix_caching = True
    print(f"prefill, capturing features: {median_ms(prefilled_and_released(layers), args.repeats):.1f} ms")

    request_id, out = prefill(layers)
    context = prompt + [out.next_token]

    def start():
        drafting.start_eagle(request_id, "eagle", params, 0, out.features)

    def start_and_sync():
        start()
        drafting.draft("eagle", request_id, "default", context, 1, 1, params)

    print(f"head start (fused prompt features): {median_ms(start, args.repeats):.1f} ms")
    print(f"head start and a one-token draft (its sync over the prompt): "
          f"{median_ms(start_and_sync, args.repeats):.1f} ms")
    for depth in (1, 2, 3, 5):
        for nodes in (depth, 16):
            drafted = len(drafting.draft("eagle", request_id, "default", context, depth, nodes, params))
            ms = median_ms(lambda: drafting.draft("eagle", request_id, "default", context, depth, nodes, params),
                           args.repeats)
            print(f"head draft, depth {depth}, at most {nodes} nodes: {ms:.1f} ms ({drafted} nodes)")
    engine.release(request_id)
    drafting.release(request_id)

    def passes(capture) -> tuple[float, float]:
        request_id, out = prefill(capture)
        if capture:
            drafting.start_eagle(request_id, "eagle", params, 0, out.features)
        verify, feed = [], []
        for _ in range(args.passes):
            started = time.perf_counter()
            verdict = engine.verify(request_id, DraftTree(), None, None, 0, capture)
            verified = time.perf_counter()
            if capture:
                drafting.take_features(request_id, verdict.features)
            verify.append(verified - started)
            feed.append(time.perf_counter() - verified)
        engine.release(request_id)
        drafting.release(request_id)
        return statistics.median(verify) * 1e3, statistics.median(feed) * 1e3

    for _ in range(2):
        plain, (captured, fed) = passes(None)[0], passes(layers)
        print(f"one-row pass: plain {plain:.1f} ms, capturing {captured:.1f} ms, "
              f"features to the head {fed:.2f} ms")


if __name__ == "__main__":
    main()
