"""A new request goes to the verifier and the drafter pool holding the fewest of this
router's requests, not to the first listed: two verifiers and two pools behind real gRPC
servers on loopback, tiny models, no Ray."""

from __future__ import annotations

from contextlib import ExitStack

from drafter_service.pool import DrafterPool
from drafter_service.servicer import serve as serve_drafters
from router.coordinator import Channels, Coordinator, Job
from router.coordinator.draft_side import DraftSide
from router.coordinator.verify_side import VerifySide
from speculative.sampling import SamplingParams
from tiny import TINY, tiny_model
from verifier_service.engine import VerifierEngine
from verifier_service.servicer import serve as serve_verifier

PROMPT = [1, 2, 3, 1, 2]


def _job(i: int) -> Job:
    return Job(request_id=f"r{i}", prompt_ids=PROMPT, params=SamplingParams(max_tokens=8),
               drafters=(("pld", 1.0),), draft_length=3, tree_budget=3, vocab_size=TINY.vocab_size,
               eos_token_ids=(), service_id=f"r{i}")


def test_requests_go_to_the_replica_holding_fewest():
    target = tiny_model(0)
    with ExitStack() as stack:
        engines = [VerifierEngine(target, max_batch=4, max_len=64) for _ in range(2)]
        pools = [DrafterPool(target, kinds=["pld"]) for _ in range(2)]
        servers = [serve_verifier(e) for e in engines] + [serve_drafters(p) for p in pools]
        for engine in engines:
            stack.callback(engine.close)
        for server, _ in servers:
            stack.callback(server.stop, None)
        ports = [port for _, port in servers]
        coordinator = Coordinator(verifiers=lambda: [f"127.0.0.1:{p}" for p in ports[:2]],
                                  drafters=lambda: [f"127.0.0.1:{p}" for p in ports[2:]], channels=Channels())
        stack.callback(coordinator.services.channels.close)
        services = coordinator.services

        verify = [VerifySide(services, _job(i)) for i in range(4)]
        for side in verify:
            side.prefill(PROMPT)
        assert [e.stats()["active_requests"] for e in engines] == [2, 2]
        # a row freed on the second verifier is where the next request goes
        freed = verify[1].address
        verify[1].release()
        assert [e.stats()["active_requests"] for e in engines] == [2, 1]
        late = VerifySide(services, _job(4))
        late.prefill(PROMPT)
        assert late.address == freed
        assert [e.stats()["active_requests"] for e in engines] == [2, 2]

        draft = [DraftSide(services, _job(i), "pld", stream=1, request_id=f"r{i}") for i in range(4)]
        for side in draft:
            assert side._connect(PROMPT)
        assert [p.active_requests() for p in pools] == [2, 2]
        for side in verify + [late] + draft:
            side.release()
        assert services.holdings.held() == {}
