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

    def encode_chat(self, messages, tools=None):
        self.encoded.append(sum(len(m["content"]) for m in messages))
        return self.tokenizer.encode_chat(messages, tools=tools)


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


def test_one_limit_the_context_named_in_every_error(tokenizer):
    """A request's prompt and output share one limit, the context ([verifiers] max_len): a
    prompt that leaves room for one token runs with max_tokens 1, a longer one is refused as
    a prompt that does not fit, and either error names the same context."""
    config = RouterConfig(context_length=64, eos_token_ids=[0], vocab_size=tokenizer.vocab_size, default_drafter="pld")

    def run(job, stats):
        raise Validated(len(job.prompt_ids))

    coordinator = types.SimpleNamespace(services=types.SimpleNamespace(pass_costs=None), run=run, load=lambda: 0,
                                        draft_costs=None)
    router = RouterServicer(tokenizer, coordinator, config)
    words = " ".join(["word"] * 80)
    fits = tokenizer.decode(tokenizer.encode(words)[:63])
    assert len(tokenizer.encode(fits)) == 63
    assert isinstance(outcome(router, pb.GenerateRequest(prompt=fits)), Validated)  # 63 + 1 = 64
    too_long = outcome(router, pb.GenerateRequest(prompt=fits + " word"))
    assert isinstance(too_long, RequestFailed) and too_long.too_long and too_long.field == "prompt"
    assert "63 a prompt may have (the context is 64 tokens, [verifiers] max_len)" in too_long.message
    req = pb.GenerateRequest(prompt=fits)
    req.sampling.max_tokens = 2
    try:
        list(router.chunks(req, Call()))
    except RequestFailed as e:
        assert e.field == "max_tokens" and "exceeds the context of 64 tokens" in e.message
    else:
        raise AssertionError("63 + 2 tokens do not fit a context of 64")
