"""The online learner: small drafters that keep learning from served traffic.

Every verification pass scores the target at each drafted position. The pool's
learning drafters (learning_drafter.py) label each request's verified tokens with the
target's top-k there and send full windows here, to a bounded buffer per domain
(online_buffer.py). A background thread distils each drafter kind on its buffer with
`train-drafter`'s loss (training.distill_loss), at most `steps_per_minute` steps a minute
on `threads` torch threads of its own, and every `publish_every_steps` steps judges the
result on the held-aside slice: only a checkpoint whose loss there is at least
`min_improvement` lower than the published one's is published (published.py), and one
that is worse sends training back to the published weights. Pools swap a published
version in between rounds; verification never changes, so serving stays lossless.

CPU: the thread sets its own torch thread count (`own_torch_threads`), which leaves the
serving threads' counts alone. It still shares the machine's cores with serving, which
is why the learner is off by default (`[drafter_pools.learner]`).
"""

from __future__ import annotations

import copy
import random
import threading
import time
from typing import Callable

import torch

from runtime.cpu_tuning import own_torch_threads
from speculative.drafter_kinds import drafter_path
from runtime.model import Transformer

from .checkpoint import load_drafter
from .drafters import ModelDrafter
from .learning_drafter import LearningDrafter
from .metrics import LearnerMetrics
from .online_buffer import ReplayBuffer
from .published import PublishedDrafters
from .settings import LearnerSettings
from .training import WEIGHT_DECAY, Batch, TrainConfig, _student_map, distill_loss

PROMPT_WEIGHT = TrainConfig.__dataclass_fields__["prompt_weight"].default  # as train-drafter weighs prompts


class Learner:
    """One drafter kind's distillation on its buffer, and the gate before publication."""

    def __init__(self, kind: str, settings: LearnerSettings, published: PublishedDrafters, target_vocab_size: int,
                 metrics: LearnerMetrics, seed: int = 0):
        self.kind, self.settings, self.published, self.metrics = kind, settings, published, metrics
        record = published.latest(kind)
        path = record["path"] if record else drafter_path(kind)
        self.student, self.vocab_ids, self.info = load_drafter(path)  # float32, not tuned: it trains
        self.version = record["version"] if record else 0
        self.reference = copy.deepcopy(self.student).eval()  # the published weights: the gate's baseline
        self.candidate = copy.deepcopy(self.student).eval()  # the student as it would be published
        self.student.train()
        self.to_student = _student_map(self.vocab_ids, target_vocab_size)
        self.unk = None if self.vocab_ids is None else len(self.vocab_ids)
        self.opt = torch.optim.AdamW(self.student.parameters(), lr=settings.lr, weight_decay=WEIGHT_DECAY)
        self.buffer = ReplayBuffer(settings.buffer_tokens, settings.held_aside)
        self.rng = random.Random(seed)
        self.steps = 0
        self.last_loss: float | None = None
        metrics.version.labels(kind).set(self.version)

    def add(self, domain: str, item: dict, held_aside: bool | None = None) -> None:
        self.buffer.add(domain, item, held_aside)
        self.metrics.buffer_tokens.labels(self.kind, domain).set(self.buffer.tokens(domain))

    def step(self) -> float | None:
        """One AdamW step on about `tokens_per_step` buffered positions; its loss per
        weighted position, or None with nothing to train on."""
        items = self.buffer.sample(self.rng, self.settings.tokens_per_step)
        if not items:
            return None
        self.opt.zero_grad()
        loss_sum = weight = 0.0
        for item in items:
            loss, w, _ = distill_loss(self.student, self._batch(item))
            (loss / self.settings.tokens_per_step).backward()
            loss_sum, weight = loss_sum + loss.item(), weight + w
        torch.nn.utils.clip_grad_norm_(self.student.parameters(), 1.0)
        self.opt.step()
        self.steps += 1
        self.last_loss = loss_sum / max(weight, 1e-9)
        self.metrics.steps.labels(self.kind).inc()
        self.metrics.loss.labels(self.kind).set(self.last_loss)
        return self.last_loss

    def try_publish(self) -> int | None:
        """Publish the student if it beats the published drafter on the held-aside slice
        (as it would be served: rounded to float16); its version, else None."""
        held = self.buffer.held_aside_items()
        if not held:
            return None
        with torch.no_grad():
            for mine, theirs in zip(self.candidate.parameters(), self.student.parameters()):
                mine.copy_(theirs.half().float())
        before, after = self._scores(self.reference, held), self._scores(self.candidate, held)
        for domain in held:
            self.metrics.agreement.labels(self.kind, domain, "published").set(before[domain][1])
            self.metrics.agreement.labels(self.kind, domain, "candidate").set(after[domain][1])
        loss_before, loss_after = _mean_loss(before), _mean_loss(after)
        if not loss_after < loss_before * (1 - self.settings.min_improvement):
            self.metrics.rejected.labels(self.kind).inc()
            if loss_after > loss_before:  # worse than what serves: start again from it
                self.student.load_state_dict(self.reference.state_dict())
                self.opt = torch.optim.AdamW(self.student.parameters(), lr=self.settings.lr,
                                             weight_decay=WEIGHT_DECAY)
            return None
        self.reference.load_state_dict(self.candidate.state_dict())
        online = {"steps": self.steps, "heldout_loss_before": round(loss_before, 4),
                  "heldout_loss_after": round(loss_after, 4)}
        self.version = self.published.publish(self.kind, self.candidate, self.vocab_ids,
                                               {**self.info, "online": online})
        self.metrics.version.labels(self.kind).set(self.version)
        return self.version

    def _batch(self, item: dict) -> Batch:
        batch = Batch(item, self.to_student, self.unk, PROMPT_WEIGHT)
        batch.answer &= batch.weights > 0  # agreement only where the target's scores came back
        return batch

    def _scores(self, model: Transformer, held: dict[str, list[dict]]) -> dict[str, tuple[float, float, float]]:
        """Per domain: (summed loss, top-1 agreement on answer positions, summed weight)."""
        out = {}
        with torch.no_grad():
            for domain, items in held.items():
                loss = weight = agree = answer = 0.0
                for item in items:
                    b = self._batch(item)
                    part, w, a = distill_loss(model, b)
                    loss, weight, agree = loss + float(part), weight + w, agree + a
                    answer += float(b.answer.sum())
                out[domain] = (loss, agree / max(answer, 1.0), weight)
        return out


def _mean_loss(scores: dict[str, tuple[float, float, float]]) -> float:
    return sum(s[0] for s in scores.values()) / max(sum(s[2] for s in scores.values()), 1e-9)


class OnlineLearning:
    """A process's online learning: one `Learner` per drafter kind that learns (made on
    first use), the thread that runs them, and the swap of published versions into the
    drafters of requests (`wrap`)."""

    def __init__(self, settings: LearnerSettings, published: PublishedDrafters, target_vocab_size: int,
                 metrics: LearnerMetrics | None = None, clock: Callable[[], float] = time.monotonic):
        self.settings, self.published, self.target_vocab_size = settings, published, target_vocab_size
        self.metrics = metrics or LearnerMetrics()
        self.clock = clock
        self.learners: dict[str, Learner] = {}
        self._lock = threading.Lock()  # guards `learners`; steps run on one thread (or a test's) only
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.step_times: list[float] = []  # when each step started (the rate's evidence), last 1000
        self.thread_torch_threads: int | None = None  # what the thread runs with, once started
        self._turn = 0
        self.metrics.enabled.set(0)

    @staticmethod
    def learns(kind: str, drafter) -> bool:
        """Whether requests of `kind` learn: small model drafters with a checkpoint."""
        return type(drafter) is ModelDrafter and drafter_path(kind) is not None

    def learner(self, kind: str) -> Learner:
        with self._lock:
            if kind not in self.learners:
                self.learners[kind] = Learner(kind, self.settings, self.published, self.target_vocab_size,
                                              self.metrics)
            return self.learners[kind]

    def wrap(self, drafter, kind: str, domain: str, target: Transformer):
        """A request's drafter, learning if its kind learns, else `drafter` itself. A newer
        published version is swapped in from its first proposal on."""
        if not self.learns(kind, drafter):
            return drafter
        learner = self.learner(kind)

        def newer(version: int):
            record = self.published.latest(kind)
            if record is None or record["version"] <= version:
                return None
            return record["version"], self.published.load(record, target)[0]

        def record_round(version: int, proposed: int, accepted: int) -> None:
            self.metrics.rounds.labels(kind, domain, str(version)).inc()
            self.metrics.accepted.labels(kind, domain, str(version)).inc(accepted)

        return LearningDrafter(drafter, kind, domain, 0, newer, lambda item: learner.add(domain, item),
                               record_round)

    def step(self) -> bool:
        """One step of the next learner with something to learn (round robin); every
        `publish_every_steps` of its steps it tries to publish. Whether a step ran."""
        with self._lock:
            learners = list(self.learners.values())
        for i in range(len(learners)):
            learner = learners[(self._turn + i) % len(learners)]
            started = self.clock()
            if learner.step() is None:
                continue
            self.step_times = (self.step_times + [started])[-1000:]
            if learner.steps % self.settings.publish_every_steps == 0:
                learner.try_publish()
            self._turn = (self._turn + i + 1) % len(learners)
            return True
        return False

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="online-learner", daemon=True)
        self._thread.start()
        self.metrics.enabled.set(1)

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.metrics.enabled.set(0)

    def _run(self) -> None:
        own_torch_threads(self.settings.threads)
        self.thread_torch_threads = torch.get_num_threads()
        interval = 60.0 / self.settings.steps_per_minute
        while not self._stop.is_set():
            started = self.clock()
            ran = self.step()
            # a step's start is at least `interval` after the last one's; idle, look again soon
            wait = interval - (self.clock() - started) if ran else min(interval, 1.0)
            self._stop.wait(max(wait, 0.0))

    def status(self) -> dict:
        """What the learner has done, per drafter kind."""
        with self._lock:
            learners = dict(self.learners)
        return {"enabled": self._thread is not None,
                "drafters": {kind: {"steps": l.steps, "loss": l.last_loss, "version": l.version,
                                    "buffer_tokens": {d: l.buffer.tokens(d) for d in l.buffer.domains()}}
                             for kind, l in learners.items()}}
