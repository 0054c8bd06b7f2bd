"""State shared between orchestrator replicas: session pins, KV event distribution, quota windows.

``MemoryState`` keeps everything in this process (one replica). ``RedisState`` shares it: pins are
Redis keys set with ``EX`` (first writer wins with ``NX``, so two replicas racing on a new session
agree), and every KV batch or snapshot a replica polls from a worker is applied locally at once and
appended to one Redis stream that every replica tails into its own index. The index skips events it
already holds (``seq``), so receiving a batch twice is harmless.

The same stream carries each routing decision's expected blocks (``share_expected``): the blocks a
request is about to compute on the worker it went to. A worker publishes them only once it has
computed them, and a replica learns that at its next poll; until then the other replicas would see
a new prefix as cached nowhere and spread its next requests over other workers. With the
expectations shared, every replica's index counts them as the deciding replica's does, within a
stream read (milliseconds) rather than a poll. Sharing is fire-and-forget: the decision never waits
on Redis; a small task writes what queued up since its last write in one round trip.

Quota windows (``add_to_window``) are counters with an expiry: a dict here, ``INCRBY`` and
``EXPIRE`` in one round trip on Redis, so every replica counts a tenant's requests and tokens in
the same minute.

It also carries each replica's requests in flight per worker (``share_in_flight``): the latest
counts, written with the expectations whenever they changed (and again every second while any is
above zero), so that every replica's bounded-load cap and load terms count the requests the other
replicas have on a worker, not only its own (``InFlightCounts``; a replica whose counts stop coming
is forgotten after ``IN_FLIGHT_TTL_S``). Absolute counts rather than increments: a lost or repeated
entry is corrected by the next.

Redis going away never stops routing. Every call has a short socket timeout and no client-side
retries, so a request waits at most one timeout on a dead Redis; the first failure switches the
replica to its local ``MemoryState`` (logged once), and requests stop touching Redis until the KV
consumer, which keeps probing every ``retry_seconds``, reaches it again (logged once). Every pin this
replica writes is mirrored locally, so sessions keep their workers through the outage. On recovery
the replica writes its live pins through to Redis with ``NX`` and their remaining TTL rather than
re-pinning them: a session's KV cache is on the worker it was pinned to, and a Redis restarted
without persistence would otherwise have forgotten every session. ``NX`` lets a pin that another
replica wrote back first win, as on any race for a new session. KV events published while Redis was
away are not replayed: each replica polls every worker itself, and a gap resyncs from a snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any, Protocol, TypeVar

import redis.asyncio as aioredis
from pydantic import BaseModel, Field
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from herd.api.protocol import MAX_LOAD_COUNT, KVEventBatch, KVSnapshot

__all__ = [
    "IN_FLIGHT_TTL_S",
    "REDIS_TIMEOUT_S",
    "ExpectedBlocks",
    "InFlightCounts",
    "KVPayload",
    "KVSink",
    "MemoryState",
    "RedisState",
    "State",
    "build_state",
]

log = logging.getLogger(__name__)


class ExpectedBlocks(BaseModel):
    """Blocks a replica just routed a request for to a worker (``KVIndex.expect`` on every replica)."""

    block_hashes: list[int]


class InFlightCounts(BaseModel):
    """One replica's requests in flight, per worker id, as of when it wrote them."""

    origin: str
    counts: dict[str, Annotated[int, Field(ge=0, le=MAX_LOAD_COUNT)]]


KVPayload = KVEventBatch | KVSnapshot | ExpectedBlocks | InFlightCounts
KVSink = Callable[[str, KVPayload], None]
"""Receives ``(worker_id, batch, snapshot or expected blocks)`` for the local KV index."""

_T = TypeVar("_T")
_STREAM = "herd:kv"
_PIN_PREFIX = "herd:pin:"
_STREAM_MAXLEN = 100_000
_TRIM: dict[str, Any] = {"maxlen": _STREAM_MAXLEN, "approximate": True}
_MAX_EXPECTED_QUEUED = 10_000
"""Expectations waiting for the writer beyond this are dropped: they age out within seconds anyway."""
_MAX_LOCAL_WINDOWS = 10_000
"""Quota counters kept in memory before the expired ones are dropped."""
_IN_FLIGHT_REFRESH_S = 1.0
"""Non-zero counts are written again this often, unchanged, so that receivers know they still hold."""
IN_FLIGHT_TTL_S = 3.0
"""A replica's counts not refreshed for this long are dropped (the replica stopped or lost Redis)."""
REDIS_TIMEOUT_S = 0.5
"""How long one Redis call may take before the replica routes on its local state (``--redis-timeout``)."""
_CLOSE_TIMEOUT_S = 3.0
"""How long close() waits for the KV consumer to finish its current read (250 ms) or retry pause."""


class State(Protocol):
    """Session pins and KV event distribution; ``start`` before use, ``close`` at shutdown."""

    @property
    def is_degraded(self) -> bool: ...
    async def start(self, sink: KVSink) -> None: ...
    async def close(self) -> None: ...
    async def get_pin(self, key: str) -> str | None: ...
    async def claim_pin(self, key: str, worker_id: str, ttl_seconds: int) -> str: ...
    async def set_pin(self, key: str, worker_id: str, ttl_seconds: int) -> None: ...
    async def publish_kv(self, worker_id: str, payload: KVPayload) -> None: ...
    def share_expected(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        """Tell the other replicas (not this one's own index) what a decision expects on a worker."""

    async def add_to_window(self, key: str, amount: int, ttl_seconds: int) -> int:
        """Add ``amount`` to the counter ``key`` (made with ``ttl_seconds`` to live); its new value."""

    def share_in_flight(self, counts: Mapping[str, int]) -> None:
        """Tell the other replicas this one's requests in flight per worker; ``counts`` is a live
        mapping, read when written (the latest counts win)."""


class MemoryState:
    """Pins in a dict with expiry times; KV payloads go straight to the sink."""

    def __init__(self) -> None:
        self._pins: dict[str, tuple[str, float]] = {}
        self._windows: dict[str, tuple[int, float]] = {}
        self._sink: KVSink | None = None

    @property
    def is_degraded(self) -> bool:
        return False

    async def start(self, sink: KVSink) -> None:
        self._sink = sink

    async def close(self) -> None:
        self._pins.clear()

    async def get_pin(self, key: str) -> str | None:
        entry = self._pins.get(key)
        if entry is None or entry[1] <= time.monotonic():
            self._pins.pop(key, None)
            return None
        return entry[0]

    async def claim_pin(self, key: str, worker_id: str, ttl_seconds: int) -> str:
        existing = await self.get_pin(key)
        if existing is not None:
            return existing
        await self.set_pin(key, worker_id, ttl_seconds)
        return worker_id

    async def set_pin(self, key: str, worker_id: str, ttl_seconds: int) -> None:
        self._pins[key] = (worker_id, time.monotonic() + ttl_seconds)

    def live_pins(self) -> list[tuple[str, str, float]]:
        """``(key, worker_id, seconds left)`` of every pin not yet expired; expired ones are dropped."""
        now = time.monotonic()
        self._pins = {key: entry for key, entry in self._pins.items() if entry[1] > now}
        return [(key, worker_id, expiry - now) for key, (worker_id, expiry) in self._pins.items()]

    async def publish_kv(self, worker_id: str, payload: KVPayload) -> None:
        if self._sink is not None:
            self._sink(worker_id, payload)

    def share_expected(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        """One replica: its own index is the only one."""

    async def add_to_window(self, key: str, amount: int, ttl_seconds: int) -> int:
        now = time.monotonic()
        if len(self._windows) > _MAX_LOCAL_WINDOWS:
            self._windows = {name: entry for name, entry in self._windows.items() if entry[1] > now}
        value, expiry = self._windows.get(key, (0, now + ttl_seconds))
        if expiry <= now:
            value, expiry = 0, now + ttl_seconds
        self._windows[key] = (value + amount, expiry)
        return value + amount

    def share_in_flight(self, counts: Mapping[str, int]) -> None:
        """One replica: its own counts are the only ones."""


class RedisState:
    """Pins and KV events in Redis, degrading to a local ``MemoryState`` while Redis is away."""

    def __init__(
        self, url: str, *, retry_seconds: float = 1.0, timeout_seconds: float = REDIS_TIMEOUT_S
    ) -> None:
        self.url = url
        self.retry_seconds = retry_seconds
        # One try per command within the timeout, then the local state: a request must not wait out
        # a retry schedule on a dead Redis. (redis-py retries only the errors in retry_on_error, none
        # by default; the explicit Retry keeps that so if a later default changes.)
        self._redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_seconds,
            socket_connect_timeout=timeout_seconds,
            retry=Retry(NoBackoff(), 0),
        )
        self._local = MemoryState()
        """The fallback while Redis is away, and a mirror of every pin written through this replica."""
        self._is_degraded = False
        self._consumer: asyncio.Task[None] | None = None
        self._is_closing = False
        self._origin = uuid.uuid4().hex
        """Names this replica's expectations on the stream, so that its consumer skips them."""
        self._expected: list[tuple[str, Sequence[int]]] = []
        self._in_flight: Mapping[str, int] | None = None
        self._in_flight_written: dict[str, int] = {}
        self._expected_ready = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None

    @property
    def is_degraded(self) -> bool:
        return self._is_degraded

    async def start(self, sink: KVSink) -> None:
        await self._local.start(sink)
        self._consumer = asyncio.create_task(self._consume(sink), name="herd-redis-kv-consumer")
        self._writer = asyncio.create_task(self._write_expected(), name="herd-redis-expected-writer")

    async def close(self) -> None:
        # The consumer stops on its own after its current read (block=250 ms): cancelling redis-py
        # in the middle of a blocking XREAD can leave the task hanging in its connection cleanup.
        self._is_closing = True
        self._expected_ready.set()
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._writer, timeout=_CLOSE_TIMEOUT_S)
        if self._consumer is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._consumer), timeout=_CLOSE_TIMEOUT_S)
            except TimeoutError:
                self._consumer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._consumer
        await self._redis.aclose()

    async def get_pin(self, key: str) -> str | None:
        async def remote() -> str | None:
            value = await self._redis.get(_PIN_PREFIX + key)
            return None if value is None else _text(value)

        return await self._either(remote, lambda: self._local.get_pin(key))

    async def claim_pin(self, key: str, worker_id: str, ttl_seconds: int) -> str:
        async def remote() -> str:
            name = _PIN_PREFIX + key
            winner = worker_id
            if not await self._redis.set(name, worker_id, ex=ttl_seconds, nx=True):
                existing = await self._redis.get(name)
                winner = worker_id if existing is None else _text(existing)
            await self._local.set_pin(key, winner, ttl_seconds)
            return winner

        return await self._either(remote, lambda: self._local.claim_pin(key, worker_id, ttl_seconds))

    async def set_pin(self, key: str, worker_id: str, ttl_seconds: int) -> None:
        await self._local.set_pin(key, worker_id, ttl_seconds)

        async def remote() -> None:
            await self._redis.set(_PIN_PREFIX + key, worker_id, ex=ttl_seconds)

        await self._either(remote, _nothing)

    async def publish_kv(self, worker_id: str, payload: KVPayload) -> None:
        await self._local.publish_kv(worker_id, payload)

        async def remote() -> None:
            fields: dict[Any, Any] = {
                "worker": worker_id,
                "kind": _kind(payload),
                "data": payload.model_dump_json(),
            }
            await self._redis.xadd(_STREAM, fields, maxlen=_STREAM_MAXLEN, approximate=True)

        await self._either(remote, _nothing)

    async def add_to_window(self, key: str, amount: int, ttl_seconds: int) -> int:
        async def remote() -> int:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.incrby(key, amount)
                pipe.expire(key, ttl_seconds)
                value, _ = await pipe.execute()
            return int(value)

        return await self._either(remote, lambda: self._local.add_to_window(key, amount, ttl_seconds))

    def share_expected(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        if self._is_degraded or self._is_closing or len(self._expected) >= _MAX_EXPECTED_QUEUED:
            return
        self._expected.append((worker_id, block_hashes))
        self._expected_ready.set()

    def share_in_flight(self, counts: Mapping[str, int]) -> None:
        self._in_flight = counts
        self._expected_ready.set()

    async def _write_expected(self) -> None:
        """Write the queued expectations and the in-flight counts, in one pipeline, whenever there are
        some (and the non-zero counts every ``_IN_FLIGHT_REFRESH_S`` regardless)."""
        while not self._is_closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._expected_ready.wait(), _IN_FLIGHT_REFRESH_S)
            self._expected_ready.clear()
            batch, self._expected = self._expected, []
            counts = self._counts_to_write()
            if (not batch and counts is None) or self._is_degraded:
                continue
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for worker_id, hashes in batch:
                        data = ExpectedBlocks(block_hashes=list(hashes)).model_dump_json()
                        pipe.xadd(_STREAM, self._fields(worker_id, "expected", data), **_TRIM)
                    if counts is not None:
                        data = InFlightCounts(origin=self._origin, counts=counts).model_dump_json()
                        pipe.xadd(_STREAM, self._fields("", "in_flight", data), **_TRIM)
                    await pipe.execute()
            except (RedisError, OSError) as error:
                self._mark_degraded(error)
                continue
            if counts is not None:
                self._in_flight_written = counts

    def _counts_to_write(self) -> dict[str, int] | None:
        """The counts to write now: changed since the last write, or non-zero (a refresh); else None."""
        if self._in_flight is None:
            return None
        counts = {worker_id: count for worker_id, count in self._in_flight.items() if count}
        return counts if counts or counts != self._in_flight_written else None

    def _fields(self, worker_id: str, kind: str, data: str) -> dict[Any, Any]:
        return {"worker": worker_id, "kind": kind, "origin": self._origin, "data": data}

    async def _either(self, remote: Callable[[], Awaitable[_T]], local: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``remote`` unless Redis is known to be away; fall back to ``local`` on failure."""
        if self._is_degraded:
            return await local()
        try:
            return await remote()
        except (RedisError, OSError) as error:
            self._mark_degraded(error)
            return await local()

    def _mark_degraded(self, error: Exception) -> None:
        if not self._is_degraded:
            self._is_degraded = True
            log.warning(
                "redis is unreachable; using local state until it returns (check the redis server)",
                extra={"redis_url": self.url, "error": str(error)},
            )

    async def _recover(self) -> bool:
        """Reach Redis again and write this replica's live pins through; whether it is back."""
        try:
            # Pooled sockets from before the outage are dead: without this each would fail one request.
            await self._redis.connection_pool.disconnect()
            num_pins = await self._write_through()
        except (RedisError, OSError):
            return False
        self._is_degraded = False
        log.info(
            "redis is reachable again; shared state resumed",
            extra={"redis_url": self.url, "pins_written_through": num_pins},
        )
        return True

    async def _write_through(self) -> int:
        """``SET NX`` every live local pin with its remaining TTL (one round trip); how many were sent."""
        pins = self._local.live_pins()
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.ping()  # an empty pipeline would not prove that Redis answers
            for key, worker_id, seconds_left in pins:
                pipe.set(_PIN_PREFIX + key, worker_id, px=max(1, int(seconds_left * 1000)), nx=True)
            await pipe.execute()
        return len(pins)

    async def _consume(self, sink: KVSink) -> None:
        """Tail the KV stream from now on, forever; while Redis is away, probe it to recover."""
        last_id = "$"
        while not self._is_closing:
            if self._is_degraded and not await self._recover():
                await asyncio.sleep(self.retry_seconds)
                continue
            try:
                replies: Any = await self._redis.xread({_STREAM: last_id}, count=500, block=250)
            except (RedisError, OSError) as error:
                self._mark_degraded(error)
                await asyncio.sleep(self.retry_seconds)
                continue
            for _stream, entries in replies or []:
                for entry_id, fields in entries:
                    last_id = _text(entry_id)
                    if fields.get(b"origin") != self._origin.encode():
                        _deliver(sink, fields)


async def _nothing() -> None:
    return None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_MODELS: dict[bytes, type[KVEventBatch | KVSnapshot | ExpectedBlocks | InFlightCounts]] = {
    b"batch": KVEventBatch,
    b"snapshot": KVSnapshot,
    b"expected": ExpectedBlocks,
    b"in_flight": InFlightCounts,
}


def _kind(payload: KVPayload) -> str:
    return next(kind.decode() for kind, model in _MODELS.items() if isinstance(payload, model))


def _deliver(sink: KVSink, fields: dict[bytes, bytes]) -> None:
    try:
        worker_id, data = fields[b"worker"].decode(), fields[b"data"]
        payload: KVPayload = _MODELS[fields[b"kind"]].model_validate_json(data)
    except (KeyError, ValueError) as error:
        log.warning("skipping a malformed KV stream entry", extra={"error": str(error)})
        return
    try:
        sink(worker_id, payload)
    except Exception:  # another replica's entry this one cannot apply: skipped, the stream goes on
        log.exception("skipping a KV stream entry this replica could not apply", extra={"worker": worker_id})


def build_state(redis_url: str | None, *, timeout_seconds: float = REDIS_TIMEOUT_S) -> State:
    """``RedisState`` for a URL (each call waiting at most ``timeout_seconds``), else ``MemoryState``."""
    return MemoryState() if redis_url is None else RedisState(redis_url, timeout_seconds=timeout_seconds)
