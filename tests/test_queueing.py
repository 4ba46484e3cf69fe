"""A burst larger than the verifier's rows queues for a row instead of failing: the
verifier answers RESOURCE_EXHAUSTED while every row is taken, and the router tries it
again until one frees (within the request's deadline, past its service wait), and the
requests waiting get the rows in the order they came (router/row_line.py)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from drafter_service.pool import DrafterPool
from loopback import loopback
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from router.servicer import RouterConfig, RouterServicer
from router.servicer import serve as serve_router
from speculative.sampling import SamplingParams
from fuzzing import CharTokenizer
from tiny import TINY, tiny_model
from verifier_service.engine import VerifierEngine

PROMPTS = ["hello there", "what is this", "a b c d e f", "tell me more"]


CONFIG = RouterConfig(context_length=TINY.max_position_embeddings - 12, eos_token_ids=[],
                      vocab_size=TINY.vocab_size, default_drafter="pld", draft_length=3, adaptive=False)


def test_more_requests_than_rows_all_complete_alike():
    target = tiny_model(0)
    pool, engine = DrafterPool(target, kinds=["pld"]), VerifierEngine(target, max_batch=1, max_len=64)
    config = CONFIG
    with loopback(pool, engine) as coordinator:
        coordinator.services.service_wait_s = 0.1  # a queued request waits past it: it is waiting for a row
        server, port = serve_router(RouterServicer(CharTokenizer(TINY.vocab_size), coordinator, config), "127.0.0.1", 0)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.SpecserveStub(channel)

                def ask(prompt: str) -> list[int]:
                    req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=40))
                    return list(stub.Generate(req, timeout=120).token_ids)

                alone = [ask(p) for p in PROMPTS]
                with ThreadPoolExecutor(len(PROMPTS)) as burst:
                    together = list(burst.map(ask, PROMPTS))
            assert together == alone and all(len(ids) == 40 for ids in together)
            assert engine.stats()["active_requests"] == 0
        finally:
            server.stop(None)


def test_requests_waiting_for_a_row_get_it_in_the_order_they_came():
    target = tiny_model(0)
    pool, engine = DrafterPool(target, kinds=["pld"]), VerifierEngine(target, max_batch=1, max_len=64)
    waiters, finished, lock = 8, [], threading.Lock()
    with loopback(pool, engine) as coordinator:
        server, port = serve_router(RouterServicer(CharTokenizer(TINY.vocab_size), coordinator, CONFIG), "127.0.0.1", 0)
        try:
            # a request of another router holds the only row: its release wakes no one here
            engine.prefill("elsewhere", [1, 2, 3], SamplingParams(temperature=0.0))
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.SpecserveStub(channel)

                def ask(i: int) -> None:
                    req = pb.GenerateRequest(prompt=PROMPTS[i % len(PROMPTS)],
                                             sampling=pb.SamplingParams(max_tokens=8))
                    assert len(stub.Generate(req, timeout=120).token_ids) == 8
                    with lock:
                        finished.append(i)

                with ThreadPoolExecutor(waiters) as clients:
                    done = []
                    for i in range(waiters):  # each one waiting before the next comes
                        done.append(clients.submit(ask, i))
                        wait_until(lambda: coordinator.services.row_line.waiting() == i + 1)
                        time.sleep(0.3)  # a few polls: an unordered retry would have shuffled them
                    engine.release("elsewhere")
                    for f in done:
                        f.result()
            assert finished == list(range(waiters))
            assert coordinator.services.row_line.waiting() == 0 and engine.stats()["active_requests"] == 0
        finally:
            server.stop(None)


def wait_until(condition, timeout_s: float = 30.0) -> None:
    give_up = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.02)
