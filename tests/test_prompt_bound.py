"""A prompt too long in characters to fit is refused before it is tokenized (issue 65): one
10 MB prompt held the router's GIL for 10 s while `tokenizers` encoded it, and stalled every
other request and /health. The bound must never refuse a prompt that fits."""

from __future__ import annotations

import types
import unicodedata

import pytest

from protos import specserve_pb2 as pb
from router.servicer import Call, RequestFailed, RouterConfig, RouterServicer, prompt_char_limit


@pytest.fixture(scope="module")
def tokenizer():
    from runtime import loading

    return loading.load_tokenizer()[0]


class Spy:
    """The tokenizer, recording the length of each text it was asked to tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer, self.encoded = tokenizer, []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, text, add_special_tokens=True):
        self.encoded.append(len(text))
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(self, messages):
        self.encoded.append(sum(len(m["content"]) for m in messages))
        return self.tokenizer.encode_chat(messages)


class Validated(Exception):
    """The stub coordinator's answer: the request got past validation."""


def servicer(tokenizer, max_prompt_tokens: int = 4096) -> RouterServicer:
    config = RouterConfig(context_length=10**6, eos_token_ids=[0], vocab_size=tokenizer.vocab_size,
                          default_drafter="pld", max_prompt_tokens=max_prompt_tokens,
                          max_prompt_chars=prompt_char_limit(tokenizer, max_prompt_tokens))

    def run(job, stats):
        raise Validated(len(job.prompt_ids))

    coordinator = types.SimpleNamespace(services=types.SimpleNamespace(pass_costs=None), run=run, load=lambda: 0,
                                        draft_costs=None)
    if isinstance(tokenizer, Spy):
        tokenizer.encoded.clear()  # the bound's own probe
    return RouterServicer(tokenizer, coordinator, config)


def outcome(router: RouterServicer, req: pb.GenerateRequest):
    req.sampling.max_tokens = 1
    try:
        list(router.chunks(req, Call()))
    except (RequestFailed, Validated) as e:
        return e
    raise AssertionError("neither refused nor run")


def test_the_bound_is_the_longest_token_times_the_token_limit_and_a_prompt_at_it_fits(tokenizer):
    """SmolLM2's longest piece is a newline and 80 spaces (81 bytes): 4096 of them are 4096
    tokens, exactly the bound's characters. So the bound is tight and that prompt fits."""
    longest = max(len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size))
    assert longest == 81 and prompt_char_limit(tokenizer, 4096) == 4096 * 81
    worst = ("\n" + " " * 80) * 4096
    assert len(worst) == prompt_char_limit(tokenizer, 4096) and len(tokenizer.encode(worst)) == 4096
    spy = Spy(tokenizer)  # (not all whitespace, which is an empty prompt)
    ran = outcome(servicer(spy), pb.GenerateRequest(prompt="x" + worst[1:]))
    assert spy.encoded == [len(worst)], ran  # tokenized, not refused for its characters


@pytest.mark.parametrize("chat", [False, True])
def test_a_prompt_longer_than_the_bound_is_refused_untokenized(tokenizer, chat):
    spy = Spy(tokenizer)
    text = "a" * (10 * 1024 * 1024)
    req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=text)]) if chat else \
        pb.GenerateRequest(prompt=text)
    refused = outcome(servicer(spy), req)
    assert isinstance(refused, RequestFailed) and refused.too_long and refused.field == "prompt", refused
    assert "characters" in refused.message and spy.encoded == []


def test_a_chat_is_bounded_by_its_rendered_text(tokenizer):
    """The template's own text counts with the messages': what is tokenized is the rendering."""
    limit = prompt_char_limit(tokenizer, 64)
    rendered = len(tokenizer.render_chat([{"role": "user", "content": ""}]))
    spy = Spy(tokenizer)
    content = "x" + " " * (limit - rendered)  # the rendering is one character over the bound
    refused = outcome(servicer(spy, 64), pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=content)]))
    assert isinstance(refused, RequestFailed) and refused.too_long and spy.encoded == [], refused
    ran = outcome(servicer(spy, 64), pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=content[:-1])]))
    assert spy.encoded == [limit], ran  # at the bound: tokenized


class Composing:
    """A tokenizer that composes characters first (an NFC normaliser, as Qwen2's): text then
    shrinks before it is split, and no bound from the pieces is safe."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, text, add_special_tokens=True):
        return self.tokenizer.encode(unicodedata.normalize("NFC", text), add_special_tokens=add_special_tokens)


def test_no_bound_for_a_tokenizer_that_does_not_give_its_text_back(tokenizer):
    assert prompt_char_limit(Composing(tokenizer), 4096) is None
