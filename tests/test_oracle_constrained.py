"""Constrained decoding is lossless: under a grammar, penalties and a logit bias, greedy
specserve with speculation gives the tokens Hugging Face `generate` gives with the same
processing, and its logprobs are HF's log-softmax.

The oracle is transformers `generate(do_sample=False)` on the same GGUF (tests/oracle.py's
model), its logits processed by processors written here: the grammar masked by
llguidance's own matcher and torch bitmask helpers at each step, on HF's tokenizer (not
speculative/processing.py's walk of the tree, nor speculative/grammar.py), HF's
RepetitionPenaltyLogitsProcessor, and OpenAI's presence and frequency penalties and logit
bias in a few lines. specserve is the served path without Ray: a real router (with its
grammar engine) over a real drafter pool and verifier on loopback gRPC, called through
specserve.client, with plain decoding, prompt lookup on the verifier's own rounds (Decode),
fused pld+suffix trees from the pool, and pipelined rounds. A difference is accepted only
at a near-tie of HF's processed scores. A deliberately wrong mask (one token stale) is
caught by the same comparison."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch

from oracle import NEAR_TIE, PROMPTS, hf_model

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
WEATHER = {"name": "get_weather", "description": "Get the current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"]}}
TIME = {"name": "get_time", "description": "Get the local time of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PENALTIES = {"presence_penalty": 0.8, "frequency_penalty": 0.6, "repetition_penalty": 1.3}
LOGPROB_TOLERANCE = 1e-4

# (id, the request's messages, its specserve fields, max tokens)
CASES = [
    ("json_schema", [{"role": "user", "content": "Give me a person named Ann, aged 31, from Oslo, as JSON."}],
     {"json_schema": PERSON}, 40),
    ("regex", [{"role": "user", "content": "On what date did the Second World War end in Europe? "
                                           "Answer as YYYY-MM-DD."}], {"regex": DATE}, 24),
    ("choice", [{"role": "user", "content": "Which is heavier, a kilogram of iron or a kilogram of feathers?"}],
     {"choice": ["iron", "feathers", "they weigh the same"]}, 24),
    ("tool_call", [{"role": "user", "content": "What is the weather in Lisbon, in celsius?"}],
     {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}, 48),
    ("penalties", [{"role": "user", "content": PROMPTS[1][1]}], PENALTIES, 32),  # extraction: pld drafts
    ("logit_bias", [{"role": "user", "content": PROMPTS[3][1]}], {"logit_bias": "the,and"}, 32),
]
# how specserve serves each case: (drafter, router, pipelined). "pld" on the router whose rounds
# run on the verifier (Decode); fused trees and pipelining through the pool
VARIANTS = [("pld", "decode", False), ("pld+suffix", "pool", False)]
EXTRA_VARIANTS = {"json_schema": [("none", "decode", False), ("pld", "pool", True)],
                  "penalties": [("pld", "pool", True)]}


# -- the oracle --------------------------------------------------------------------------------
class GrammarMask:
    """A HF logits processor: the grammar's allowed tokens after the output so far, by
    llguidance's matcher and bitmask on HF's tokenizer. `stale`: the mutation, masking
    with the state one token behind."""

    def __init__(self, grammar: str, prompt_length: int, stale: bool = False):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        model, tok = hf_model()
        self.torch_ops = llguidance.torch
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=model.config.vocab_size)
        self.matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        assert not self.matcher.is_error(), self.matcher.get_error()
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, self.ll_tokenizer.vocab_size)
        self.prompt_length, self.fed, self.stale = prompt_length, 0, stale

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[0, self.prompt_length:].tolist()
        upto = max(len(output) - 1, 0) if self.stale else len(output)
        for token in output[self.fed:upto]:
            if not self.matcher.consume_token(token) and not self.stale:
                raise AssertionError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        self.fed = max(self.fed, upto)
        self.torch_ops.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        scores = scores.clone()
        self.torch_ops.apply_token_bitmask_inplace(scores, self.bitmask)
        return scores


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties on the output's tokens, then the logit bias."""

    def __init__(self, prompt_length: int, presence: float = 0.0, frequency: float = 0.0,
                 bias: dict[int, float] | None = None):
        self.prompt_length, self.presence, self.frequency, self.bias = prompt_length, presence, frequency, bias or {}

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.prompt_length:], minlength=scores.shape[-1]).to(scores.dtype)
        scores = scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
        for token, value in self.bias.items():
            scores[:, token] += value
        return scores


def hf_messages(messages: list[dict], fields: dict) -> list[dict]:
    """The messages as the chat template takes them: a tool request's tools written into a
    system turn as Hermes-style templates write them (router/tools.py's section)."""
    if "tools" not in fields:
        return messages
    from router.tools import SYSTEM_SECTION

    specs = [{"type": "function", "function": t} for t in fields["tools"]]
    return [{"role": "system", "content": SYSTEM_SECTION.format(tools="\n".join(json.dumps(s) for s in specs))},
            *messages]


def hf_grammar(fields: dict) -> str | None:
    """The grammar of the case, written with llguidance's own constructors."""
    from llguidance import LLMatcher

    if "json_schema" in fields:
        return LLMatcher.grammar_from_json_schema(json.dumps(fields["json_schema"]))
    if "regex" in fields:
        return LLMatcher.grammar_from_regex(fields["regex"])
    if "choice" in fields:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in fields["choice"]))
    if "tools" in fields:  # one call of one of the tools, its arguments the function's parameter schema
        schema = {"oneOf": [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                              "arguments": t["parameters"]},
                             "required": ["name", "arguments"], "additionalProperties": False}
                            for t in fields["tools"]]}
        return LLMatcher.grammar_from_lark(f'start: "<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"')
    return None


def bias_of(spec: str) -> dict[int, float]:
    """"the,and": -100 on the first token of " the" and " and", +3 on "The"."""
    _, tok = hf_model()
    words = spec.split(",")
    bias = {tok.encode(f" {w}", add_special_tokens=False)[0]: -100.0 for w in words}
    bias[tok.encode("The", add_special_tokens=False)[0]] = 3.0
    return bias


def hf_processed(messages: list[dict], fields: dict, max_tokens: int, stale: bool = False):
    """HF greedy under the case's processing: (prompt ids, output ids, raw logits, processed scores)."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    model, tok = hf_model()
    enc = tok.apply_chat_template(hf_messages(messages, fields), add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    n = enc["input_ids"].shape[1]
    processors = []
    if fields.get("repetition_penalty", 1.0) != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(fields["repetition_penalty"]))
    bias = bias_of(fields["logit_bias"]) if "logit_bias" in fields else {}
    if fields.get("presence_penalty") or fields.get("frequency_penalty") or bias:
        processors.append(OpenAIPenalties(n, fields.get("presence_penalty", 0.0), fields.get("frequency_penalty", 0.0),
                                          bias))
    grammar = hf_grammar(fields)
    if grammar is not None:
        processors.append(GrammarMask(grammar, n, stale))
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, logits_processor=LogitsProcessorList(
            processors), return_dict_in_generate=True, output_logits=True, output_scores=True)
    return (enc["input_ids"][0].tolist(), out.sequences[0, n:].tolist(), torch.stack(out.logits)[:, 0].float(),
            torch.stack(out.scores)[:, 0].float())


_HF: dict = {}


def hf_case(case_id: str):
    if case_id not in _HF:
        _, messages, fields, max_tokens = next(c for c in CASES if c[0] == case_id)
        _HF[case_id] = hf_processed(messages, fields, max_tokens)
    return _HF[case_id]


def equal_or_near_tie(got: list[int], want: list[int], scores: torch.Tensor, label: str) -> None:
    """`got` is HF's output, or departs from it only where HF's two best processed scores are
    within NEAR_TIE."""
    if got == want:
        return
    pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert pos < len(got) and pos < len(want), f"{label}: lengths differ with equal prefixes ({got} vs {want})"
    top2 = torch.topk(scores[pos], 2).values
    gap = float(top2[0] - top2[1])
    assert gap <= NEAR_TIE, f"{label}: token {pos} is {got[pos]}, HF says {want[pos]} (gap {gap:.2e}): {got} vs {want}"


# -- specserve: router, pool and verifier on loopback ------------------------------------------------
@pytest.fixture(scope="module")
def routers(smollm2):
    """{"decode": client, "pool": client}: two routers on one pool (pld, suffix) and one verifier,
    the first running plain and prompt-lookup rounds on the verifier (Decode), the second
    drafting every round through the pool (fused trees of up to 8 nodes)."""
    from drafter_service.pool import DrafterPool
    from loopback import loopback
    from speculative.grammar import Grammars
    from verifier_service.engine import VerifierEngine

    model, tokenizer = smollm2
    grammars = Grammars.for_tokenizer(tokenizer, model.config.vocab_size)
    pool = DrafterPool(model, kinds=["pld", "suffix"])
    engine = VerifierEngine(model, max_batch=4, max_len=2048, grammars=grammars)
    base = dict(context_length=model.config.max_position_embeddings,
                eos_token_ids=list(tokenizer.eos_token_ids or model.config.eos_token_ids),
                vocab_size=model.config.vocab_size, routed_drafters=("pld", "suffix"), default_drafter="pld",
                draft_length=5, tree_budget=8, adaptive=False, pipelined=False)
    with loopback(pool, engine) as coordinator, _served(coordinator, tokenizer, grammars, base) as clients:
        yield clients


@contextmanager
def _served(coordinator, tokenizer, grammars, base: dict):
    from router.servicer import RouterConfig, RouterServicer
    from router.servicer import serve as serve_router
    from specserve.client import Client

    servers, clients = [], {}
    for name, own_rounds in (("decode", True), ("pool", False)):
        config = RouterConfig(**base, verifier_drafting=own_rounds)
        server, port = serve_router(RouterServicer(tokenizer, coordinator, config, grammars=grammars), "127.0.0.1", 0)
        servers.append(server)
        clients[name] = Client(f"127.0.0.1:{port}", timeout=300)
    try:
        yield clients
    finally:
        for client in clients.values():
            client.close()
        for server in servers:
            server.stop(None)


def specserve_fields(fields: dict) -> dict:
    if "logit_bias" in fields:
        return {**fields, "logit_bias": bias_of(fields["logit_bias"])}
    if "tools" in fields:
        return {**fields, "tools": [{"type": "function", "function": t} for t in fields["tools"]]}
    return fields


def _variants(case_id: str):
    return VARIANTS + EXTRA_VARIANTS.get(case_id, [])


@pytest.mark.parametrize("case_id,drafter,router,pipelined",
                         [(c[0], *v) for c in CASES for v in _variants(c[0])],
                         ids=[f"{c[0]}-{v[0]}-{v[1]}{'-pipelined' if v[2] else ''}" for c in CASES
                              for v in _variants(c[0])])
def test_greedy_under_processing_equals_hf_with_the_same_processing(routers, case_id, drafter, router, pipelined):
    _, messages, fields, max_tokens = next(c for c in CASES if c[0] == case_id)
    prompt, want, _, scores = hf_case(case_id)
    done = routers[router].generate(messages=messages, max_tokens=max_tokens, drafter=drafter, pipelined=pipelined,
                                    **specserve_fields(fields))
    assert done.usage.prompt_tokens == len(prompt)  # the same prompt (the tools' section included)
    equal_or_near_tie(list(done.token_ids), want, scores, f"{case_id} {drafter} {router}")
    if drafter != "none" and (hf_grammar(fields) is not None or "suffix" in drafter):
        # speculation happened: drafts (under penalties prompt lookup may find nothing to copy; the
        # suffix drafter has the earlier variants' outputs) or forced tokens
        assert done.usage.draft_tokens > 0 or done.usage.forced_tokens > 0, done.usage
    if case_id == "tool_call":
        assert done.finish_reason == "tool_calls" and [c.name for c in done.tool_calls] == ["get_weather"]
        import jsonschema

        jsonschema.validate(done.tool_calls[0].parsed_arguments(), WEATHER["parameters"])
    if case_id == "json_schema" and done.finish_reason == "stop":
        import jsonschema

        jsonschema.validate(json.loads(done.text), PERSON)


@pytest.mark.parametrize("case_id,processed", [("penalties", False), ("json_schema", True), ("regex", False)])
def test_logprobs_equal_hf_log_softmax(routers, case_id, processed):
    """Raw: the target's own distribution; processed: after the penalties and the grammar's
    mask. The chosen token's and the five likeliest, each within 1e-4."""
    _, messages, fields, max_tokens = next(c for c in CASES if c[0] == case_id)
    _, want, logits, scores = hf_case(case_id)
    done = routers["pool"].generate(messages=messages, max_tokens=max_tokens, drafter="pld+suffix", logprobs=5,
                                    processed_logprobs=processed, **specserve_fields(fields))
    got = list(done.token_ids)
    same = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert same >= min(8, len(want)) and len(done.logprobs) == len(got)
    hf = torch.log_softmax(scores if processed else logits, dim=-1)
    for j in range(same):
        lp = done.logprobs[j]
        assert lp.token == got[j] and abs(lp.logprob - float(hf[j, got[j]])) < LOGPROB_TOLERANCE, (j, lp.logprob)
        top = torch.topk(hf[j], 5)
        for alt, value in zip(lp.top, top.values.tolist()):
            if value == float("-inf"):  # past the tokens the grammar allows
                assert alt.logprob == float("-inf")
            else:
                assert abs(alt.logprob - value) < LOGPROB_TOLERANCE, (j, alt, value)


def test_a_stale_grammar_mask_in_the_oracle_is_caught(routers):
    """The mutation: HF masked with the grammar's state one token behind gives another output,
    and the comparison says so (it would pass a constrained decoder that lags the same way)."""
    _, messages, fields, max_tokens = next(c for c in CASES if c[0] == "json_schema")
    _, stale, _, stale_scores = hf_processed(messages, fields, 24, stale=True)
    done = routers["decode"].generate(messages=messages, max_tokens=24, drafter="pld", **specserve_fields(fields))
    with pytest.raises(AssertionError):
        equal_or_near_tie(list(done.token_ids), stale, stale_scores, "stale mask")


def test_specserve_generate_in_process_under_a_regex_equals_hf(capsys):
    """`specserve generate --regex` in this process (the target's grammars handed to the loop)."""
    from commands.cli import main as cli_main

    _, messages, fields, max_tokens = next(c for c in CASES if c[0] == "regex")
    _, want, _, scores = hf_case("regex")
    assert cli_main(["generate", "--chat", "--json", "--prompt", messages[0]["content"], "--regex", fields["regex"],
                     "--max-tokens", str(max_tokens), "--drafter", "pld", "--logprobs", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    equal_or_near_tie(out["token_ids"], want, scores, "specserve generate --regex")
    assert len(out["logprobs"]) == len(out["token_ids"]) and out["finish_reason"] == "stop"
