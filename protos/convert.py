"""Between wire messages and the core's types (DraftTree, SamplingParams).

Draft distributions travel sparse: only q's non-zero entries. A drafter
that samples from a top-k renormalised distribution has exactly k of them,
so nothing is approximated.
"""

from __future__ import annotations

from typing import Sequence

import torch

from protos import specserve_pb2 as pb
from speculative.logprobs import TokenLogprob
from speculative.sampling import SamplingParams
from speculative.tree import DraftTree


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                            repetition_penalty=p.repetition_penalty, logit_bias=dict(p.logit_bias),
                            min_tokens=p.min_tokens, stop_token_ids=p.stop_token_ids, grammar=p.grammar or "",
                            processed_logprobs=p.processed_logprobs)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def params_from_pb(msg: pb.SamplingParams, default_max_tokens: int = SamplingParams.max_tokens) -> SamplingParams:
    """The message's parameters; an unset `optional` field takes its default."""
    return SamplingParams(max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens,
                          temperature=msg.temperature, top_p=msg.top_p if msg.HasField("top_p") else 1.0,
                          top_k=msg.top_k, seed=msg.seed if msg.HasField("seed") else None,
                          presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                          repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
                          logit_bias=tuple(sorted(msg.logit_bias.items())), min_tokens=msg.min_tokens,
                          stop_token_ids=tuple(msg.stop_token_ids), grammar=msg.grammar or None,
                          logprobs=msg.logprobs if msg.HasField("logprobs") else None,
                          processed_logprobs=msg.processed_logprobs)


def logprobs_to_pb(logprobs: Sequence[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token=lp.token, logprob=lp.logprob, top_ids=[t for t, _ in lp.top],
                            top_logprobs=[v for _, v in lp.top]) for lp in logprobs or ()]


def logprobs_from_pb(msgs: Sequence[pb.TokenLogprob]) -> list[TokenLogprob]:
    return [TokenLogprob(m.token, m.logprob, tuple(zip(m.top_ids, m.top_logprobs))) for m in msgs]


def sparse_to_pb(q: torch.Tensor) -> pb.SparseDist:
    ids = torch.nonzero(q).flatten()
    return pb.SparseDist(ids=ids.tolist(), probs=q[ids].tolist())


def sparse_from_pb(msg: pb.SparseDist, vocab_size: int) -> torch.Tensor:
    q = torch.zeros(vocab_size)
    q[torch.tensor(list(msg.ids), dtype=torch.long)] = torch.tensor(list(msg.probs))
    return q


def tree_to_pb(tree: DraftTree) -> pb.DraftTree:
    msg = pb.DraftTree(tokens=tree.tokens, parents=tree.parents, draw_nodes=tree.draw_nodes)
    if tree.draw_q is not None:
        msg.draw_q.extend(sparse_to_pb(q) for q in tree.draw_q.float().cpu())
    if tree.confidence is not None:
        msg.confidence.extend(tree.confidence)
    return msg


def tree_from_pb(msg: pb.DraftTree, vocab_size: int) -> DraftTree:
    """The tree in `msg`, checked: a malformed tree raises ValueError("field: what is wrong")."""
    tokens, parents, draws = list(msg.tokens), list(msg.parents), list(msg.draw_nodes)
    if len(tokens) != len(parents):
        raise ValueError("tree: tokens and parents differ in length")
    for i, (tok, parent) in enumerate(zip(tokens, parents)):
        if not 0 <= tok < vocab_size:
            raise ValueError(f"tree: token {tok} at node {i} is outside the vocabulary")
        if not -1 <= parent < i:
            raise ValueError(f"tree: node {i} has parent {parent}; parents must come first")
    if any(not 0 <= d < len(tokens) for d in draws):
        raise ValueError("tree: a draw lands outside the tree")
    q = None
    if msg.draw_q:
        if len(msg.draw_q) != len(draws):
            raise ValueError("tree.draw_q: one distribution per draw is needed")
        for d, dist in enumerate(msg.draw_q):
            if len(dist.ids) != len(dist.probs) or any(not 0 <= i < vocab_size for i in dist.ids):
                raise ValueError(f"tree.draw_q: draw {d} needs one prob per id and ids inside the vocabulary")
        q = torch.stack([sparse_from_pb(d, vocab_size) for d in msg.draw_q])
    confidence = list(msg.confidence) or None
    if confidence is not None and len(confidence) != len(tokens):
        raise ValueError("tree.confidence: one value per node is needed")
    return DraftTree(tokens, parents, draws, q, confidence)


# ---- the target's features (eagle) ----------------------------------------------------------
# A message with `features` (bytes), `features_start` and `features_count` carries the
# target's captured features [count, F] at positions start..start+count-1 as float16,
# row-major: 3 layers x 576 hidden x 2 bytes = 3,456 bytes a position for SmolLM2-135M.

def features_to_pb(msg, start: int, features: torch.Tensor) -> None:
    """Put `features` [m, F] (positions start..) into `msg`'s feature fields."""
    half = features.detach().to("cpu", torch.float16).contiguous()
    msg.features, msg.features_start, msg.features_count = half.numpy().tobytes(), start, len(half)


def features_from_pb(msg, width: int | None = None, field: str = "features") -> tuple[int, torch.Tensor] | None:
    """`msg`'s features as (start, float32 [count, F]); None when it carries none. A size that
    is not count rows (of `width` values each, when given) raises ValueError naming `field`."""
    if not msg.features_count and not msg.features:
        return None
    count, size = msg.features_count, len(msg.features)
    if count <= 0 or size % (2 * count) or (width is not None and size != 2 * count * width):
        raise ValueError(f"{field}: {size} bytes are not {count} float16 rows"
                         + (f" of {width} values" if width is not None else ""))
    if msg.features_start < 0:
        raise ValueError(f"{field}_start: must be >= 0, got {msg.features_start}")
    rows = torch.frombuffer(bytearray(msg.features), dtype=torch.float16).view(count, -1)
    return msg.features_start, rows.float()
