"""Where a request's output ends: after its first end-of-sequence token, or at
`max_tokens`. The in-process loop (`speculative.decoding.generate`), the
router's coordinator and its client-facing servicer all cut and name the end
with this one function, so that a served request stops exactly where the
loop in one process does.
"""

from __future__ import annotations

from typing import Collection, Sequence


def clip(new: Sequence[int], generated: int, max_tokens: int,
         eos: Collection[int]) -> tuple[list[int], str | None]:
    """The part of a round's `new` tokens to keep after `generated` tokens, and why the
    output ends with them: "stop" (an end-of-sequence token), "length" (`max_tokens`
    reached) or None (it goes on).

    A round verifies several tokens at once, so an end-of-sequence token may come
    before its last one: what follows it was never meant to be generated."""
    kept = list(new)
    for i, tok in enumerate(kept):
        if tok in eos:
            kept = kept[:i + 1]
            break
    kept = kept[:max(max_tokens - generated, 0)]
    if kept and kept[-1] in eos:
        return kept, "stop"
    return kept, "length" if generated + len(kept) >= max_tokens else None
