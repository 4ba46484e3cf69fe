"""Streamed text against the tokenizer's own decoding of the whole output (Hugging Face
`tokenizers`, the SmolLM2 tokenizer), for any split of the tokens into rounds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from router.text import StreamingText
from runtime.loading import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    tok, _ = load_tokenizer()
    return tok


# text with multi-byte characters, which byte-level tokens split, and the model's special tokens
TEXTS = st.lists(st.sampled_from(list("ab c\n.,") + ["é", "ß", "日本", "🙂", "👩‍💻", "<|im_end|>", "  "]),
                 max_size=40).map("".join)


def rounds(tokens: list[int], cuts: list[int]) -> list[list[int]]:
    """`tokens` split at the `cuts` (sorted, deduplicated), as a request's rounds bring them."""
    edges = [0, *sorted({c % (len(tokens) + 1) for c in cuts}), len(tokens)]
    return [tokens[a:b] for a, b in zip(edges, edges[1:]) if b > a]


def stream(tokenizer, parts: list[list[int]], stop: list[str]) -> tuple[str, bool]:
    text = StreamingText(tokenizer.decode, stop)
    out = ""
    for part in parts:
        out += text.add(part)
        if text.stopped:
            return out, True
    return out + text.finish(), False


@settings(max_examples=150, deadline=None)
@given(TEXTS, st.lists(st.integers(0, 10_000), max_size=12))
def test_streamed_text_is_the_whole_decode(tokenizer, text, cuts):
    tokens = tokenizer.encode(text, add_special_tokens=False)
    out, stopped = stream(tokenizer, rounds(tokens, cuts), [])
    assert not stopped
    assert out == tokenizer.decode(tokens)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 49_151), max_size=40), st.lists(st.integers(0, 10_000), max_size=12))
def test_any_token_ids_partial_characters_included(tokenizer, tokens, cuts):
    """Token ids the model may emit in any order, so bytes that make no character in UTF-8."""
    out, _ = stream(tokenizer, rounds(tokens, cuts), [])
    assert out == tokenizer.decode(tokens)


@settings(max_examples=150, deadline=None)
@given(TEXTS, st.lists(st.integers(0, 10_000), max_size=12), st.data())
def test_output_ends_before_the_first_stop_string_completed(tokenizer, text, cuts, data):
    tokens = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(tokens)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if whole and data.draw(st.booleans()):  # one the output holds
            start = data.draw(st.integers(0, len(whole) - 1))
            stops.append(whole[start:start + data.draw(st.integers(1, 6))])
        else:
            stops.append(data.draw(st.text(alphabet="abc.\n", min_size=1, max_size=4)))
    out, stopped = stream(tokenizer, rounds(tokens, cuts), stops)
    # the stop string completed first (of those completed at one character, the longest), as text
    # that came a character at a time would show it: however the rounds split the tokens
    ends = [(i + len(s), i) for i, s in ((whole.find(s), s) for s in stops) if i >= 0]
    first = min(ends)[1] if ends else -1
    assert stopped == (first >= 0)
    assert out == (whole[:first] if first >= 0 else whole)


def test_text_held_back_is_what_could_still_become_a_stop_string(tokenizer):
    text = StreamingText(tokenizer.decode, ["STOP"])
    released = text.add(tokenizer.encode("one two ST", add_special_tokens=False))
    assert released == "one two" and not text.stopped  # " ST" could be the start of "STOP"
    assert text.add(tokenizer.encode("OP", add_special_tokens=False)) == " " and text.stopped


def test_a_round_decodes_only_its_own_tokens_and_a_few_before(tokenizer):
    """However long the output, a round decodes the same few tokens: each round used to
    decode the whole output again, which cost a long generation's router a time growing
    with its square."""
    lengths = []

    def decode(ids):
        lengths.append(len(ids))
        return tokenizer.decode(ids)

    tokens = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 200, add_special_tokens=False)
    text = StreamingText(decode, ["never there"])
    out = "".join(text.add(tokens[i:i + 2]) for i in range(0, len(tokens), 2)) + text.finish()
    assert out == tokenizer.decode(tokens)
    assert len(tokens) > 1000 and max(lengths) <= StreamingText.CONTEXT_TOKENS + 2


def test_a_stop_string_at_the_start_releases_nothing_of_it(tokenizer):
    """An output shorter than the longest stop string releases nothing yet: it could all be
    that stop string's start."""
    text = StreamingText(tokenizer.decode, ["abcd"])
    out = "".join(text.add(tokenizer.encode(c, add_special_tokens=False)) for c in "abcd")
    assert out == "" and text.stopped


def test_tokens_with_no_text_are_not_decoded_again(tokenizer):
    """Special tokens decode to nothing (skipped): later rounds need not decode them again."""
    lengths = []

    def decode(ids):
        lengths.append(len(ids))
        return tokenizer.decode(ids)

    end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(end) == ""
    text = StreamingText(decode)
    out = "".join(text.add(end) for _ in range(50)) + text.add(tokenizer.encode("ok", add_special_tokens=False))
    assert out + text.finish() == "ok" and max(lengths) <= StreamingText.CONTEXT_TOKENS + 1


def test_a_stop_string_completed_first_ends_the_text_however_the_rounds_come(tokenizer):
    # "a  " starts before " " but is completed after it: the text ends at " ", in one round or three
    tokens = tokenizer.encode("a  aa\na", add_special_tokens=False)
    for parts in ([tokens], [[t] for t in tokens]):
        assert stream(tokenizer, parts, [" ", "aa", "a  "]) == ("a", True)
