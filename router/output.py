"""A request's output as chunks: its text (stop strings, partial characters held back),
its tool calls read out of the text, and its tokens' logprobs with their text."""

from __future__ import annotations

from typing import Sequence

from protos import specserve_pb2 as pb
from speculative.grammar import Grammars
from speculative.logprobs import TokenLogprob

from .text import StreamingText
from .tools import ToolCallText


class ChunkWriter:
    """Builds a request's GenerateChunks, a round's tokens at a time."""

    def __init__(self, request_id: str, tokenizer, stop: Sequence[str], tools: bool,
                 grammars: Grammars | None = None):
        """`tools`: the output may call tools (read out of its text at the end)."""
        self.request_id, self.tokenizer, self.grammars = request_id, tokenizer, grammars
        self.text = StreamingText(tokenizer.decode, stop)
        self.calls = ToolCallText() if tools else None

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self.text.stopped

    def chunk(self, tokens: list[int], logprobs: list[TokenLogprob] | None, last: bool) -> pb.GenerateChunk:
        """The chunk of a round's `tokens`; the `last` one carries all that was held back and
        the tool calls, if any."""
        delta = self.text.add(tokens)
        if last and not self.text.stopped:
            delta += self.text.finish()
        calls: list[pb.ToolCall] = []
        if self.calls is not None:
            delta = self.calls.add(delta)
            if last:
                rest, calls = self.calls.finish()
                delta += rest
        chunk = pb.GenerateChunk(request_id=self.request_id, text=delta, token_ids=tokens, tool_calls=calls)
        if logprobs is not None:
            chunk.logprobs.extend(self._logprobs(logprobs))
        return chunk

    def _logprobs(self, logprobs: list[TokenLogprob]) -> list[pb.TokenLogprob]:
        out = []
        for lp in logprobs:
            top_ids = [t for t, _ in lp.top]
            out.append(pb.TokenLogprob(token=lp.token, logprob=lp.logprob, top_ids=top_ids,
                                       top_logprobs=[v for _, v in lp.top], text=self._text(lp.token),
                                       token_bytes=self._bytes(lp.token), top_texts=[self._text(t) for t in top_ids],
                                       top_bytes=[self._bytes(t) for t in top_ids]))
        return out

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _bytes(self, token: int) -> bytes:
        """The token's bytes (part of a character, for some): the grammar engine's tokenizer
        knows them; without it, its text's."""
        if self.grammars is not None:
            return self.grammars.tokenizer.decode_bytes([token])
        return self._text(token).encode("utf-8", "surrogatepass")
