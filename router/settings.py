"""The router's settings: drafter choice, speculation and its adaptive control.

The `[router]` section of `specserve serve`'s configuration (cluster/config.py)
and the base of the router's runtime config (router.servicer.RouterConfig), so
each default is written here once. Loads pydantic only, no torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from speculative.drafter_kinds import is_drafter


class RouterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a typo in the file is an error, not a silent default

    default_drafter: str = Field("auto", description="drafter of requests that name none; 'auto' = expertise routing")
    fused_drafters: int = Field(1, ge=1, le=8, description="drafters per routed request, their trees fused into "
                                                           "one (1 = a single drafter, no fusion)")
    draft_length: int = Field(5, ge=0, le=64, description="most tokens each drafter drafts per round")
    tree_budget: int = Field(8, ge=1, le=128, description="most nodes of a round's draft tree, fused or one "
                                                          "drafter's (greedy model drafters branch to fill it)")
    pipelined: bool = Field(False, description="draft each next round while the verifier checks this one "
                                               "(PEARL post-verify); a request may override it")
    verifier_drafting: bool = Field(True, description="rounds that ask no drafter but prompt lookup or the suffix "
                                                      "drafter (the verifier keeps a suffix index of its own), or "
                                                      "none, run on the verifier (Decode): no hop to a pool or "
                                                      "back to the router a round")
    eagle_placement: Literal["verifier", "pool"] = Field(
        "verifier", description="where an eagle drafter runs: 'verifier', beside the target in the verifier's "
        "process (Decode rounds; no features on the wire), or 'pool', a drafter pool the verifier sends each "
        "round's features to (3,456 bytes a verified position for SmolLM2-135M); a request may override it "
        "(GenerateRequest.eagle_placement). A request that is pipelined, or fuses eagle with a drafter only "
        "a pool runs, or a router without verifier_drafting, places it in a pool")
    prefill_pools_ahead: bool = Field(False, description="prefill a request's drafter pools while the verifier "
                                                         "prefills it, not after it: for pools on cores, machines "
                                                         "or GPUs of their own, where a model drafter's prefill "
                                                         "otherwise delays the first drafted round by its whole "
                                                         "time; on cores the verifier uses too, the two compete")
    adaptive: bool = Field(True, description="draft length per request (its acceptance) and per verifier "
                                             "load (goodput); off: always draft_length")
    stop_confidence: float = Field(0.3, ge=0, le=1, description="a model drafter ends its draft after a token "
                                                                "it drafted with less confidence (SpecDec++)")
    verify_row_cost: float = Field(0.06, gt=0, description="one more request's row (one token) in a verification "
                                                           "pass as a share of a one-row, one-token pass: the "
                                                           "goodput model's cost of batching")
    verify_token_cost: float = Field(0.06, gt=0, description="one more verified token in a row as a share of a "
                                                             "one-token target pass: the goodput model's cost "
                                                             "of a draft")
    verify_pad_cost: float = Field(0.01, ge=0, description="attention over one more padded slot of one row of a "
                                                           "verification pass, as a share of a one-token pass")
    learn_verify_costs: bool = Field(True, description="learn the three verify costs from the verifiers' pass "
                                                      "timings, starting from the settings above; off: the "
                                                      "settings as they are")
    calibrate: bool = Field(True, description="greedy fusion ranks each drafter's nodes by its confidence "
                                              "calibrated to the rate the target took its tokens at that "
                                              "confidence (learned as the router runs); off: as the drafters "
                                              "give them")
    routing_refresh_s: float = Field(5.0, ge=0, description="how often a router syncs drafter statistics")
    service_wait_s: float = Field(30.0, ge=0, description="how long a request waits (within its deadline) for a "
                                  "verifier while none is registered: the service is starting or one restarts")
    max_prompt_tokens: int | None = Field(None, ge=1, description="longer prompts are refused (default: as long as "
                                                                 "the context, `[verifiers] max_len`, leaves room "
                                                                 "for one output token)")

    @field_validator("default_drafter")
    @classmethod
    def _known_default(cls, name: str) -> str:
        if name != "auto" and not is_drafter(name):
            raise ValueError(f"unknown drafter {name!r}")
        return name
