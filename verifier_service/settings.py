"""The verifier's settings: the `[verifiers]` section of `specserve serve`'s
configuration (cluster/config.py) and the defaults of VerifierEngine, so each
is written here once. Loads pydantic only, no torch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt


class VerifierSettings(BaseModel):
    """`[verifiers]`: the verifier actors, each holding the target and its KV cache."""

    model_config = ConfigDict(extra="forbid")  # a typo in the file is an error, not a silent default

    count: int = Field(1, ge=1, description="verifier replicas (the least, when autoscaling)")
    max_batch: int = Field(8, ge=1, description="requests one verifier holds and batches")
    max_len: int = Field(4096, ge=16, description="the context: the most tokens of one request's prompt and "
                                                   "output together (a verifier holds room for a round's tree "
                                                   "past it)")
    max_batch_tokens: int = Field(256, ge=1, description="most tokens in one batched verification")
    checkpoint_interval_s: float = Field(0.2, ge=0, description="a verifier writes its requests' checkpoints at "
                                         "most this often (each the request's latest); 0: after every round")
    threads: int | None = Field(None, ge=1, description="torch threads of a verifier's engine (default: all cores, "
                                                       "shared out among its tensor-parallel ranks)")
    cores: list[NonNegativeInt] | None = Field(None, min_length=1, description="CPU core ids every verifier process runs "
                                     "on (default: all the node's); pinned apart from the drafter pools' "
                                     "cores, each side computes on cores of its own")
    tensor_parallel: int = Field(1, ge=1, description="processes each verifier's target is split across, on "
                                                      "one node (tensor parallelism, docs/SERVING.md)")
    cuda_graphs: bool | None = Field(None, description="verification passes at static shapes, each bucket's "
                                     "pass a captured CUDA graph (runtime/graphs.py); default: on where the "
                                     "target is on CUDA, off on a CPU")
    resources: dict[str, float] = Field({"verifier": 1}, description="Ray resources each verifier needs")
    max_count: int | None = Field(None, ge=1, description="most verifier replicas the autoscaler starts "
                                                          "(default: count, no autoscaling)")
    target_occupancy: float = Field(0.75, gt=0, le=1, description="autoscaling aims each verifier at this share "
                                                                  "of its rows held or queued")
