"""The client-facing `Specserve` gRPC service."""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator

import grpc

from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from protos.convert import params_from_pb
from protos.server import call_deadline, start_server
from speculative.drafter_kinds import VERIFIER_DRAFTERS, abilities, check_drafter, check_eagle_placement
from runtime.errors import PromptTooLong
from speculative.namespaces import DEFAULT_NAMESPACE, Namespaces, check_namespace
from speculative.sampling import InvalidArgument
from speculative.stopping import clip
from runtime.tokenizer import Tokenizer
from speculative.grammar import Grammars
from speculative.tree import nodes_for_depth

from .coordinator import Cancelled, Coordinator, DeadlineExceeded, Job, NoService
from .domains import DOMAINS
from .adaptive import SpeculationControl
from .auth import Admission, Denied, Gatekeeper, bearer
from .expertise import ExpertiseRouter
from .goodput import route_name, speedup
from .metrics import RouterMetrics
from .settings import RouterSettings
from .stats import RoundStats
from .constraints import constrained, draft_length
from .output import ChunkWriter
from .tools import Function, check_choice, functions, template_messages

log = logging.getLogger(__name__)

ROLES = {"system", "developer", "user", "assistant", "tool"}


# text that a tokenizer gives back as it was unless it normalises: composes (e + U+0301, Hangul
# jamo), drops (a control character), strips or folds (case, accents, outer whitespace)
ROUND_TRIP = " e\u0301\x01\u1100\u1161 Ab\u00e9  \t"


def prompt_char_limit(tokenizer: Tokenizer, max_prompt_tokens: int) -> int | None:
    """The most characters a text of max_prompt_tokens tokens can have, or None where the
    tokenizer gives no safe bound. Each token stands for at most as many characters of the text
    as its piece has: a byte-level piece writes each byte as one character (and a character is
    at least one byte), a SentencePiece piece each character as one (a byte-fallback piece, six
    for one byte), a special token is its own text. That is the text after the normaliser, so
    it bounds the prompt only where the normaliser does not shorten it: a tokenizer must give
    ROUND_TRIP back unchanged (SmolLM2's and the other byte-level BPE ones do; Qwen2's NFC
    composes and gets no bound). Then more characters than max_prompt_tokens x the longest
    piece are more than max_prompt_tokens tokens."""
    if tokenizer.decode(tokenizer.encode(ROUND_TRIP, add_special_tokens=False)) != ROUND_TRIP:
        return None
    return max_prompt_tokens * max(len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size))


def prompt_limit(settings: RouterSettings, context_length: int) -> int:
    """The most tokens a prompt may have: what the context leaves for one output token, or
    less if `max_prompt_tokens` says so."""
    return min(settings.max_prompt_tokens or context_length, context_length - 1)


class RequestFailed(Exception):
    """Why a request could not go on: a gRPC status, its message, and the request field at
    fault when there is one (the HTTP API maps these to its own codes)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None, too_long: bool = False,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.code, self.message, self.field, self.too_long = code, message, field, too_long
        self.retry_after_s = retry_after_s  # when a limit is spent: how long until it resets

    def abort(self, context: grpc.ServicerContext) -> None:
        # the field at fault rides along for callers that map it (tests/http_front.py, as the ingress)
        metadata = [("specserve-field", self.field)] if self.field else []
        if self.retry_after_s is not None:
            metadata.append(("retry-after", str(math.ceil(self.retry_after_s))))
        if metadata:
            context.set_trailing_metadata(tuple(metadata))
        context.abort(self.code, self.message)


@dataclass(frozen=True)
class Call:
    """What the router knows of its caller: when it stops waiting (time.monotonic, None
    for never), whether it is still there, and the API key it gave."""

    deadline: float | None = None
    is_active: Callable[[], bool] = lambda: True
    api_key: str | None = None

    @classmethod
    def of_grpc(cls, context: grpc.ServicerContext) -> Call:
        metadata = dict(context.invocation_metadata() or ())
        return cls(call_deadline(context), context.is_active, bearer(metadata.get("authorization")))


class RouterConfig(RouterSettings):
    """A router's settings (router.settings, every default there) and what it takes
    from its target and its drafter pools."""

    context_length: int
    eos_token_ids: list[int]
    vocab_size: int  # the target's
    routed_drafters: tuple[str, ...] = ()  # what "auto" routes over: the pools' kinds
    default_max_tokens: int = 128  # of a request that sets no max_tokens
    max_stop_strings: int = 8
    max_prompt_chars: int | None = None  # longer prompts are refused untokenized (prompt_char_limit)

    @classmethod
    def of(cls, settings: RouterSettings, **runtime) -> RouterConfig:
        """`settings` as they are, with the target-derived fields and `routed_drafters`."""
        return cls(**settings.model_dump(), **runtime)


class RouterServicer(pb_grpc.SpecserveServicer):
    """Validates requests, picks their drafters, runs them through the coordinator.

    With an `expertise` router, a request that names no drafter (and a default
    of "auto") gets the route with the best measured goodput on its domain (the
    client's hint, else the prompt classifier's guess): plain decoding, one of
    `routed_drafters`, or a set of `fused_drafters` of them, fused with each
    weighted by its reliability (measured acceptance) there
    (router.expertise, router.goodput). After every request each of its
    drafters' acceptance is recorded for its (drafter, domain), and the
    request's estimated speedup over plain decoding for its (route, domain). A
    request that names a drafter gets that one alone."""

    def __init__(self, tokenizer: Tokenizer, coordinator: Coordinator, config: RouterConfig,
                 expertise: ExpertiseRouter | None = None, metrics: RouterMetrics | None = None,
                 gatekeeper: Gatekeeper | None = None, grammars: Grammars | None = None):
        """`grammars`: the target tokenizer's, for constraints and required tool calls (None:
        such requests are refused)."""
        self.tokenizer, self.coordinator, self.config, self.expertise = tokenizer, coordinator, config, expertise
        self.grammars = grammars
        self.gatekeeper = gatekeeper or Gatekeeper(None, require_keys=False)
        # each memory namespace's expertise statistics, learned apart (speculative.namespaces)
        self._expertise = None if expertise is None else Namespaces(
            lambda ns: expertise if ns == DEFAULT_NAMESPACE else expertise.in_namespace(ns),
            forget=ExpertiseRouter.close)
        self.metrics = metrics or RouterMetrics()
        self.ongoing = 0  # requests in flight, gRPC and HTTP: what router autoscaling follows
        self._ongoing_lock = threading.Lock()
        if coordinator.services.pass_costs is not None:
            self.metrics.watch_pass_costs(coordinator.services.pass_costs)
        if config.default_drafter == "auto" and (expertise is None or not config.routed_drafters):
            raise ValueError("default_drafter 'auto' needs an expertise router and routed_drafters")
        if config.fused_drafters < 1 or config.tree_budget < 1:
            raise ValueError("fused_drafters and tree_budget must be at least 1")

    # -- validation -----------------------------------------------------------
    def _job(self, req: pb.GenerateRequest, call: Call) -> Job:
        cfg = self.config
        if req.prompt and req.messages:
            raise InvalidArgument("prompt", "give a prompt or messages, not both")
        if req.messages:
            for i, m in enumerate(req.messages):
                if m.role not in ROLES:
                    raise InvalidArgument(f"messages[{i}].role", f"must be one of {', '.join(sorted(ROLES))}")
            if not any(m.content.strip() or m.tool_calls for m in req.messages):
                raise InvalidArgument("messages", "all messages are empty")
        elif not req.prompt.strip():
            raise InvalidArgument("prompt", "must not be empty")
        if req.tools and not req.messages:
            raise InvalidArgument("tools", "need chat messages, not a prompt")
        tools = functions(req.tools)
        choice = check_choice(req.tool_choice, tools) if tools or req.tool_choice else "none"
        ids = self._prompt_ids(req, tools if choice != "none" else [])
        limit = prompt_limit(cfg, cfg.context_length)
        if len(ids) > limit:
            raise PromptTooLong("prompt", f"{len(ids)} tokens are more than the {limit} a prompt may have "
                                          f"(the context is {cfg.context_length} tokens, [verifiers] max_len)")
        params = params_from_pb(req.sampling, cfg.default_max_tokens)
        params.validate(len(ids), cfg.context_length)
        params.check_vocabulary(cfg.vocab_size)
        params = constrained(params, req, self.grammars, tools, choice, cfg.eos_token_ids)
        length = draft_length(req, cfg.draft_length)
        if req.domain_hint and req.domain_hint not in DOMAINS:
            raise InvalidArgument("domain_hint", f"unknown domain {req.domain_hint!r}; known: {', '.join(DOMAINS)}")
        namespace = check_namespace(req.namespace)
        pipelined = req.pipelined if req.HasField("pipelined") else cfg.pipelined
        placement = check_eagle_placement(req.eagle_placement or cfg.eagle_placement)
        domain, drafters = self._drafters(req, self._expertise_of(namespace), pipelined, length, placement)
        placement = self._eagle_placement(placement, drafters, pipelined)
        routed = req.drafter == "" and cfg.default_drafter == "auto"
        if not routed:  # a routed request's heads were judged as its routes were (`_draft_pays`)
            drafters = self._heads_that_draft(drafters, placement, pipelined, length, domain)
        unserved = [d for d, _ in drafters if d != "none" and d not in cfg.routed_drafters
                    and not (placement == "verifier" and abilities(d).drafts_from_features)]
        if req.drafter and cfg.routed_drafters and unserved:  # the pools would refuse it mid-request
            raise InvalidArgument("drafter", f"no drafter pool here serves {unserved[0]!r}; they serve "
                                             f"{', '.join(cfg.routed_drafters)}")
        if len(req.stop) > cfg.max_stop_strings or any(not s for s in req.stop):
            raise InvalidArgument("stop", f"at most {cfg.max_stop_strings} non-empty strings")
        speculation = None
        if cfg.adaptive:
            # a routed drafter's reliability on the domain is the best first guess of its acceptance
            prior = drafters[0][1] if routed else 0.5
            speculation = self._control(prior, pipelined, length)
        return Job(request_id=req.request_id or uuid.uuid4().hex, prompt_ids=ids, params=params,
                   drafters=drafters, draft_length=length,
                   tree_budget=nodes_for_depth(length, cfg.draft_length, cfg.tree_budget) if length else 1,
                   vocab_size=cfg.vocab_size, eos_token_ids=list(params.stop_token_ids), domain=domain,
                   deadline=call.deadline, is_cancelled=lambda: not call.is_active(), pipelined=pipelined,
                   speculation=speculation, stop_confidence=cfg.stop_confidence, namespace=namespace,
                   verifier_drafting=cfg.verifier_drafting, prefill_pools_ahead=cfg.prefill_pools_ahead,
                   eagle_placement=placement,
                   # a routed request feeds the verifier's suffix index whatever drafted it, so that the
                   # suffix drafter's memory holds all of the namespace's routed text, as if it drafted all
                   teaches_suffix=(req.drafter or cfg.default_drafter) == "auto" and "suffix" in cfg.routed_drafters)

    def _eagle_placement(self, placement: str, drafters: tuple[tuple[str, float], ...], pipelined: bool) -> str:
        """Where the request's eagle drafter runs: the verifier, as asked, only where the verifier
        runs all its rounds itself (Decode: no pipelining, no drafter only a pool runs beside it);
        else a pool."""
        kinds = [d for d, _ in drafters]
        if placement == "verifier" and (pipelined or not self.config.verifier_drafting or any(
                k not in VERIFIER_DRAFTERS and not abilities(k).drafts_from_features for k in kinds)):
            return "pool"
        return placement

    def _heads_that_draft(self, drafters: tuple[tuple[str, float], ...], placement: str, pipelined: bool,
                          length: int | None, domain: str | None) -> tuple[tuple[str, float], ...]:
        """A request's own drafters less an eagle head on the verifier that, at the load the request
        starts at, by what the head last cost there and by the acceptance it last had on the
        request's domain, would not draft at all (adaptive lengths, rounds in sequence): a
        request with a head pays for it in every pass, drafting or not (its prefill over the
        prompt, no prefix cache, its first rounds' drafts at a guessed acceptance), so it is then
        served by its other drafters, or plainly. The tokens are the same."""
        cfg = self.config
        if placement != "verifier" or pipelined or not (cfg.adaptive and cfg.verifier_drafting):
            return drafters
        load, costs = self.coordinator.load(), self.coordinator.draft_costs
        fused = len(drafters) > 1  # each fused drafter's control starts from its reliability (rounds.Request)

        def drafts(kind: str, reliability: float) -> bool:
            control = self._control(reliability if fused else 0.5, pipelined, length)
            return costs.pays(control, kind, load, drafted_by_verifier=True, domain=domain)

        kept = tuple((k, r) for k, r in drafters if not abilities(k).drafts_from_features or drafts(k, r))
        return kept or (("none", 1.0),)

    def _prompt_ids(self, req: pb.GenerateRequest, tools: list[Function]) -> list[int]:
        """The prompt's tokens (of messages: of the chat template's rendering, with the tools the
        model may call). A text longer than max_prompt_chars is refused untokenized:
        `tokenizers` holds the GIL while it encodes, and a 10 MB prompt stalled every thread
        of the router for 10 s."""
        limit = self.config.max_prompt_chars
        if not req.messages:
            _check_chars(req.prompt, limit)
            return self.tokenizer.encode(req.prompt)
        messages, specs = template_messages(req.messages, tools, self.tokenizer.template_knows_tools)
        if limit is None:
            return self.tokenizer.encode_chat(messages, tools=specs)
        # as encode_chat: the template writes the special tokens
        text = self.tokenizer.render_chat(messages, tools=specs)
        _check_chars(text, limit)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def close(self) -> None:
        """Write every namespace's routing outcomes not yet in the state store."""
        for expertise in {id(e): e for e in [self.expertise, *(self._expertise.values() if self._expertise else ())]
                          if e is not None}.values():
            expertise.close()

    def _expertise_of(self, namespace: str) -> ExpertiseRouter | None:
        return None if self._expertise is None else self._expertise.get(namespace)

    def _control(self, prior: float, pipelined: bool, length: int | None = None) -> SpeculationControl:
        """A new adaptive control with the configured costs, starting from acceptance `prior`,
        drafting at most `length` tokens a round (None: the server's draft length)."""
        cfg = self.config
        return SpeculationControl(cfg.draft_length if length is None else length, prior=prior, pipelined=pipelined,
                                  verify_row_cost=cfg.verify_row_cost, verify_token_cost=cfg.verify_token_cost,
                                  verify_pad_cost=cfg.verify_pad_cost, pass_costs=self.coordinator.services.pass_costs)

    def _drafters(self, req: pb.GenerateRequest, expertise: ExpertiseRouter | None, pipelined: bool = False,
                  length: int | None = None,
                  placement: str = "pool") -> tuple[str | None, tuple[tuple[str, float], ...]]:
        """The request's domain (None without an expertise router) and its (drafter, reliability)
        pairs, from the expertise statistics of its namespace; plain decoding when the request
        drafts nothing (`length` 0)."""
        drafter = req.drafter or self.config.default_drafter
        hint = req.domain_hint or None
        if length == 0:
            return (None if expertise is None else expertise.domain(_user_text(req), hint)), (("none", 1.0),)
        if drafter == "auto" and expertise is not None:  # else check_drafter refuses "auto"
            cfg = self.config
            # what the verifier drafts in its own rounds: no hop; a set of only prompt lookup and
            # the suffix drafter is drafted there by its first alone (router.coordinator.rounds)
            on_verifier = cfg.verifier_drafting and not pipelined
            # (an eagle head on the verifier asks no pool either, but each level costs a share of a
            # pass there: its routes start from the prior of those that ask a pool, and earn the rest)
            no_hop = set(VERIFIER_DRAFTERS) if on_verifier else set()
            same_as_alone = set(VERIFIER_DRAFTERS) - {"none"} if on_verifier else set()
            route = expertise.route(_user_text(req), cfg.routed_drafters, k=cfg.fused_drafters, hint=hint,
                                    usable=self._draft_pays(expertise, pipelined, placement), no_hop=no_hop,
                                    same_as_alone=same_as_alone, pipelined=pipelined)
            return route.domain, tuple((d, route.reliability[d]) for d in route.drafters)
        check_drafter(drafter)
        domain = None if expertise is None else expertise.domain(_user_text(req), hint)
        if "+" in drafter:  # several pinned: each is asked by the coordinator, their trees fused
            kinds = tuple(dict.fromkeys(drafter.split("+")))
            return domain, tuple((k, 1.0 if domain is None else expertise.reliability(k, domain)) for k in kinds)
        return domain, ((drafter, 1.0),)  # alone: its reliability weighs nothing

    def _draft_pays(self, expertise: ExpertiseRouter, pipelined: bool,
                    placement: str = "pool") -> Callable[[str, str], bool] | None:
        """Whether "auto" may route a drafter on a domain: not one only a pool runs that, at the
        load the request starts at and by what it last cost there, would not draft at all (the
        pool's prefill of the request, and each probe's hop, would slow the batch for nothing).
        Sequential rounds with adaptive lengths only: what a drafter costs is remembered for
        those (`Coordinator.draft_costs`). An eagle drafter the verifier runs (`placement`)
        pays no hop, only its tokens' cost (`_heads_that_draft`)."""
        cfg = self.config
        if not (cfg.adaptive and cfg.verifier_drafting) or pipelined:
            return None
        load, costs = self.coordinator.load(), self.coordinator.draft_costs
        on_verifier = placement == "verifier"
        return lambda kind, domain: (kind in VERIFIER_DRAFTERS or costs.pays(
            self._control(expertise.reliability(kind, domain), pipelined), kind, load,
            drafted_by_verifier=on_verifier and abilities(kind).drafts_from_features, domain=domain))

    # -- running ------------------------------------------------------------------
    def admit(self, api_key: str | None) -> Admission | None:
        """The caller's admission by its key and the key's limits (router.auth); raises RequestFailed."""
        try:
            return self.gatekeeper.admit(api_key)
        except Denied as e:
            raise RequestFailed(grpc.StatusCode[e.status], e.message, retry_after_s=e.retry_after_s) from None

    def chunks(self, req: pb.GenerateRequest, call: Call) -> Iterator[pb.GenerateChunk]:
        """The request's output, a chunk per round; the last carries the finish reason and usage.
        Raises RequestFailed. The one path into the router: gRPC and HTTP both come through here."""
        admission = self.admit(call.api_key)
        try:
            job = self._job(req, call)
        except InvalidArgument as e:
            self.gatekeeper.finish(admission, 0)
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field,
                                too_long=isinstance(e, PromptTooLong)) from None
        stats = RoundStats()
        out = ChunkWriter(job.request_id, self.tokenizer, req.stop, tools=bool(req.tools) and req.tool_choice != "none",
                          grammars=self.grammars)
        count, ended = 0, None  # ended: when the last token was known (a request that completed)
        with self._ongoing_lock:
            self.ongoing += 1
        try:
            for new in self.coordinator.run(job, stats):
                # the coordinator clipped them already: this names why the output ends, if it does
                tokens, reason = clip(new, count, job.params.max_tokens, job.eos_token_ids)
                count += len(tokens)
                chunk = out.chunk(tokens, new.logprobs, last=reason is not None)
                if out.stopped:
                    reason = "stop"
                if reason is not None:
                    ended = time.monotonic()
                    # a call cut short by max_tokens ends the output as "length"; its text stays text
                    chunk.finish_reason = "tool_calls" if chunk.tool_calls and reason == "stop" else reason
                    chunk.usage.CopyFrom(self._usage(job, stats, count))
                yield chunk
                if reason is not None:
                    return
        except DeadlineExceeded:
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded during generation") from None
        except Cancelled:
            return
        except NoService as e:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except grpc.RpcError as e:
            raise RequestFailed(grpc.StatusCode.INTERNAL, f"downstream {e.code().name}: {e.details()}") from None
        finally:
            with self._ongoing_lock:
                self.ongoing -= 1
            self.gatekeeper.finish(admission, len(job.prompt_ids) + count)
            self.metrics.observe(stats, "+".join(d for d, _ in job.drafters), count, job.domain)
            expertise = self._expertise_of(job.namespace)
            if expertise is not None and job.domain is not None:
                for drafter, own in stats.per_drafter.items():
                    if own.proposed:
                        expertise.record(drafter, job.domain, own.proposed, own.accepted)
                self._record_goodput(expertise, job, stats, count, ended)

    def _record_goodput(self, expertise: ExpertiseRouter, job: Job, stats: RoundStats, count: int,
                        ended: float | None) -> None:
        """The request's estimated speedup over plain decoding (router.goodput.speedup), for its
        route on its domain: only for a request that completed, over its tokens after the
        first prefill's."""
        first = stats.first_prefilled()
        if ended is None or first is None:
            return
        gain = speedup(count - 1, ended - first, stats.plain_pass_seconds, stats.timed_passes)
        if gain is not None:
            try:
                kinds = [d for d, _ in job.drafters]
                expertise.record_goodput(kinds, job.domain, gain, job.pipelined)
                self.metrics.observe_speedup(route_name(kinds, job.pipelined), job.domain, gain)
            except ValueError as e:  # a drafter name no route can have: the request is done all the same
                log.warning("no goodput recorded for %s: %s", job.request_id, e)

    @staticmethod
    def _usage(job: Job, stats: RoundStats, completion: int) -> pb.Usage:
        passes = max(stats.target_forward_passes, 1)
        return pb.Usage(prompt_tokens=len(job.prompt_ids), completion_tokens=completion,
                        target_forward_passes=stats.target_forward_passes, draft_tokens=stats.draft_tokens,
                        accepted_draft_tokens=stats.accepted_draft_tokens,
                        mean_accepted_tokens=completion / passes, drafter="+".join(d for d, _ in job.drafters),
                        reused_drafts=stats.reused_drafts, forced_tokens=stats.forced_tokens)

    def Generate(self, request, context):
        resp = pb.GenerateResponse(finish_reason="length")
        text = []
        try:
            for chunk in self.chunks(request, Call.of_grpc(context)):
                resp.request_id = chunk.request_id
                resp.token_ids.extend(chunk.token_ids)
                resp.logprobs.extend(chunk.logprobs)
                resp.tool_calls.extend(chunk.tool_calls)
                text.append(chunk.text)
                if chunk.finish_reason:
                    resp.finish_reason = chunk.finish_reason
                    resp.usage.CopyFrom(chunk.usage)
        except RequestFailed as e:
            e.abort(context)
        if not resp.request_id:  # cancelled before anything was generated
            return pb.GenerateResponse()
        resp.text = "".join(text)
        return resp

    def GenerateStream(self, request, context):
        try:
            yield from self.chunks(request, Call.of_grpc(context))
        except RequestFailed as e:
            e.abort(context)


def _check_chars(text: str, limit: int | None) -> None:
    if limit is not None and len(text) > limit:
        raise PromptTooLong("prompt", f"{len(text)} characters are more than the {limit} that the token limit "
                                      "can hold")


def _user_text(req: pb.GenerateRequest) -> str:
    """What the domain classifier reads: the prompt, or the last user message."""
    if req.prompt:
        return req.prompt
    users = [m.content for m in req.messages if m.role == "user"]
    return users[-1] if users else req.messages[-1].content


def serve(servicer: RouterServicer, host: str = "127.0.0.1", port: int = 50051, max_workers: int = 32,
          tls: tuple[bytes, bytes] | None = None) -> tuple[grpc.Server, int]:
    """Start the router's gRPC server (health checking and reflection included); with `tls`
    (PEM certificate chain, PEM key) it speaks only TLS."""
    service = pb.DESCRIPTOR.services_by_name["Specserve"].full_name
    return start_server(pb_grpc.add_SpecserveServicer_to_server, servicer, service, host, port, max_workers,
                        tls=tls)
