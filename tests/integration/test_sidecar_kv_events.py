"""The sidecar's KV event subscriber against vLLM's own ZmqEventPublisher (run by the vLLM
environment's Python) over real ZMQ sockets on loopback: batches published before the sidecar
listened come from the replay socket, later ones from the PUB socket, in order; a publisher that
starts over (vLLM restarted) opens a new epoch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.procs import free_port, stop_process
from support.vllm_env import VLLM_PYTHON, skip_without_vllm

from herd.api.backends import KV_EVENTS_TOPIC
from herd.api.kv_hash import block_hashes
from herd.sidecar._kv_state import KVState
from herd.sidecar._subscriber import KVEventSubscriber

pytestmark = [skip_without_vllm, pytest.mark.slow]

BS = 4
MODEL = "m"
PROMPT = list(range(200, 212))
H = block_hashes(PROMPT, BS, model_id=MODEL)
SALTED = block_hashes(PROMPT[:4], BS, model_id=MODEL, cache_salt="s")
PUBLISHER = Path(__file__).parents[1] / "support/vllm_kv_publisher.py"


class _Publisher:
    """vLLM's publisher in a child process; ``publish`` waits until it has taken the batch."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.process = subprocess.Popen(
            [str(VLLM_PYTHON), str(PUBLISHER), endpoint, replay, KV_EVENTS_TOPIC, str(BS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def publish(self, *events: dict[str, object]) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(list(events)).encode() + b"\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline() == b"published\n", "vLLM's publisher failed; see its stderr"


@contextlib.contextmanager
def _publisher(endpoint: str, replay: str) -> Iterator[_Publisher]:
    publisher = _Publisher(endpoint, replay)
    try:
        yield publisher
    finally:
        stop_process(publisher.process)
        for pipe in (publisher.process.stdin, publisher.process.stdout):
            assert pipe is not None
            pipe.close()


@pytest.fixture
def ports() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


async def _until(kv: KVState, held: list[int]) -> None:
    """Wait (60 s at most) until the sidecar's view of vLLM's cache is ``held``."""
    for _ in range(1200):
        if sorted(kv.snapshot().block_hashes) == sorted(held):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"held {kv.snapshot().block_hashes}, expected {held}")


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], extra_keys: object = None
) -> dict[str, object]:
    return {"stored": [hashes, parent, tokens, extra_keys]}


async def test_replayed_then_live_batches_in_order(ports: tuple[str, str]) -> None:
    endpoint, replay = ports
    kv = KVState(MODEL, BS)
    subscriber = KVEventSubscriber(endpoint, replay, KV_EVENTS_TOPIC, kv.apply, kv.restart)
    with _publisher(endpoint, replay) as publisher:
        publisher.publish(stored([11, 12], None, PROMPT[:8]))  # nobody listens yet: only the replay has it
        task = asyncio.create_task(subscriber.run())
        try:
            await _until(kv, H[:2])
            publisher.publish(stored([13], 12, PROMPT[8:]), stored([21], None, PROMPT[:4], [["s"]]))
            await _until(kv, [*H, *SALTED])
            publisher.publish({"removed": [12, 13, 99]})
            await _until(kv, [H[0], *SALTED])
            publisher.publish({"cleared": None}, stored([11], None, PROMPT[:4]))
            await _until(kv, H[:1])
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    events = await kv.feed.after(-1, wait=0)
    assert [(event.seq, event.kind, event.block_hashes) for event in events] == [
        (1, "stored", H[:2]),
        (2, "stored", H[2:]),
        (3, "stored", SALTED),
        (4, "removed", H[1:]),
        (5, "cleared", []),
        (6, "stored", H[:1]),
    ]
    assert subscriber.num_lost == 0


async def test_a_restarted_vllm_opens_a_new_epoch(ports: tuple[str, str]) -> None:
    endpoint, replay = ports
    kv = KVState(MODEL, BS)
    subscriber = KVEventSubscriber(endpoint, replay, KV_EVENTS_TOPIC, kv.apply, kv.restart)
    task = asyncio.create_task(subscriber.run())
    try:
        with _publisher(endpoint, replay) as publisher:
            for _ in range(3):
                publisher.publish(stored([11, 12], None, PROMPT[:8]))
            await _until(kv, H[:2])
        first_epoch = kv.epoch
        with _publisher(endpoint, replay) as publisher:  # numbers from 0 again, its cache empty
            publisher.publish(stored([31], None, PROMPT[:4], [["s"]]))
            await _until(kv, SALTED)
        assert kv.epoch != first_epoch and kv.snapshot().epoch == kv.epoch
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
