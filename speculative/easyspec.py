"""EasySpec layer-parallel ("fuzzy") drafting: the math (Wu et al., 2025, arXiv 2502.02493).

A drafter's layers are cut into groups of `parallel` consecutive layers. Within a
group, every layer's attention sub-layer reads the group's input hidden state
instead of the state its predecessor left, so the group's attentions do not
wait for each other and can run at the same time; the paper parallelises the
attention sub-layers only. Their outputs then enter the residual stream in layer
order, each followed by its layer's MLP, run sequentially on the updated stream
as in the exact model. With groups of one this is the exact forward, op for op.

The keys and values the group's later layers write are computed from the wrong
(earlier) hidden state: they are "fuzzy". The caller must recompute the entries
of tokens it keeps with an exact forward before relying on them (bonus
calibration, drafter_service.drafters.ModelDrafter). Verification is untouched,
so decoding stays lossless whatever the drafts are.

How the group's attentions run is the caller's `run` (a list of thunks -> their
results): sequentially here, on threads in drafter_service.layer_threads.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from runtime.model import KVCache, Transformer

Jobs = Sequence[Callable[[], torch.Tensor]]


def run_sequentially(jobs: Jobs) -> list[torch.Tensor]:
    return [job() for job in jobs]


def layer_groups(layers: Sequence[int], parallel: int) -> list[list[int]]:
    """Consecutive groups of `parallel` of `layers` (cache slots 0.. in order); the last may be shorter."""
    if parallel < 1:
        raise ValueError(f"parallel_layers must be >= 1, got {parallel}")
    layers = list(layers)
    return [layers[i:i + parallel] for i in range(0, len(layers), parallel)]


@torch.inference_mode()
def fuzzy_forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                  mask: torch.Tensor, parallel: int, layers: Sequence[int] | None = None, logits_from: int = 0,
                  run: Callable[[Jobs], list[torch.Tensor]] = run_sequentially) -> torch.Tensor:
    """`Transformer.forward` (without packing) with each group of `parallel` layers'
    attentions reading the group's input: the same arguments, cache layout and logits."""
    b, t = tokens.shape
    x, cos, sin, starts, mask = model.layer_inputs(tokens, positions, cache, mask)
    picked = range(len(model.layers)) if layers is None else layers
    slot = 0  # the cache holds one entry per picked layer, in order
    for group in layer_groups(picked, parallel):
        group_input = x
        jobs = [_attention_job(model.layers[layer], group_input, cos, sin, cache, slot + i, starts, mask)
                for i, layer in enumerate(group)]
        attended = run(jobs)
        for layer, attn_out in zip(group, attended):
            block = model.layers[layer]
            x = x + attn_out
            x = x + block.mlp(block.mlp_norm(x))
        slot += len(group)
    for row in range(b):
        cache.lengths[row] += t
    return model.lm_head(model.norm(x[:, logits_from:])).float()


def _attention_job(block, x, cos, sin, cache: KVCache, slot: int, starts, mask) -> Callable[[], torch.Tensor]:
    def job() -> torch.Tensor:
        # inference mode is per thread: a worker thread must enter it itself
        with torch.inference_mode():
            return block.attn(block.attn_norm(x), cos, sin, cache.k[slot], cache.v[slot], starts, mask)
    return job
