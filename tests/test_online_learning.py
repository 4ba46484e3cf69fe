"""Online learning (drafter_service/learner.py): drafters swapped between rounds change no
output, the learner keeps to its buffer and CPU settings, and a checkpoint that does worse
on the held-aside slice is not published."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import speculative.decoding as decoding
import speculative.sampling as sampling
from cluster.state import EmbeddedStateStore
from core_workers import seed_shares
from drafter_service.checkpoint import load_drafter, save_drafter
from drafter_service.drafters import ModelDrafter
from drafter_service.learner import Learner, OnlineLearning
from drafter_service.learning_drafter import LearningDrafter
from drafter_service.metrics import LearnerMetrics
from drafter_service.online_buffer import ReplayBuffer, window_item
from drafter_service.pool import DrafterPool
from drafter_service.published import PublishedDrafters
from drafter_service.settings import LearnerSettings
from oracle import MAX_TOKENS, PROMPTS, near_tie_or_equal
from speculative.drafter_kinds import Abilities, drafter_path
from speculative.sampling import SamplingParams
from test_sampling_distribution import PROMPT, chi_square_p, exact_pair
from tiny import TINY, tiny_model


def _published(tmp_path: Path) -> tuple[PublishedDrafters, EmbeddedStateStore]:
    store = EmbeddedStateStore()
    return PublishedDrafters(tmp_path / "published", store, refresh_s=0.0), store


class PoolDriver:
    """Drives one request of a DrafterPool as the router does: the newly verified tokens and
    the target's scores since the last call go with each Propose."""

    abilities = Abilities(learns_from_target=True)

    def __init__(self, pool: DrafterPool, kind: str, prompt: list[int], params: SamplingParams):
        self.pool, self.synced = pool, len(prompt)
        pool.prefill("r", kind, prompt, params, domain="qa")
        self.observed: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []

    def observe(self, tokens, ids, probs) -> None:
        self.observed.append((list(tokens), ids, probs))

    def propose(self, request: decoding.DraftRequest):
        observed = None
        if self.observed:
            observed = ([t for o in self.observed for t in o[0]], torch.cat([o[1] for o in self.observed]),
                        torch.cat([o[2] for o in self.observed]))
        context = list(request.context)
        tree = self.pool.propose("r", self.synced, context[self.synced:], request.depth,
                                 max_nodes=request.max_nodes, observed=observed)
        self.synced, self.observed = len(context), []
        return tree


def _perturbed_general() -> tuple[torch.nn.Module, list[int], dict]:
    """small-general with its layers' weights scrambled: a version that drafts differently."""
    model, vocab_ids, info = load_drafter(drafter_path("small-general"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers" in name and p.dim() == 2:
                p.add_(torch.randn_like(p) * p.std())
    return model, vocab_ids, info


def test_swap_mid_stream_changes_no_greedy_output(smollm2, hf_oracle, tmp_path):
    """A pool's small drafter swapped for a published version in the middle of a request
    (and a request drafted by that version throughout) gives Hugging Face's output."""
    target, tokenizer = smollm2
    published, store = _published(tmp_path)
    learning = OnlineLearning(LearnerSettings(enabled=True), published, target.config.vocab_size)
    pool = DrafterPool(target, kinds=("small-general",), learning=learning)
    prompt = tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0][1]}])
    new_model, vocab_ids, info = _perturbed_general()
    swapped_at: list[int] = []

    def publish_midway(tokens: list[int]) -> None:
        nonlocal seen
        seen += len(tokens)
        if not swapped_at and seen >= MAX_TOKENS // 2:
            published.publish("small-general", new_model, vocab_ids, info)
            swapped_at.append(seen)

    outputs, versions = [], []
    for _ in range(2):  # across the swap, then after it
        seen = 0
        driver = PoolDriver(pool, "small-general", prompt, SamplingParams(max_tokens=MAX_TOKENS))
        result = decoding.generate(target, prompt, SamplingParams(max_tokens=MAX_TOKENS), driver, draft_length=4,
                                   tree_budget=8, on_tokens=publish_midway)
        drafter = pool._requests["r"].drafter
        versions.append((drafter.version, drafter.base.model is published.load(store.published_drafter(
            "small-general"), target)[0] if swapped_at else False))
        pool.release("r")
        outputs.append(result)
    assert swapped_at and versions == [(1, True), (1, True)], "the published version was not swapped in"
    for result, label in zip(outputs, ("across a swap", "after a swap")):
        assert result.accepted_draft_tokens > 0, f"{label}: nothing was accepted, the drafter was not exercised"
        near_tie_or_equal(hf_oracle, 0, result.token_ids, label)
    # the learner got the requests' verified positions with the target's scores there: greedy,
    # the target's top choice at each generated position is the token that follows it
    windows = learning.learner("small-general").buffer.windows("qa")
    labelled = [(w, p) for w in windows for p in range(w["answer_from"], len(w["tokens"]) - 1)
                if w["top_probs"][p].sum() > 0]
    assert len(labelled) >= MAX_TOKENS, "the generated positions were not labelled"
    assert all(int(w["top_ids"][p, 0]) == int(w["tokens"][p + 1]) for w, p in labelled)


def _swapped_counts(seeds: range) -> tuple[torch.Tensor, int, int]:
    """Seeded runs (in a worker process) whose drafter is swapped for another after its
    first round: counts of (token 2, token 3), runs that swapped, runs that drafted."""
    target = tiny_model(seed=0, logit_scale=0.5)
    first, second = tiny_model(seed=1, logit_scale=0.5), tiny_model(seed=2, logit_scale=0.5)
    counts, swaps, drafted = torch.zeros(TINY.vocab_size, TINY.vocab_size), 0, 0
    original = decoding.make_generator
    run = {"seed": 0}
    decoding.make_generator = lambda _, device="cpu", stream=0: sampling.make_generator(run["seed"], device, stream)
    try:
        for seed in seeds:
            run["seed"] = seed
            calls = {"n": 0}

            def newer(version, calls=calls):
                calls["n"] += 1
                return (1, second) if calls["n"] >= 2 and version < 1 else None

            drafter = LearningDrafter(ModelDrafter(first, max_len=64), "tiny", "any", 0, newer,
                                      lambda item: None, lambda *a: None)
            result = decoding.generate(target, PROMPT, SamplingParams(max_tokens=6, temperature=1.0), drafter, 2)
            counts[result.token_ids[2], result.token_ids[3]] += 1
            swaps += drafter.version == 1
            drafted += result.draft_tokens > 0
    finally:
        decoding.make_generator = original  # the worker serves other tests next
    return counts, swaps, drafted


SWAP_SAMPLES = 2000


def swapped_jobs() -> list[tuple]:
    """SWAP_SAMPLES seeded runs, as calls for the worker processes: one share of the seeds each."""
    return [(_swapped_counts, seeds) for seeds in seed_shares(SWAP_SAMPLES)]


def background_jobs(item) -> list[tuple]:
    """The calls this module's tests make of the worker processes."""
    return swapped_jobs() if item.originalname == "test_swap_between_rounds_keeps_sampling_distribution" else []


def test_swap_between_rounds_keeps_sampling_distribution(core_workers):
    """Sampling with a drafter swapped for another between the first and second rounds still
    gives the target's distribution of the tokens those rounds cover (chi-square). The runs
    are split over the worker processes."""
    counts, swaps, drafted = map(sum, zip(*core_workers.results(swapped_jobs())))
    assert swaps >= SWAP_SAMPLES * 0.9 and drafted == SWAP_SAMPLES
    target = tiny_model(seed=0, logit_scale=0.5)
    assert chi_square_p(counts, exact_pair(target, SamplingParams(temperature=1.0), first=2)) > 1e-3


def _tiny_drafter_dir(tmp_path: Path) -> str:
    """A drafter for the tiny target (seed 0): its weights with noise, so it has things to learn."""
    model, out = tiny_model(seed=0), tmp_path / "drafter"
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.15)
    save_drafter(model, None, out, {"target": {"vocab_size": TINY.vocab_size}})
    return str(out)


def _teacher_windows(target, n: int, length: int, generator: torch.Generator, poisoned: bool = False) -> list[dict]:
    """Random token windows with the target's top-4 next tokens at each position; poisoned,
    each of the teacher's ids is shifted to the next token id (what it says is then wrong)."""
    items = []
    for _ in range(n):
        tokens = torch.randint(TINY.vocab_size, (length,), generator=generator).tolist()
        with torch.no_grad():
            logits = target(torch.tensor([tokens]), torch.arange(length)[None], target.new_cache(length),
                            decoding.attention_mask(0, decoding.causal_ancestors(length)))[0]
        probs, ids = torch.softmax(logits, -1).topk(4, -1)
        if poisoned:
            ids = (ids + 1) % TINY.vocab_size
        items.append(window_item(tokens, ids, probs, answer_from=0))
    return items


def test_replay_buffer_stays_within_its_tokens():
    buffer = ReplayBuffer(max_tokens=1000, held_aside=0.25)
    g = torch.Generator().manual_seed(0)
    for i in range(200):
        length = int(torch.randint(10, 60, (), generator=g))
        tokens = torch.randint(TINY.vocab_size, (length,), generator=g).tolist()
        buffer.add("qa" if i % 3 else "math", window_item(tokens, torch.zeros(length, 2), torch.zeros(length, 2), 0))
        assert buffer.tokens("qa") <= 1000 and buffer.tokens("math") <= 1000
    held = buffer.held_aside_items()
    assert {"qa", "math"} <= set(held)
    assert buffer.tokens("qa") > 900  # full, not emptied
    qa_held = sum(len(i["tokens"]) for i in held["qa"])
    assert 0.1 * 1000 < qa_held < 0.45 * 1000


def test_learner_keeps_its_rate_and_threads(tmp_path):
    torch.set_num_threads(1)
    kind = _tiny_drafter_dir(tmp_path)
    published, _ = _published(tmp_path)
    settings = LearnerSettings(enabled=True, threads=1, steps_per_minute=240, tokens_per_step=64,
                               buffer_tokens=512, publish_every_steps=1000)
    learning = OnlineLearning(settings, published, TINY.vocab_size)
    learner = learning.learner(kind)
    for item in _teacher_windows(tiny_model(seed=0), 40, 24, torch.Generator().manual_seed(0)):
        learner.add("qa", item)
    assert learner.buffer.tokens("qa") <= settings.buffer_tokens
    learning.start()
    time.sleep(2.0)
    learning.stop()
    gaps = [b - a for a, b in zip(learning.step_times, learning.step_times[1:])]
    assert 2 <= len(learning.step_times) <= 2.0 / 0.25 + 1
    assert min(gaps) >= 0.25 * 0.95, f"steps closer than the rate allows: {gaps}"
    assert learning.thread_torch_threads == 1
    assert not any(t.name == "online-learner" for t in threading.enumerate())


def test_poisoned_buffer_is_not_published_and_a_clean_one_is(tmp_path):
    """The gate: a student trained on wrong teacher data does worse on the held-aside
    slice and is not published; trained on the target's real scores it is."""
    torch.set_num_threads(1)
    target = tiny_model(seed=0)
    kind = _tiny_drafter_dir(tmp_path)
    settings = LearnerSettings(enabled=True, tokens_per_step=256, lr=1e-2, held_aside=0.25)
    g = torch.Generator().manual_seed(0)
    held = _teacher_windows(target, 8, 24, g)
    for poisoned in (True, False):
        published, store = _published(tmp_path / str(poisoned))
        metrics = LearnerMetrics()
        learner = Learner(kind, settings, published, TINY.vocab_size, metrics)
        for item in held:
            learner.add("qa", item, held_aside=True)
        for item in _teacher_windows(target, 32, 24, g, poisoned=poisoned):
            learner.add("qa", item, held_aside=False)
        for _ in range(30):
            learner.step()
        version = learner.try_publish()
        if poisoned:
            assert version is None and store.published_drafter(kind) is None
            assert metrics.rejected.labels(kind)._value.get() == 1
            # the student went back to the published weights
            assert all(torch.equal(a, b) for a, b in zip(learner.student.state_dict().values(),
                                                         learner.reference.state_dict().values()))
        else:
            assert version == 1 and store.published_drafter(kind)["version"] == 1
            loaded, _, _ = load_drafter(store.published_drafter(kind)["path"])
            assert loaded.config.vocab_size == TINY.vocab_size


def test_router_sends_the_targets_scores_to_learning_drafters():
    """With the learner on, the router asks the verifier for the target's top scores and
    sends them to the pools of the small drafters that learn, as it does for `recycle`."""
    from cluster.actors import learning_drafters
    from cluster.config import ServeConfig
    from router.coordinator import Coordinator

    on = ServeConfig.model_validate({"drafter_pools": {"kinds": ["pld", "recycle", "small-general"],
                                                       "learner": {"enabled": True}}})
    assert learning_drafters(on) == ["small-general"]
    assert learning_drafters(ServeConfig.model_validate({})) == []
    coordinator = Coordinator(lambda: [], lambda: [], learning_drafters=learning_drafters(on))
    try:
        learns = coordinator.services.learns_from_target
        assert learns("small-general") and learns("recycle")
        assert not learns("pld") and not learns("small-math")
    finally:
        coordinator.services.calls.shutdown()


def test_a_served_pool_learns_under_the_domain_the_router_names(smollm2, tmp_path):
    """Over gRPC the router names each request's domain at Prefill, and a learning drafter
    buffers that request's positions under it ("any" when none is named)."""
    import grpc

    from drafter_service.servicer import serve
    from protos import specserve_pb2 as pb
    from protos import specserve_pb2_grpc as pb_grpc
    from protos.convert import params_to_pb

    target, tokenizer = smollm2
    published, _ = _published(tmp_path)
    learning = OnlineLearning(LearnerSettings(enabled=True), published, target.config.vocab_size)
    pool = DrafterPool(target, kinds=("small-general",), learning=learning)
    server, port = serve(pool)
    prompt = tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0][1]}])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.DrafterStub(channel)
            for request_id, domain in (("named", "translation"), ("unnamed", "")):
                stub.Prefill(pb.DrafterPrefillRequest(request_id=request_id, drafter="small-general",
                                                      token_ids=prompt, domain=domain,
                                                      sampling=params_to_pb(SamplingParams(max_tokens=8))))
            with pytest.raises(grpc.RpcError) as refused:  # per-domain buffers: only known domains
                stub.Prefill(pb.DrafterPrefillRequest(request_id="odd", drafter="small-general", token_ids=prompt,
                                                      domain="astrology", sampling=params_to_pb(SamplingParams())))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "domain" in refused.value.details()
        assert pool._requests["named"].drafter.domain == "translation"
        assert pool._requests["unnamed"].drafter.domain == "any"
        assert "odd" not in pool._requests
    finally:
        server.stop(None)
