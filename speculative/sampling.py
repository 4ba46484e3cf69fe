"""Sampling parameters, their validation, and logits -> probabilities."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from runtime.errors import InvalidArgument  # raised here, and imported from here by the services

# A seeded request's stream draws from torch seed seed * STREAM_STRIDE + stream: a prime far
# above any stream number, so each (seed, stream) pair gets its own torch seed. Changing it
# changes every seeded output.
STREAM_STRIDE = 1_000_003
# The smallest temperature but 0: logits divided by less may overflow float32 (a denormal
# one made every probability NaN), and at this one only tokens whose logits are within a
# thousandth or so of the top one keep any chance.
MIN_TEMPERATURE = 1e-4
_MIN_TEMPERATURE_F32 = float(torch.tensor(MIN_TEMPERATURE, dtype=torch.float32))  # as the wire carries it


MAX_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's top_logprobs limit)
LOGIT_BIAS_LIMIT = 100.0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    # What changes the target's distribution before a token is chosen (speculative.processing),
    # at every tree node with that node's own context: OpenAI's penalties on the output's
    # tokens, the repetition penalty on the prompt's and the output's, a bias per token, the
    # end held back for `min_tokens`, and a grammar (a compiled llguidance one,
    # speculative.grammar).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # the tokens that end the output, held back for min_tokens
    grammar: str | None = None
    # The chosen token's log-probability and its `logprobs` likeliest alternatives at each
    # output token (None: none), of the raw distribution or of the processed one.
    logprobs: int | None = None
    processed_logprobs: bool = False

    @property
    def processed(self) -> bool:
        """Whether anything changes the target's distribution before the choice."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.grammar)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def keyed(self) -> bool:
        """Seeded sampling: each token is the Gumbel-max choice keyed by (seed, position)
        (`choice_scores`), a function of its position's distribution alone. The output then
        does not depend on the drafts, the drafter, batching or resumes: a seeded request
        gives the same tokens however it is served, and still follows the target's
        distribution over seeds."""
        return not self.greedy and self.seed is not None

    @property
    def deterministic(self) -> bool:
        """Each token is the argmax of the target's choice scores (`choice_scores`): greedy
        or keyed. Verification then walks the tree for the target's choice, and drafts
        need no draft distributions."""
        return self.greedy or self.keyed

    def validate(self, prompt_tokens: int | None = None, context_length: int | None = None) -> None:
        if self.max_tokens <= 0:
            raise InvalidArgument("max_tokens", f"must be positive, got {self.max_tokens}")
        if prompt_tokens is not None and context_length is not None and prompt_tokens + self.max_tokens > context_length:
            raise InvalidArgument(
                "max_tokens", f"prompt ({prompt_tokens} tokens) + max_tokens ({self.max_tokens}) "
                f"exceeds the context of {context_length} tokens")
        if not 0.0 <= self.temperature < math.inf:  # also rejects NaN; infinity would sample uniform noise
            raise InvalidArgument("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if 0.0 < self.temperature < _MIN_TEMPERATURE_F32:
            raise InvalidArgument("temperature", f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                                                 f"got {self.temperature:g}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument("top_k", f"must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidArgument("seed", f"must be in [0, 2^64), got {self.seed}")
        self._validate_processing()

    def _validate_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:  # also rejects NaN
                raise InvalidArgument(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise InvalidArgument("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise InvalidArgument("logit_bias", f"token {token} is not a token id")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise InvalidArgument("logit_bias", f"the bias of token {token} must be in [-100, 100], got {bias}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgument("min_tokens", f"must be in [0, max_tokens ({self.max_tokens})], got "
                                                f"{self.min_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgument("stop_token_ids", "must be token ids")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    def check_vocabulary(self, vocab_size: int) -> None:
        """Every token id the parameters name is one of the target's."""
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidArgument(name, f"token {bad} is outside the vocabulary of {vocab_size}")

    def to_dict(self) -> dict:
        """As JSON takes it (a checkpoint)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "SamplingParams":
        data = dict(data)
        data["logit_bias"] = tuple((int(t), float(b)) for t, b in data.get("logit_bias", ()))
        data["stop_token_ids"] = tuple(data.get("stop_token_ids", ()))
        return cls(**data)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: temperature, then top-k, then top-p.

    Rows of `logits` [..., V] are independent. Returns float32 probabilities.
    """
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest set of most likely tokens whose mass reaches top_p
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a 1-D distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def position_gumbel(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """Gumbel noise [V] (float64, CPU) of a seeded request's token at `position` (its index in
    prompt + output): keyed by (seed, position) only, so every process draws the same."""
    digest = hashlib.blake2b(f"{seed}@{position}".encode(), digest_size=8, person=b"gumbel").digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest, "little") % (2**63))
    u = torch.rand(vocab_size, generator=g, dtype=torch.float64)
    return -torch.log(-torch.log(u))  # u = 0 (chance 2^-53 a token) gives -inf: never chosen


def choice_scores(logits: torch.Tensor, params: SamplingParams, positions: Sequence[int]) -> torch.Tensor:
    """Scores [N, V] whose argmax is the token a deterministic request takes after each row of
    `logits` [N, V], row i choosing the token at `positions[i]`: the logits (greedy), or
    log p + Gumbel noise keyed by (seed, position) (keyed sampling: the Gumbel-max trick
    draws exactly from p, independently at each position)."""
    if params.greedy:
        return logits
    if not params.keyed:
        raise ValueError("choice scores are for greedy or seeded requests")
    noise = {pos: position_gumbel(params.seed, pos, logits.shape[-1]) for pos in set(positions)}
    log_p = probabilities(logits, params).double().log().cpu()
    return log_p + torch.stack([noise[pos] for pos in positions])


def first_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, position: int) -> int:
    """The target's token after a prefill, at `position` (the prompt's length, plus the tokens
    generated before a resume), from its last position's `logits` [V]: the target's choice
    (greedy or keyed) or one draw from the verifier's stream. The loop in one process and
    the verifier service both choose it here, so a seeded request chooses alike in both."""
    if params.deterministic:
        return int(choice_scores(logits[None], params, [position])[0].argmax())
    return sample(probabilities(logits, params), generator)


def make_generator(seed: int | None, device: torch.device | str = "cpu", stream: int = 0,
                   resumed: int = 0) -> torch.Generator:
    """A request's own random stream; `stream` separates drafter from verifier draws.

    `resumed` > 0: the stream of a request prefilled again after a service lost it, the
    `resumed`-th time. It must be fresh: the start of the request's stream chose the tokens
    already generated, and tokens chosen by the same draws are dependent (a seeded request
    that restarted its stream on a resume no longer followed the target's distribution,
    tests/test_resumed_sampling.py)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    elif not resumed:
        g.manual_seed((seed * STREAM_STRIDE + stream) % (2**63))
    else:
        digest = hashlib.blake2b(f"{seed}/{stream}/{resumed}".encode(), digest_size=8).digest()
        g.manual_seed(int.from_bytes(digest, "little") % (2**63))
    return g
