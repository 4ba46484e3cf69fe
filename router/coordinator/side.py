"""What the verify and draft sides share: one request held at one service of a kind,
and the replicas of that kind that failed it."""

from __future__ import annotations

import logging

import grpc

from .job import Job
from .services import Services

log = logging.getLogger(__name__)


class Side:
    """The service of one kind holding one request; failed replicas are not tried again."""

    kind = ""

    def __init__(self, services: Services, job: Job, request_id: str | None = None):
        self.services, self.job = services, job
        self.request_id = request_id or job.service_id  # the request's id at the service
        self.address: str | None = None
        self.stub = None
        self.failed: set[str] = set()
        self.full: set[str] = set()  # verifiers that answered "every row taken" in this pass over them
        # prefills sent so far: each later one asks for a fresh random stream (`make_generator`'s
        # `resumed`), since the request's tokens so far were chosen by its stream's first draws
        self.prefills = 0

    def _fail(self, address: str, err: grpc.RpcError) -> None:
        log.warning("%s %s failed for %s (%s); trying another", self.kind, address, self.request_id, err.code())
        self.failed.add(address)
        if self.address == address:
            if err.code() != grpc.StatusCode.UNAVAILABLE:  # it may still hold the request: let it go
                self.services.release_later(self.stub, self.request_id)
            self._hold(None, None)
        self.services.channels.drop(address)

    def _hold(self, address: str | None, stub) -> None:
        """The request is held at `address` now (None: nowhere), as the services' holdings count."""
        self.services.holdings.moved(self.address, address)
        self.address, self.stub = address, stub

    def release(self) -> None:
        if self.stub is not None:
            self.services.release(self.stub, self.request_id)
        self._hold(None, None)
