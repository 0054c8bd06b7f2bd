"""The async engine front and the server's failure paths.

These tests use ``ScriptedEngine`` (tests/support/worker_server.py), a narrow stand-in for the
real engine, because they must hold a step still (drain, cancellation timing) or make one fail;
everything about generation itself is tested against the real engine in test_worker_server.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path

import httpx
import pytest
from support.procs import wait_until
from support.worker_server import ScriptedEngine

from herd.worker.async_engine import AsyncEngine, EngineDeadError, EngineDrainingError
from herd.worker.sampling_params import SamplingParams
from herd.worker.server import PublicOptions, build_public_app

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def scripted(tiny_llama: Path) -> ScriptedEngine:
    return ScriptedEngine(tiny_llama)


@pytest.fixture
async def engine(scripted: ScriptedEngine) -> AsyncIterator[AsyncEngine]:
    front = AsyncEngine(lambda: scripted)
    front.start()
    await front.wait_loaded()
    yield front
    scripted.gate.set()
    await front.stop()


async def _eventually(check: Callable[[], bool], what: str) -> None:
    # The engine thread competes for the CPU: 20 s covers a loaded machine and costs nothing otherwise.
    for _ in range(2000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} did not happen within 20 s")


async def _collect(engine: AsyncEngine, request_id: str, max_tokens: int) -> list[int]:
    tokens: list[int] = []
    async with aclosing(
        engine.generate(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    ) as stream:
        async for output in stream:
            tokens.extend(output.new_token_ids)
    return tokens


async def test_generate_streams_until_finished(engine: AsyncEngine) -> None:
    assert await _collect(engine, "a", 3) == [5, 5, 5]
    assert engine.num_in_flight == 0


async def test_cancelling_the_consumer_aborts_the_sequence(
    engine: AsyncEngine, scripted: ScriptedEngine
) -> None:
    scripted.gate.clear()
    task = asyncio.create_task(_collect(engine, "gone", 100))
    await _eventually(lambda: "gone" in scripted.requests, "admission")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    scripted.gate.set()  # the abort runs between steps, so let the step in progress end
    await _eventually(lambda: scripted.aborted == ["gone"], "the abort")
    assert engine.num_in_flight == 0
    assert not scripted.requests
    assert scripted.stats.generation_tokens <= 1  # the step that was running when the client left


async def test_drain_refuses_new_work_and_finishes_in_flight(
    engine: AsyncEngine, scripted: ScriptedEngine
) -> None:
    scripted.gate.clear()
    running = asyncio.create_task(_collect(engine, "old", 2))
    await _eventually(lambda: "old" in scripted.requests, "admission")
    drain = asyncio.create_task(engine.drain(grace_s=10))
    await _eventually(lambda: engine.is_draining, "draining")
    assert not engine.is_ready
    with pytest.raises(EngineDrainingError):
        await _collect(engine, "new", 1)
    scripted.gate.set()
    assert await running == [5, 5]
    assert await drain is True


async def test_drain_times_out_when_work_does_not_finish(
    engine: AsyncEngine, scripted: ScriptedEngine
) -> None:
    scripted.gate.clear()
    running = asyncio.create_task(_collect(engine, "slow", 2))
    await _eventually(lambda: "slow" in scripted.requests, "admission")
    assert await engine.drain(grace_s=0.1) is False
    running.cancel()


async def test_a_failing_step_fails_requests_and_the_engine(
    engine: AsyncEngine, scripted: ScriptedEngine
) -> None:
    scripted.fail_at_step = 1
    with pytest.raises(EngineDeadError, match="scripted failure"):
        await _collect(engine, "doomed", 3)
    with pytest.raises(EngineDeadError):
        engine.check_accepting()
    with pytest.raises(EngineDeadError):  # no command can wait on a dead engine thread
        await engine.kv_snapshot()


async def test_a_failing_load_is_reported(tiny_llama: Path) -> None:
    def broken() -> ScriptedEngine:
        raise OSError("no weights here")

    front = AsyncEngine(broken)
    front.start()
    with pytest.raises(EngineDeadError, match="no weights here"):
        await front.wait_loaded()
    assert not front.is_ready


async def test_kv_events_are_logged_long_polled_and_fanned_out(engine: AsyncEngine) -> None:
    received: list[int] = []

    async def listen() -> None:
        async with aclosing(engine.subscribe_kv_events()) as events:
            async for event in events:
                received.append(event.seq)

    listener = asyncio.create_task(listen())
    await asyncio.sleep(0)
    poll = asyncio.create_task(engine.kv_events_after(0, wait=5))
    await _collect(engine, "a", 1)
    assert [event.seq for event in await poll] == [1]
    await _collect(engine, "b", 1)
    assert [event.seq for event in await engine.kv_events_after(0)] == [1, 2]
    assert await engine.kv_events_after(2, wait=0.05) == []
    await _eventually(lambda: received == [1, 2], "fan-out")
    listener.cancel()
    snapshot = await engine.kv_snapshot()
    assert snapshot.block_hashes == [1, 2]


async def test_a_failure_mid_stream_sends_an_error_event(
    engine: AsyncEngine, scripted: ScriptedEngine
) -> None:
    scripted.fail_at_step = 2
    app = build_public_app(engine, PublicOptions("tiny"))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert "scripted failure" in error["message"]
    assert json.loads(events[1])["choices"][0]["delta"]["content"]


async def test_ready_says_503_while_draining(engine: AsyncEngine) -> None:
    app = build_public_app(engine, PublicOptions("tiny"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        assert (await client.get("/ready")).status_code == 200
        await engine.drain(grace_s=1)
        ready = await client.get("/ready")
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        refused = await client.post("/v1/chat/completions", json=body)
        assert (await client.get("/health")).status_code == 200
    assert ready.status_code == 503
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert "draining" in refused.json()["error"]["message"]


def test_wait_until_is_bounded() -> None:
    with pytest.raises(TimeoutError):
        wait_until(lambda: False, timeout=0.05, what="never")


async def test_ready_says_503_while_loading(scripted: ScriptedEngine) -> None:
    loading = threading.Event()

    def slow_factory() -> ScriptedEngine:
        # Loads only when the test says so (the bound is the test's own timeout), not after a guess.
        loading.wait(timeout=60)
        return scripted

    front = AsyncEngine(slow_factory)
    front.start()
    app = build_public_app(front, PublicOptions("tiny"))
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://worker"
        ) as client:
            ready = await client.get("/ready")
            health = await client.get("/health")
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            refused = await client.post("/v1/chat/completions", json=body)
            models = (await client.get("/v1/models")).json()
            loading.set()
            await front.wait_loaded()
            assert (await client.get("/ready")).status_code == 200
    finally:
        loading.set()
        await front.stop()
    assert ready.status_code == refused.status_code == 503
    assert "loading" in ready.json()["error"]["message"]
    assert health.status_code == 200
    assert models["data"][0]["max_model_len"] is None
