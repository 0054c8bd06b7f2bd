"""Session pins and KV distribution: in memory, and shared through a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
from pathlib import Path

import pytest
from support.gateway_fakes import wait_for
from support.procs import free_port, redis_argv, running, wait_until

from herd.api.protocol import KVEvent, KVEventBatch, KVSnapshot
from herd.orchestrator import state as state_module
from herd.orchestrator.state import KVPayload, MemoryState, RedisState, State

WITHIN_S = 30.0
"""Budget for what involves a real redis-server: generous for a loaded machine, no cost when quick."""
PROBE = "probe"
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
    try:
        await until_tailing(states[0], sinks[1])
        winners = await asyncio.gather(
            states[0].claim_pin("m:s1", "w0", 60), states[1].claim_pin("m:s1", "w1", 60)
        )
        assert winners[0] == winners[1]
        assert await states[1].get_pin("m:s1") == winners[0]
        await states[0].publish_kv("w0", SNAPSHOT)
        await states[0].publish_kv("w0", BATCH)
        await wait_for(lambda: len(without_probes(sinks[1])) == 2, within=WITHIN_S)
        assert without_probes(sinks[1]) == [("w0", SNAPSHOT), ("w0", BATCH)]
    finally:
        for state in states:
            await state.close()


async def until_tailing(publisher: State, sink: Collected) -> None:
    """Publish probe batches until ``sink``'s consumer receives one: it then tails the stream.

    A consumer starts reading at the stream's end once connected, so what is published before that
    never reaches it; a fixed sleep guessed how long connecting takes.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN_S
    number = 0
    while loop.time() < deadline:
        number += 1
        await publisher.publish_kv(PROBE, KVEventBatch(epoch=f"probe-{number}", events=[]))
        with contextlib.suppress(TimeoutError):
            await wait_for(lambda: any(worker == PROBE for worker, _ in sink), within=0.2)
            return
    raise TimeoutError(f"no probe reached the second consumer within {WITHIN_S:g}s")


def without_probes(sink: Collected) -> list[tuple[str, KVPayload]]:
    return [(worker, payload) for worker, payload in sink if worker != PROBE]


@pytest.fixture
def stoppable_redis(tmp_path: Path) -> tuple[int, Path]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed: run `make test`")
    return free_port(), tmp_path


async def test_redis_loss_degrades_to_local_and_recovers(
    stoppable_redis: tuple[int, Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="herd.orchestrator.state")
    port, workdir = stoppable_redis
    state: State = RedisState(f"redis://127.0.0.1:{port}/0", retry_seconds=0.2)
    sink = Collected()
    with running(redis_argv(port, workdir), log=workdir / "redis1.log"):
        wait_until(lambda: _answers(port), timeout=WITHIN_S, what="redis-server")
        await state.start(sink)
        await state.set_pin("before", "w0", 60)
        assert not state.is_degraded
    # Redis is gone: answered from local state, which mirrored the pin written while it was there.
    assert await state.get_pin("before") == "w0"
    assert state.is_degraded
    assert await state.claim_pin("during", "w1", 60) == "w1"
    assert await state.claim_pin("during", "w2", 60) == "w1"
    await state.publish_kv("w0", BATCH)
    assert sink == [("w0", BATCH)]
    with running(redis_argv(port, workdir), log=workdir / "redis2.log"):
        wait_until(lambda: _answers(port), timeout=WITHIN_S, what="redis-server")
        # The KV consumer probes every retry_seconds: wait for it rather than sleeping a guess.
        await wait_for(lambda: not state.is_degraded, within=WITHIN_S)
        # The new Redis started empty: both pins were written through on recovery, no request needed.
        assert [_get(port, "herd:pin:before"), _get(port, "herd:pin:during")] == [b"w0", b"w1"]
        await state.set_pin("during", "w2", 60)
        assert _get(port, "herd:pin:during") == b"w2"
        await state.close()
    messages = [record.getMessage() for record in caplog.records if record.name == "herd.orchestrator.state"]
    assert [message.split(";")[0] for message in messages] == [
        "redis is unreachable",
        "redis is reachable again",
    ]


async def test_write_through_keeps_a_pin_another_replica_wrote_back_first(
    stoppable_redis: tuple[int, Path],
) -> None:
    port, workdir = stoppable_redis
    url = f"redis://127.0.0.1:{port}/0"
    state: State = RedisState(url, retry_seconds=0.2)
    await state.start(Collected())
    assert await state.get_pin("s") is None  # no Redis yet: degraded from the start
    await state.set_pin("s", "w-local", 60)
    with running(redis_argv(port, workdir), log=workdir / "redis.log"):
        wait_until(lambda: _answers(port), timeout=WITHIN_S, what="redis-server")
        _set(port, "herd:pin:s", "w-other")
        await wait_for(lambda: not state.is_degraded, within=WITHIN_S)
        assert await state.get_pin("s") == "w-other"
        await state.close()


async def test_a_silent_redis_costs_a_request_one_short_timeout() -> None:
    """A Redis that accepts connections and never answers (a hung or partitioned server)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        state = RedisState(url, timeout_seconds=0.25)
        loop = asyncio.get_running_loop()
        started = loop.time()
        # Bounded here too, so that a missing socket timeout fails the test instead of hanging it.
        await asyncio.wait_for(state.set_pin("s", "w0", 60), timeout=5)
        assert loop.time() - started < 0.9  # one try of 0.25 s, not a retry schedule
        assert state.is_degraded
        started = loop.time()
        assert await state.get_pin("s") == "w0"
        assert loop.time() - started < 0.1  # degraded: requests no longer touch Redis at all
        await state.close()


def _answers(port: int) -> bool:

    with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(16).startswith(b"+PONG")


def _get(port: int, key: str) -> bytes | None:
    """``GET key`` on a raw connection (RESP bulk string), independent of the state under test."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"*2\r\n$3\r\nGET\r\n${len(key)}\r\n{key}\r\n".encode())
        reply = sock.recv(4096)
    if reply.startswith(b"$-1"):
        return None
    header, _, rest = reply.partition(b"\r\n")
    return rest[: int(header[1:])]


def _set(port: int, key: str, value: str) -> None:
    """``SET key value`` on a raw connection, as another replica would."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        command = f"*3\r\n$3\r\nSET\r\n${len(key)}\r\n{key}\r\n${len(value)}\r\n{value}\r\n"
        sock.sendall(command.encode())
        assert sock.recv(16).startswith(b"+OK")


def test_an_entry_the_sink_cannot_apply_is_skipped_and_the_next_delivered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    applied: list[str] = []

    def sink(worker_id: str, payload: object) -> None:
        if worker_id == "bad":
            raise KeyError("device")  # what applying another replica's malformed snapshot raised
        applied.append(worker_id)

    entry = {b"kind": b"batch", b"data": b'{"epoch": "e", "events": []}'}
    state_module._deliver(sink, {**entry, b"worker": b"bad"})
    state_module._deliver(sink, {**entry, b"worker": b"good"})
    assert applied == ["good"] and "could not apply" in caplog.text


def test_another_replicas_negative_in_flight_count_is_a_malformed_entry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    applied: list[object] = []
    data = b'{"origin": "other", "counts": {"w0": -3}}'
    state_module._deliver(
        lambda _, payload: applied.append(payload), {b"kind": b"in_flight", b"worker": b"", b"data": data}
    )
    assert applied == [] and "malformed KV stream entry" in caplog.text
