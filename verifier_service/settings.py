"""The verifier's settings: the `[verifiers]` section of `specserve serve`'s
configuration (cluster/config.py) and the defaults of VerifierEngine, so each
is written here once. Loads pydantic only, no torch.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_MEMORY = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]i?)?[bB]?\s*")


def memory_bytes(value: str | float | int, total: int) -> int:
    """`kv_cache_memory` in bytes: a share of `total` (the machine's, or the GPU's, memory)
    when it is a number in (0, 1], else bytes, with an optional unit: 2000000000, "2GB",
    "1.5GiB", "512MiB". ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"kv_cache_memory: a share of memory or bytes, got {value!r}")
    if isinstance(value, str):
        found = _MEMORY.fullmatch(value)
        if found is None:
            raise ValueError(f"kv_cache_memory: a share of memory (0.3) or bytes (2GiB, 512MB), got {value!r}")
        number, unit = float(found.group(1)), (found.group(2) or "").lower()
        if unit or number > 1:
            return int(number * _UNITS[unit])
        value = number
    if not value > 0:
        raise ValueError(f"kv_cache_memory: must be positive, got {value!r}")
    return int(value * total) if value <= 1 else int(value)


class VerifierSettings(BaseModel):
    """`[verifiers]`: the verifier actors, each holding the target and its KV cache."""

    model_config = ConfigDict(extra="forbid")  # a typo in the file is an error, not a silent default

    count: int = Field(1, ge=1, description="verifier replicas (the least, when autoscaling)")
    max_batch: int | None = Field(None, ge=1, description="most requests one verifier holds (and batches); "
                                  "default: as many as its KV cache memory holds")
    max_len: int = Field(4096, ge=16, description="the context: the most tokens of one request's prompt and "
                                                   "output together (a verifier holds room for a round's tree "
                                                   "past it)")
    max_batch_tokens: int = Field(256, ge=1, description="most tokens in one batched verification")
    kv_cache_memory: str | float = Field("0.1", description="memory of a verifier's paged KV cache: a share "
                                         "of the machine's (of the GPU's on CUDA; a tensor-parallel rank's each), "
                                         "like 0.1, or bytes, like 4GiB or 2e9; requests are admitted while "
                                         "its blocks last")
    kv_block_size: int = Field(16, ge=1, le=1024, description="tokens one KV cache block holds; prompts share "
                               "cached prefixes in whole blocks")
    checkpoint_interval_s: float = Field(0.2, ge=0, description="a verifier writes its requests' checkpoints at "
                                         "most this often (each the request's latest); 0: after every round")
    threads: int | None = Field(None, ge=1, description="torch threads of a verifier's engine (default: all cores, "
                                                       "shared out among its tensor-parallel ranks)")
    cores: list[NonNegativeInt] | None = Field(None, min_length=1, description="CPU core ids every verifier process runs "
                                     "on (default: all the node's); pinned apart from the drafter pools' "
                                     "cores, each side computes on cores of its own")
    tensor_parallel: int = Field(1, ge=1, description="processes each verifier's target is split across, on "
                                                      "one node (tensor parallelism, docs/SERVING.md)")
    cuda_graphs: bool | None = Field(None, description="verification passes at static shapes over the KV cache's "
                                     "blocks, each bucket's pass a captured CUDA graph (runtime/graphs.py); "
                                     "default: on where the target is on CUDA, off on a CPU")
    resources: dict[str, float] = Field({"verifier": 1}, description="Ray resources each verifier needs")
    max_count: int | None = Field(None, ge=1, description="most verifier replicas the autoscaler starts "
                                                          "(default: count, no autoscaling)")
    target_occupancy: float = Field(0.75, gt=0, le=1, description="autoscaling aims each verifier at this share "
                                                                  "of its occupancy: KV cache blocks held, or requests held "
                                                                  "and queued over max_batch (8 when unset), the fuller")

    @field_validator("kv_cache_memory")
    @classmethod
    def _memory_parses(cls, value: str | float) -> str | float:
        memory_bytes(value, 1 << 40)  # the form only: the machine's memory is the verifier's to read
        return value
