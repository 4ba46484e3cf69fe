"""Tokenizer and chat template from a Hugging Face directory (tokenizer.json).

Uses the `tokenizers` library directly and renders chat templates with
jinja2 the way transformers does, so loading stays light and fast.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


# `tokenizers` keeps its BPE cache per thread, up to 10,000 words each: a server encoding on a pool
# of threads keeps one per thread, each growing with its share of the text seen. Encoding without
# it costs a fraction of a millisecond more a prompt (docs/RELIABILITY.md, run 7).
BPE_CACHE_WORDS = 0


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialisation
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, directory: str | Path):
        directory = Path(directory)
        self._tok = _HFTokenizer.from_file(str(directory / "tokenizer.json"))
        resize_cache = getattr(self._tok.model, "_resize_cache", None)  # BPE models have one
        if resize_cache is not None:
            resize_cache(BPE_CACHE_WORDS)
        cfg_path = directory / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = directory / "chat_template.jinja"
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        self.chat_template: str | None = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_ids: list[int] = []
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.append(self._tok.token_to_id(self.eos_token))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the batch call releases the GIL while it works (`encode` holds it): a long prompt
        # tokenized on one thread leaves the server's other threads running
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def to_json(self) -> str:
        """The tokenizer as Hugging Face tokenizers' JSON (what a grammar engine reads)."""
        return self._tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @cached_property
    def _compiled_chat_template(self) -> jinja2.Template:
        # compiled once: compiling takes longer than encoding the prompt; rendering is thread-safe
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    @property
    def template_knows_tools(self) -> bool:
        """Whether the chat template renders tools it is given (it reads `tools`)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        extra = {} if tools is None else {"tools": tools}
        return self._compiled_chat_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)

    def encode_chat(self, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
        # The template writes any special tokens itself, as in transformers.
        return self.encode(self.render_chat(messages, tools=tools), add_special_tokens=False)
