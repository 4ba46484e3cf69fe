"""The bench's client of a server's OpenAI-compatible HTTP API (`specserve serve`,
http://HOST:PORT/v1), with the surface of the gRPC `specserve.client.Client` the
bench calls: `generate(messages=..., max_tokens=..., drafter=..., namespace=...)`
returning a `specserve.client.Completion` (token ids and usage: drafter, target
passes, draft and accepted draft tokens), so one bench path drives either API.

It goes through the official `openai` package, as a user's code would: a chat
completion with specserve's own fields in the body (`drafter`, `namespace`,
`top_k`, `return_token_ids`). The model is the first one GET /v1/models lists.
Sampling defaults are the gRPC client's: greedy (temperature 0), top_p 1, top_k 0
(the HTTP API's own default temperature is OpenAI's 1, so it is always sent).

A failed call raises `HttpError` (status, message); `REQUEST_FAILED` is the errors
of either API the bench counts as a failed request.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from specserve.client import Completion, SpecserveError, Usage


class HttpError(Exception):
    """A call over HTTP failed: `status` is the HTTP status (None: no answer, e.g. refused
    or timed out), `message` the server's or the client's message."""

    def __init__(self, status: int | None, message: str):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status, self.message = status, message


REQUEST_FAILED = (SpecserveError, HttpError)  # a request that failed, over gRPC or HTTP


def _openai():
    """The openai package, which only the HTTP modes need (a test extra, not a dependency)."""
    try:
        import openai
    except ImportError as e:
        raise ImportError("the bench's HTTP modes call the server with the openai package: "
                          "pip install 'openai>=1.40'") from e
    return openai


def _message(e: Exception) -> str:
    body = getattr(e, "body", None)  # the server's {"error": {"message", ...}}, unwrapped by the client
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    return str(e)


class HttpClient:
    """Blocking client of http://HOST:PORT (the server's root; /v1 is added); safe to
    share between threads. No retries: a request that fails counts as failed, as over
    gRPC a call that exhausts its attempts does."""

    def __init__(self, url: str, timeout: float | None = None):
        self.url = url.rstrip("/")
        base = self.url if self.url.endswith("/v1") else self.url + "/v1"
        self._openai = openai = _openai()
        self._client = openai.OpenAI(base_url=base, api_key="none", timeout=timeout, max_retries=0)
        self._model: str | None = None
        self._lock = threading.Lock()

    def model(self) -> str:
        """The served model's id: the first GET /v1/models lists (asked once)."""
        with self._lock:
            if self._model is None:
                try:
                    listed = self._client.models.list().data
                except self._openai.OpenAIError as e:
                    raise HttpError(getattr(e, "status_code", None), _message(e)) from e
                if not listed:
                    raise HttpError(None, f"{self.url}/v1/models lists no model")
                self._model = listed[0].id
            return self._model

    def generate(self, *, messages: Sequence[Mapping[str, str]], max_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, drafter: str = "",
                 namespace: str = "") -> Completion:
        model, openai = self.model(), self._openai
        try:
            r = self._client.chat.completions.create(
                model=model, messages=[dict(m) for m in messages], max_tokens=max_tokens, temperature=temperature,
                top_p=top_p, seed=openai.NOT_GIVEN if seed is None else seed,
                extra_body={"top_k": top_k, "drafter": drafter, "namespace": namespace, "return_token_ids": True})
        except openai.OpenAIError as e:
            raise HttpError(getattr(e, "status_code", None), _message(e)) from e
        body = r.model_dump()
        if len(body.get("choices") or []) != 1 or not isinstance(body.get("usage"), dict):
            raise HttpError(None, f"expected one choice and a usage, got {str(body)[:200]}")
        choice, u = body["choices"][0], body["usage"]
        if choice.get("token_ids") is None:
            raise HttpError(None, "the answer has no token_ids: is the server specserve?")
        try:
            usage = Usage(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"],
                          target_forward_passes=u["target_forward_passes"], draft_tokens=u["draft_tokens"],
                          accepted_draft_tokens=u["accepted_draft_tokens"],
                          mean_accepted_tokens=u["mean_accepted_tokens"], drafter="+".join(u["drafters"]))
        except KeyError as e:
            raise HttpError(None, f"the usage has no {e.args[0]}: is the server specserve?") from None
        return Completion(text=(choice.get("message") or {}).get("content") or "",
                          token_ids=tuple(choice["token_ids"]), finish_reason=choice.get("finish_reason") or "",
                          usage=usage, request_id=body.get("id", ""))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> HttpClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
