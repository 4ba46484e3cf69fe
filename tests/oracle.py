"""The external oracle: Hugging Face transformers `generate(do_sample=False)` on the
same GGUF, with its own tokenizer and chat template. A difference from it is
accepted only at a near-tie of HF's own top-two logits.

HF runs in the worker processes (tests/core_workers.py): the `hf_oracle` fixture is
those workers, and each answer is computed once for the session."""

from __future__ import annotations

import warnings

import torch

from conftest import dev_prompts

PROMPTS = dev_prompts(20)  # (category, first turn)
# the prompts greedy answers are compared on: one of each dev category (PROMPTS takes them round-robin)
GREEDY_PROMPTS = len({category for category, _ in PROMPTS})
MAX_TOKENS = 64
NEAR_TIE = 1e-3

_hf = None


def hf_model():
    """Hugging Face transformers loading the same GGUF itself (once per worker)."""
    global _hf
    if _hf is None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from runtime.loading import default_gguf_path

        hf_logging.set_verbosity_error()
        gguf = default_gguf_path()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        _hf = model.eval(), tok
    return _hf


def hf_greedy(i: int) -> tuple[list[int], torch.Tensor]:
    """HF's generated ids for PROMPTS[i] and its logits at each step (in a worker)."""
    model, tok = hf_model()
    enc = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i][1]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, enc["input_ids"].shape[1]:].tolist(), torch.stack(out.logits)[:, 0]


def oracle(hf_oracle, i: int) -> tuple[list[int], torch.Tensor]:
    """HF's generated ids for PROMPTS[i] and its logits at each step."""
    return hf_oracle.submit_once(hf_greedy, i).result()


def near_tie_or_equal(hf_oracle, i: int, got: list[int], label: str) -> str | None:
    """Assert `got` is HF's output for PROMPTS[i], or departs from it only at a near-tie
    (described in the return value, for a warning)."""
    want, logits = oracle(hf_oracle, i)
    if got == want:
        return None
    category = PROMPTS[i][0]
    pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert pos < len(want) and pos < len(got), (
        f"{label}, prompt {i} ({category}): lengths differ with equal prefixes ({len(got)} vs {len(want)})")
    top2 = torch.topk(logits[pos], 2).values
    gap = float(top2[0] - top2[1])
    assert gap <= NEAR_TIE, (
        f"{label}, prompt {i} ({category}): token {pos} is {got[pos]}, HF says {want[pos]} "
        f"and its top-two logits differ by {gap:.2e} (not a near-tie)")
    return f"prompt {i} ({category}) token {pos}: HF top-two gap {gap:.1e}"


def keyed_oracle(hf_oracle, i: int, params, max_tokens: int = MAX_TOKENS) -> tuple[list[int], torch.Tensor]:
    """HF's tokens for PROMPTS[i] under seeded sampling, and the choice scores at each step.
    Keyed sampling is defined by its noise: at position n (in prompt + output) the token is
    the argmax of log p + Gumbel noise keyed by (seed, n) (`position_gumbel`), p being the
    target's distribution there after temperature, top-k and top-p. HF computes the
    logits, step by step with its own KV cache; the token is then that argmax."""
    return hf_oracle.submit_once(hf_keyed, i, params, max_tokens).result()


def hf_keyed(i: int, params, max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """keyed_oracle's answer (in a worker)."""
    from speculative.sampling import choice_scores

    model, tok = hf_model()
    enc = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i][1]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    n, eos = enc["input_ids"].shape[1], model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    ids, scores = [], []
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers renames past_key_values; same cache
        out = model(**enc, use_cache=True)
        while len(ids) < max_tokens:
            step = choice_scores(out.logits[:, -1].float(), params, [n + len(ids)])[0]
            ids.append(int(step.argmax()))
            scores.append(step)
            if ids[-1] in eos:
                break
            out = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return ids, torch.stack(scores)


def keyed_near_tie_or_equal(hf_oracle, i: int, params, got: list[int], label: str) -> str | None:
    """As near_tie_or_equal, for seeded sampling: a departure only where HF's two best choice
    scores are within NEAR_TIE / temperature (its logits' own near-tie, scaled)."""
    want, scores = keyed_oracle(hf_oracle, i, params, len(got) if got else MAX_TOKENS)
    if got == want:
        return None
    pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert pos < len(want) and pos < len(got), (
        f"{label}, prompt {i}: lengths differ with equal prefixes ({len(got)} vs {len(want)})")
    top2 = torch.topk(scores[pos], 2).values
    gap = float(top2[0] - top2[1])
    assert gap <= NEAR_TIE / params.temperature, (
        f"{label}, prompt {i}: token {pos} is {got[pos]}, HF's keyed choice is {want[pos]} "
        f"and its top-two choice scores differ by {gap:.2e} (not a near-tie)")
    return f"prompt {i} token {pos}: HF top-two choice gap {gap:.1e}"


FOLLOW_UP = "Now say the most important point of your answer again, in one sentence."


def hf_greedy_turns(i: int, follow_up: str = FOLLOW_UP) -> tuple[list[int], torch.Tensor, str, list[int], torch.Tensor]:
    """A two-turn chat on PROMPTS[i] (in a worker): HF's greedy answer to the first turn (ids,
    logits), its text, then HF's greedy answer to `follow_up` after it (ids, logits)."""
    model, tok = hf_model()
    first, first_logits = hf_greedy(i)
    answer = tok.decode(first, skip_special_tokens=True)
    messages = [{"role": "user", "content": PROMPTS[i][1]}, {"role": "assistant", "content": answer},
                {"role": "user", "content": follow_up}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
    second = out.sequences[0, enc["input_ids"].shape[1]:].tolist()
    return first, first_logits, answer, second, torch.stack(out.logits)[:, 0]


def turns_oracle(hf_oracle, i: int) -> tuple[list[int], torch.Tensor, str, list[int], torch.Tensor]:
    return hf_oracle.submit_once(hf_greedy_turns, i).result()


def ids_near_tie_or_equal(want: list[int], logits: torch.Tensor, got: list[int], label: str) -> str | None:
    """near_tie_or_equal's check of `got` against HF's `want` and its step logits."""
    if got == want:
        return None
    pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert pos < len(want) and pos < len(got), f"{label}: lengths differ with equal prefixes ({len(got)} vs {len(want)})"
    top2 = torch.topk(logits[pos], 2).values
    gap = float(top2[0] - top2[1])
    assert gap <= NEAR_TIE, (f"{label}: token {pos} is {got[pos]}, HF says {want[pos]} and its top-two logits "
                             f"differ by {gap:.2e} (not a near-tie)")
    return f"{label} token {pos}: HF top-two gap {gap:.1e}"
