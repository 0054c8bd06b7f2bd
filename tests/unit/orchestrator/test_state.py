"""Session pins and KV distribution: in memory, and shared through a real redis-server."""

from __future__ import annotations

import asyncio
import shutil
import socket
from pathlib import Path

import pytest
from support.gateway_fakes import wait_for
from support.procs import free_port, redis_argv, running, wait_until

from herd.api.protocol import KVEvent, KVEventBatch, KVSnapshot
from herd.orchestrator.state import KVPayload, MemoryState, RedisState, State

SNAPSHOT = KVSnapshot(epoch="e", seq=0, block_size=4, block_hashes=[1, 2])
BATCH = KVEventBatch(epoch="e", events=[KVEvent(seq=1, kind="stored", block_hashes=[3])])


class Collected(list[tuple[str, KVPayload]]):
    def __call__(self, worker_id: str, payload: KVPayload) -> None:
        self.append((worker_id, payload))


async def test_memory_pins_expire_and_first_claim_wins() -> None:
    state = MemoryState()
    sink = Collected()
    await state.start(sink)
    assert await state.claim_pin("s", "w0", 60) == "w0"
    assert await state.claim_pin("s", "w1", 60) == "w0"
    await state.set_pin("s", "w1", 60)
    assert await state.get_pin("s") == "w1"
    await state.set_pin("short", "w0", 0)
    assert await state.get_pin("short") is None
    await state.publish_kv("w0", BATCH)
    assert sink == [("w0", BATCH)]


async def test_two_redis_states_agree_on_pins_and_kv(redis_url: str) -> None:
    states = [RedisState(redis_url), RedisState(redis_url)]
    sinks = [Collected(), Collected()]
    for state, sink in zip(states, sinks, strict=True):
        await state.start(sink)
    await asyncio.sleep(0.1)  # both consumers are tailing the stream
    try:
        winners = await asyncio.gather(
            states[0].claim_pin("m:s1", "w0", 60), states[1].claim_pin("m:s1", "w1", 60)
        )
        assert winners[0] == winners[1]
        assert await states[1].get_pin("m:s1") == winners[0]
        await states[0].publish_kv("w0", SNAPSHOT)
        await states[0].publish_kv("w0", BATCH)
        await wait_for(lambda: len(sinks[1]) == 2)
        assert sinks[1] == [("w0", SNAPSHOT), ("w0", BATCH)]
    finally:
        for state in states:
            await state.close()


@pytest.fixture
def stoppable_redis(tmp_path: Path) -> tuple[int, Path]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed: run `make test`")
    return free_port(), tmp_path


async def test_redis_loss_degrades_to_local_and_recovers(stoppable_redis: tuple[int, Path]) -> None:
    port, workdir = stoppable_redis
    state: State = RedisState(f"redis://127.0.0.1:{port}/0", retry_seconds=0.2)
    sink = Collected()
    with running(redis_argv(port, workdir), log=workdir / "redis1.log"):
        wait_until(lambda: _answers(port), timeout=10, what="redis-server")
        await state.start(sink)
        await state.set_pin("s", "w0", 60)
        assert not state.is_degraded
    assert await state.get_pin("s") is None  # Redis is gone: answered from local state
    assert state.is_degraded
    await state.set_pin("s", "w1", 60)
    assert await state.get_pin("s") == "w1"
    await state.publish_kv("w0", BATCH)
    assert sink == [("w0", BATCH)]
    with running(redis_argv(port, workdir), log=workdir / "redis2.log"):
        wait_until(lambda: _answers(port), timeout=10, what="redis-server")
        await asyncio.sleep(0.3)
        await state.set_pin("s", "w2", 60)
        assert await state.get_pin("s") == "w2"
        assert not state.is_degraded
        await state.close()


def _answers(port: int) -> bool:

    with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(16).startswith(b"+PONG")
