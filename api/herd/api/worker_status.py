"""The worker side of the status stream (``protocol.WorkerStatus``), served alike by a herd worker
and by the vLLM sidecar on ``INTERNAL_PATHS.status``.

An open stream starts with the KV events the receiver lacks (or a snapshot), then waits for new KV
events up to ``interval`` seconds at a time. It sends a line when events arrived, when readiness or
the load report changed, or when ``heartbeat`` seconds passed since its last line, then rests
``interval`` seconds so that a busy worker's events and load go out together. A line whose load says
``is_draining`` is the last: a stream never outlives its worker's drain.

One stream per orchestrator replica replaces three polls a period (``/ready``, the load report, KV
events): the orchestrator reads lines as they come, so a slow worker is late rather than failed, a
dead one breaks the connection at once, and a stalled one falls silent past the heartbeat.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from herd.api.protocol import KVEvent, KVSnapshot, LoadReport, StatusQuery, WorkerStatus

__all__ = ["StatusSource", "status_lines"]


@dataclass(frozen=True, slots=True)
class StatusSource:
    """What a worker's status stream reads; every call is on the event loop."""

    epoch: Callable[[], str]
    """The KV epoch now (a new one when the engine restarted)."""
    probe: Callable[[], Awaitable[tuple[bool, LoadReport]]]
    """Readiness as ``/ready`` says it, and the load report."""
    events_after: Callable[[int, float], Awaitable[list[KVEvent]]]
    """KV events with a larger seq, waiting up to the given seconds for one when none yet."""
    snapshot: Callable[[], Awaitable[KVSnapshot]]


async def status_lines(source: StatusSource, query: StatusQuery) -> AsyncIterator[bytes]:
    """The stream's newline-delimited ``WorkerStatus`` lines, until the worker drains."""
    epoch, seq = query.epoch, query.after
    last: tuple[bool, LoadReport] | None = None
    sent_at = -math.inf
    while True:
        snapshot, events = None, []
        if epoch != source.epoch() or seq < 0:
            snapshot = await source.snapshot()
            epoch, seq = snapshot.epoch, snapshot.seq
        else:
            events = await source.events_after(seq, query.interval)
        probed = await source.probe()
        now = time.monotonic()
        if snapshot is None and not events and probed == last and now - sent_at < query.heartbeat:
            continue
        if events:
            seq = events[-1].seq
        is_ready, load = probed
        status = WorkerStatus(epoch=epoch, is_ready=is_ready, load=load, events=events, snapshot=snapshot)
        yield status.model_dump_json().encode() + b"\n"
        if load.is_draining:
            return
        last, sent_at = probed, now
        await asyncio.sleep(query.interval)
