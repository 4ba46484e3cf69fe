"""Which grammar engine: compile time and the time to compute one token's mask, for
llguidance and outlines-core on the default model's tokenizer (xgrammar needs triton,
which pulls CUDA packages a CPU install must not have).

For a JSON schema over a dev question's answer, a regex and a choice: the time to
compile, then the mask at every position of a valid output (the target would be
masked there), the median and the 99th percentile over the positions.

    python experiments/grammar_mask_probe.py
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from runtime.loading import load_tokenizer

SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string"}, "confidence": {"type": "number"},
    "category": {"enum": ["math", "coding", "writing", "reasoning"]},
    "steps": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["answer", "confidence", "category", "steps"], "additionalProperties": False}
OUTPUT = json.dumps({"answer": "The train covers 120 km in 1.5 hours, so 80 km/h.", "confidence": 0.9,
                     "category": "math", "steps": ["distance 120 km", "time 1.5 h", "speed = 120 / 1.5"]})
REGEX = r"\d{3}-\d{3}-\d{4}"
REGEX_OUTPUT = "555-123-4567"


def percentiles(samples: list[float]) -> str:
    ms = sorted(s * 1e3 for s in samples)
    return f"median {statistics.median(ms):.3f} ms, p99 {ms[int(0.99 * (len(ms) - 1))]:.3f} ms"


def llguidance_run(tok, grammar: str, output: str) -> tuple[float, list[float]]:
    import llguidance

    lltok = llguidance.LLTokenizer(tok._tok.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_ids[0])
    started = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - started
    assert not matcher.is_error(), matcher.get_error()
    times = []
    for token in tok.encode(output, add_special_tokens=False):
        started = time.perf_counter()
        matcher.compute_bitmask()
        times.append(time.perf_counter() - started)
        assert matcher.consume_token(token), matcher.get_error()
    return compile_s, times


def outlines_run(tok, regex: str, output: str) -> tuple[float, list[float]]:
    import outlines_core

    started = time.perf_counter()
    vocabulary = outlines_core.Vocabulary(tok.eos_token_ids[0], _outlines_vocab(tok))
    index = outlines_core.Index(regex, vocabulary)
    compile_s = time.perf_counter() - started
    guide = outlines_core.Guide(index)
    mask = np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)
    times = []
    for token in tok.encode(output, add_special_tokens=False):
        started = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
        times.append(time.perf_counter() - started)
        guide.advance(token)
    return compile_s, times


def _outlines_vocab(tok) -> dict[str, list[int]]:
    """Each token's text, its byte-level pieces ("Ġ" for a space) turned back into characters."""
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    vocab: dict[str, list[int]] = {}
    for token_id in range(tok.vocab_size):
        piece = tok._tok.id_to_token(token_id)
        if piece is None or token_id in tok.eos_token_ids:
            continue
        text = bytes(to_byte[c] for c in piece).decode("utf-8", "ignore") if all(c in to_byte for c in piece) \
            else piece
        if text:
            vocab.setdefault(text, []).append(token_id)
    return vocab


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character BPE vocabularies use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def main() -> None:
    import llguidance
    from outlines_core.json_schema import build_regex_from_schema

    tok, _ = load_tokenizer(None)
    schema_regex = build_regex_from_schema(json.dumps(SCHEMA))
    cases = [("json_schema", llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), schema_regex, OUTPUT),
             ("regex", llguidance.LLMatcher.grammar_from_regex(REGEX), REGEX, REGEX_OUTPUT)]
    for name, grammar, regex, output in cases:
        compile_s, times = llguidance_run(tok, grammar, output)
        print(f"llguidance    {name:<12} compile {compile_s * 1e3:8.1f} ms  mask {percentiles(times)}  "
              f"({len(times)} tokens)")
        compile_s, times = outlines_run(tok, regex, output)
        print(f"outlines-core {name:<12} compile {compile_s * 1e3:8.1f} ms  mask {percentiles(times)}  "
              f"({len(times)} tokens)")


if __name__ == "__main__":
    main()
