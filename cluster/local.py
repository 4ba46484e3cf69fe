"""The single-process engine: a loaded target plus drafters, one request at a time."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from cluster.env import cache_dir_from_env, cpu_tuning_from_env
from drafter_service.registry import make_drafter
from runtime import loading
from speculative.decoding import GenerationResult, generate
from speculative.sampling import InvalidArgument, SamplingParams


def cpu_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pin_to_cores(cores: list[int], setting: str) -> None:
    """Run every thread of this process, and the threads they start later, on `cores` only
    (Linux pins threads one by one: pid 0 would pin only the calling thread)."""
    allowed = os.sched_getaffinity(0)
    if unknown := sorted(set(cores) - allowed):
        raise ValueError(f"{setting}: cores {unknown} are not among this node's {sorted(allowed)}")
    pin_threads(cores)


def pin_threads(cores) -> None:
    """Every thread of this process on `cores`, unchecked (putting back what it had)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread has ended
            pass


def set_cpu_threads() -> None:
    """Use every core this process may run on (torch's default can be lower)."""
    torch.set_num_threads(cpu_cores())


@dataclass
class Request:
    prompt: str
    chat: bool = False
    params: SamplingParams = SamplingParams()
    drafter: str = "pld"
    draft_length: int = 5
    tree_budget: int | None = None  # most draft nodes per round; None: draft_length
    namespace: str = ""  # the memory drafters learn in across requests (speculative.namespaces)
    parallel_layers: int = 1  # EasySpec layer-parallel drafting of model drafters (1: exact)
    calibrate: bool = True  # fused drafters rank nodes by calibrated confidences (greedy)


class LocalEngine:
    def __init__(self, model, tokenizer, group=None, cuda_graphs: bool | None = None):
        """`cuda_graphs`: run the rounds' passes at static shapes from captured CUDA graphs
        (runtime/graphs.py; None: on CUDA, one process only)."""
        self.model, self.tokenizer = model, tokenizer
        self.group = group  # the other ranks of a tensor-parallel model (verifier_service/tp_group.py)
        self.cuda_graphs = (model.device.type == "cuda" and group is None) if cuda_graphs is None else cuda_graphs
        self._static = self._drafter_passes = None

    def drafter_passes(self):
        """The caches and graphs the requests' model drafters take in turn (None: off)."""
        if self.cuda_graphs and self._drafter_passes is None:
            from runtime.graphs import SharedPasses

            self._drafter_passes = SharedPasses()
        return self._drafter_passes

    def static_passes(self):
        """The static passes every request runs its rounds in (one cache of the model's context,
        kept across requests with the graphs captured over it); None when off."""
        if not self.cuda_graphs or self.group is not None:  # a tensor-parallel target runs eagerly
            return None
        if self._static is None:
            from runtime.graphs import StaticPasses

            self._static = StaticPasses.for_requests(self.model, self.model.config.max_position_embeddings)
        return self._static

    def close(self) -> None:
        """Stop a tensor-parallel model's other ranks (they also stop when this process exits)."""
        if self.group is not None:
            self.group.close()

    @classmethod
    def load(cls, model: str | None = None, device: str = "cpu", dtype: str = "float32",
             tensor_parallel: int = 1) -> "LocalEngine":
        """`tensor_parallel` > 1 spawns that many ranks here (verifier_service/tp_group.py)."""
        set_cpu_threads()
        if tensor_parallel > 1:
            from verifier_service.tp_group import load_local

            return cls(*load_local(model, tensor_parallel, device, dtype, cache_dir_from_env(),
                                   cpu_tuning_from_env()))
        return cls(*loading.load(model, device, dtype, cache_dir=cache_dir_from_env(),
                                 cpu_tuning=cpu_tuning_from_env()))

    def prompt_ids(self, prompt: str, chat: bool) -> list[int]:
        if not prompt.strip():
            raise InvalidArgument("prompt", "must not be empty")
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def run(self, req: Request, on_tokens=None, grammars=None, prompt_ids: list[int] | None = None
            ) -> GenerationResult:
        """`grammars` (speculative.grammar.Grammars): for a request whose params name a grammar;
        `prompt_ids`: the prompt already tokenized (a chat with tools), instead of req.prompt."""
        ids = self.prompt_ids(req.prompt, req.chat) if prompt_ids is None else prompt_ids
        drafter = make_drafter(req.drafter, self.model, namespace=req.namespace,
                               parallel_layers=req.parallel_layers, calibrate=req.calibrate,
                               cuda_graphs=self.cuda_graphs, shared_passes=self.drafter_passes())
        eos = self.tokenizer.eos_token_ids or self.model.config.eos_token_ids
        return generate(self.model, ids, req.params, drafter, req.draft_length, eos, on_tokens,
                        tree_budget=req.tree_budget, grammars=grammars, static=self.static_passes())
