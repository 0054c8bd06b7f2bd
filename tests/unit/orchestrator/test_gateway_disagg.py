"""The gateway applying routing decisions, over fake workers (httpx.MockTransport).

A burst of disaggregated requests whose prefills overlap must see each other's decode workers
counted from the moment each one was chosen, so the bounded-load cap of ``prefix_hash`` spreads them
over the decode pool instead of piling every one onto the worker that owns their prefix. A session
pin is written after the choice, keeping the first claimant's worker.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, running_gateway

from herd.api.crd import PrefixHashRouting, StickySessionRouting
from herd.api.protocol import WORKER_HEADER
from herd.orchestrator.state import MemoryState

LOAD_FACTOR = 1.25
NUM_BURST = 8
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def disaggregated_cluster(num_decode: int) -> FakeCluster:
    prefill = FakeWorker("p0", role="prefill", prefill_delay=0.3)
    decode = [FakeWorker(f"d{n}", role="decode", chunk_delay=0.2) for n in range(num_decode)]
    return FakeCluster([prefill, *decode])


def chat(number: int) -> dict[str, object]:
    """A prompt whose first blocks (the prefix hash's key) every request shares, and whose own tail is
    long enough to prefill remotely on any worker."""
    shared = " ".join(["red fox jumps over the lazy dog"] * 10)
    text = f"{shared} {' '.join([f'tail {number} of the prompt'] * 8)}"
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": True}


async def test_a_burst_of_disaggregated_requests_respects_the_bounded_load_cap_on_the_decode_pool(
    tiny_llama: Path,
) -> None:
    cluster = disaggregated_cluster(num_decode=2)
    routing = PrefixHashRouting(strategy="prefix_hash", load_factor=LOAD_FACTOR)
    config = {"model_path": tiny_llama, "mode": "disaggregated", "prefill_threshold_tokens": 16}
    async with running_gateway(cluster, routing=routing, model_config=config) as (_, client):
        responses = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=chat(number)) for number in range(NUM_BURST))
        )
    assert [response.status_code for response in responses] == [200] * NUM_BURST
    prefill, *decode = cluster.workers
    assert len(prefill.prefills) == NUM_BURST
    # Every request shares one prefix (one ring owner): only the cap moves requests off it.
    cap = math.ceil(LOAD_FACTOR * NUM_BURST / len(decode))
    assert sorted(worker.num_requests for worker in decode)[-1] <= cap
    assert sum(worker.num_requests for worker in decode) == NUM_BURST


class RacedState(MemoryState):
    """Another replica pins every new session to ``winner`` between our read and our claim."""

    def __init__(self, winner: str) -> None:
        super().__init__()
        self.winner = winner

    async def claim_pin(self, key: str, worker_id: str, ttl_seconds: int) -> str:
        await self.set_pin(key, self.winner, ttl_seconds)
        return self.winner


async def test_a_session_claimed_by_another_replica_first_goes_to_its_worker() -> None:
    """The pin is written after the choice is counted; losing the claim routes again, to the winner,
    and the first choice's count is released."""
    cluster = FakeCluster([FakeWorker("w0"), FakeWorker("w1")])
    sticky = StickySessionRouting(strategy="sticky_session")
    async with running_gateway(cluster, routing=sticky, state=RacedState("w1")) as (app, client):
        response = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
        counts = {worker_id: state.num_in_flight for worker_id, state in app.state.registry.workers.items()}
    assert response.status_code == 200 and response.headers[WORKER_HEADER] == "w1"
    assert [worker.num_requests for worker in cluster.workers] == [0, 1]
    assert counts == {"w0": 0, "w1": 0}
