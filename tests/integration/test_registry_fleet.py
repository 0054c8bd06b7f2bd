"""The registry follows a fleet of simulated workers over real loopback sockets: 64 of them in one
process stay admitted while the orchestrator's event loop is blocked again and again, and a worker
process that stalls (SIGSTOP) or dies (SIGKILL) is still ejected, and a stalled one re-admitted once
it answers. The loop is blocked on purpose: a poll with a short timeout on every worker in the same
phase ejected healthy workers on a busy machine; a status stream only comes late."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from support.procs import running
from support.worker_server import worker_argv

from herd.api.crd import RoundRobinRouting
from herd.cli.up import free_port_block
from herd.orchestrator.discovery import ModelConfig, StaticSource, WorkerEndpoint
from herd.orchestrator.proxy import build_http_client
from herd.orchestrator.registry import Registry, RegistrySettings
from herd.orchestrator.state import MemoryState
from herd.orchestrator.worker_client import WorkerClient

pytestmark = pytest.mark.timeout(300)

TOKEN = "fleet-token"
NUM_FLEET = 64
SIMULATED = json.dumps({"backend": "simulated", "simulation": {"costModel": {"stepMs": 2.0}}})
BLOCKED_S = 0.8
"""Each block of the orchestrator's loop: beyond the old 0.5 s poll timeout, under the heartbeat."""


def _endpoints(ports: list[int], count: int, first: int) -> list[WorkerEndpoint]:
    return [
        WorkerEndpoint(
            f"w{first + number}",
            "tiny",
            f"http://127.0.0.1:{ports[number]}",
            f"http://127.0.0.1:{ports[count + number]}",
        )
        for number in range(count)
    ]


@contextlib.contextmanager
def _workers(model: Path, log: Path, count: int) -> Iterator[tuple[int, list[int]]]:
    """``count`` simulated workers in one ``herd worker --replicas`` process: its pid and ports."""
    ports = free_port_block(2 * count)
    argv = worker_argv(model, port=ports[0], internal_port=ports[count], token=TOKEN)
    argv += ["--engine-json", SIMULATED, "--replicas", str(count)]
    with running(argv, log=log) as process:
        yield process.pid, ports


@contextlib.asynccontextmanager
async def _registry(endpoints: list[WorkerEndpoint]) -> AsyncIterator[Registry]:
    source = StaticSource([ModelConfig("tiny", RoundRobinRouting(strategy="round_robin"))], endpoints)
    async with build_http_client() as http:
        registry = Registry(WorkerClient(http, token=TOKEN), MemoryState(), RegistrySettings())
        task = asyncio.create_task(registry.run(source))
        try:
            yield registry
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _num_admitted(registry: Registry) -> int:
    return sum(worker.is_healthy for worker in registry.workers.values())


async def _until(check: Callable[[], bool], *, within: float) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"not within {within} s"
        await asyncio.sleep(0.05)


async def test_a_fleet_stays_admitted_through_a_busy_loop_and_a_dead_worker_is_ejected(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        _workers(tiny_llama, tmp_path / "fleet.log", NUM_FLEET) as (_, fleet_ports),
        _workers(tiny_llama, tmp_path / "single.log", 1) as (single_pid, single_ports),
    ):
        endpoints = [*_endpoints(fleet_ports, NUM_FLEET, 0), *_endpoints(single_ports, 1, NUM_FLEET)]
        single = endpoints[-1].id
        async with _registry(endpoints) as registry:
            await _until(lambda: _num_admitted(registry) == NUM_FLEET + 1, within=120)
            with caplog.at_level(logging.INFO, logger="herd.orchestrator.registry"):
                caplog.clear()
                for _ in range(6):
                    time.sleep(BLOCKED_S)  # noqa: ASYNC251 -- the loop blocked on purpose: nothing read or answered
                    await asyncio.sleep(0.2)
                assert _num_admitted(registry) == NUM_FLEET + 1
                assert [record.message for record in caplog.records] == []

                os.kill(single_pid, signal.SIGSTOP)  # hung: the connection stays, the heartbeats stop
                try:
                    await _until(lambda: not registry.workers[single].is_healthy, within=30)
                    reasons = [getattr(record, "reason", "") for record in caplog.records]
                    assert [record.message for record in caplog.records] == ["worker ejected"]
                    assert reasons[0].startswith("ReadTimeout: no status line")
                finally:
                    os.kill(single_pid, signal.SIGCONT)
                await _until(lambda: registry.workers[single].is_healthy, within=30)

                caplog.clear()
                os.kill(single_pid, signal.SIGKILL)  # dead: the connection breaks, reconnects are refused
                await _until(lambda: not registry.workers[single].is_healthy, within=30)
                ejected = [record for record in caplog.records if record.message == "worker ejected"]
                assert getattr(ejected[0], "reason", "").startswith("ConnectError")  # not a silence
                assert _num_admitted(registry) == NUM_FLEET
