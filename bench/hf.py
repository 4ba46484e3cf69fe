"""Hugging Face transformers' `generate`, the bench's baseline and the float32 oracle, apart from
the harness so that a script with no gRPC (scripts/gpu_check.py) can load it."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from speculative.sampling import SamplingParams

HF_PLD_TOKENS = 10  # hf-pld's prompt_lookup_num_tokens: transformers' own default for prompt lookup


class HFRunner:
    """Hugging Face transformers on the same GGUF/directory (float32 unless told), on the
    bench's device: the baseline."""

    def __init__(self, source_path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        if source_path.suffix == ".gguf":
            self.model = AutoModelForCausalLM.from_pretrained(
                str(source_path.parent), gguf_file=source_path.name, dtype=dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(str(source_path), dtype=dtype)
        self.model.to(device).eval()

    def run(self, ids: list[int], params: SamplingParams, mode: str) -> tuple[list[int], float]:
        extra = {"prompt_lookup_num_tokens": HF_PLD_TOKENS} if mode == "hf-pld" else {}
        if not params.greedy:
            torch.manual_seed(params.seed or 0)
            extra.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        else:
            extra.update(do_sample=False)
        x = torch.tensor([ids], device=self.model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=params.max_tokens,
                                      **extra)
        tokens = out[0, len(ids):].tolist()  # on a GPU, waits for the last token
        return tokens, time.perf_counter() - start

    def top2_gap(self, ids: list[int], prefix: list[int]) -> float:
        """The gap between HF's two highest next-token logits after `ids` + `prefix`."""
        x = torch.tensor([list(ids) + list(prefix)], device=self.model.device)
        with torch.inference_mode():
            top = torch.topk(self.model(x).logits[0, -1].float(), 2).values
        return float(top[0] - top[1])


def departure(hf: HFRunner, ids: list[int], tokens: list[int], reference: list[int]) -> dict:
    """Where greedy `tokens` first leave hf-ar's `reference`, and HF's top-two logit gap
    there: a near-tie (a tiny gap) is where last-bit arithmetic may pick either token."""
    pos = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    gap = hf.top2_gap(ids, reference[:pos]) if pos < len(reference) else None
    return {"token": pos, "hf_top2_gap": gap}
