"""HTTP/1.1 to the workers on the proxy's hot path: pooled keep-alive connections parsed by httptools.

The proxy needs one thing from HTTP: POST a JSON body to a worker it already knows and hand back the
answer's bytes as they arrive. httpx's client layers (request and URL models, header merging,
cookies, h11) led the gateway's CPU profile for that (docs/benchmarks/gateway.md). ``UpstreamPool`` sends each request in one write on a pooled
connection and parses the answer with httptools (the C parser uvicorn serves with), chunk by chunk
with flow control. httpx still does the orchestrator's other calls (polling, prefill, KV transfer).

A keep-alive connection that the worker closed while idle can fail before any byte comes back; the
request is then sent once more on a new connection, so a normal idle timeout never looks like a
failing worker. Any other failure raises ``UpstreamError``: ``NotAnsweredError`` when not one byte
of an answer came back because the connection failed (refused, reset, closed, or not made in time),
which is the one failure the gateway may retry elsewhere; ``UpstreamTimeoutError`` when the worker
went silent for the read timeout.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, cast
from urllib.parse import urlsplit

import anyio
import httptools

from herd.api.protocol import TOKEN_HEADER

__all__ = [
    "NotAnsweredError",
    "Upstream",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamTimeoutError",
]

_FORWARDED_RESPONSE_HEADERS = ("content-type", "retry-after", "x-request-id")
_PAUSE_ABOVE = 1 << 20
"""Buffered response bytes above which reading from the worker pauses (the client is slower)."""
_RESUME_BELOW = 1 << 18
_MAX_CACHED_TARGETS = 4096


class UpstreamError(Exception):
    """The worker could not be reached, timed out, broke HTTP, or closed the connection mid-answer."""


class NotAnsweredError(UpstreamError):
    """The connection failed before the first byte of an answer: refused, not made within the connect
    timeout, reset or closed. The worker answered nothing (a killed worker's queued requests end so)."""


class UpstreamTimeoutError(UpstreamError):
    """The worker sent nothing for the read timeout (it may still be working on the request)."""


class BodyStream(Protocol):
    async def next_chunk(self) -> bytes:
        """The next chunk of the body; ``b""`` once it is complete."""
        ...

    async def close(self) -> None: ...


@dataclass(eq=False)
class Upstream:
    """A worker's answer whose status, headers and first body chunk have arrived.

    Iterating it yields the rest of the body; ``aclose`` must always follow (it returns the
    connection to the pool when the body was read to its end, and closes it otherwise)."""

    status_code: int
    headers: Mapping[str, str]
    """Lower-case names."""
    first_chunk: bytes
    body: BodyStream

    def headers_for_client(self) -> dict[str, str]:
        return {name: value for name in _FORWARDED_RESPONSE_HEADERS if (value := self.headers.get(name))}

    def __aiter__(self) -> Upstream:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self.body.next_chunk()
        if not chunk:
            raise StopAsyncIteration
        return chunk

    async def read_rest(self) -> bytes:
        """The whole body (for non-streaming requests); the answer is closed afterwards."""
        try:
            return self.first_chunk + b"".join([chunk async for chunk in self])
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.body.close()


class UpstreamClient(Protocol):
    """What the gateway needs to reach a worker (``UpstreamPool``; tests substitute fakes)."""

    async def post(
        self,
        url: str,
        body: bytes,
        *,
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Upstream:
        """POST the JSON ``body`` to ``url`` (with ``X-Request-Id`` when given, and ``headers``, herd's
        own ASCII headers) and wait for the first body chunk; raises ``UpstreamError``."""
        ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _Target:
    """A parsed worker URL: its pool key and the request head up to the content length."""

    host: str
    port: int
    head: bytes


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to workers, at most ``max_idle_per_host`` idle per worker.

    Every request carries the workers' internal ``token`` when there is one: it is what lets a
    decode worker pull a prefilled prompt's KV blocks from the prefill worker the gateway named.
    """

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_idle_per_host: int = 256,
        token: str | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        """Longest wait for the worker's next byte (the first one included)."""
        self.max_idle_per_host = max_idle_per_host
        self._token_header = f"{TOKEN_HEADER.lower()}: {token}\r\n".encode("ascii") if token else b""
        self._idle: dict[tuple[str, int], collections.deque[_Connection]] = {}
        self._targets: dict[str, _Target] = {}

    async def post(
        self,
        url: str,
        body: bytes,
        *,
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Upstream:
        target = self._target(url)
        extra = b"\r\nx-request-id: %b" % request_id.encode("ascii") if request_id else b""
        if headers:
            extra += b"".join(
                b"\r\n%b: %b" % (n.encode("ascii"), v.encode("ascii")) for n, v in headers.items()
            )
        request = b"%b%d%b\r\n\r\n%b" % (target.head, len(body), extra, body)
        while True:
            connection, is_reused = await self._acquire(target)
            connection.send(request)
            try:
                status, headers = await connection.read_head()
                first_chunk = await connection.next_chunk()
            except NotAnsweredError:
                connection.close()
                if is_reused:
                    continue  # the worker closed this idle connection as we sent: send on a new one
                raise
            except BaseException:  # failed, or cancelled (the client left): the worker must see the hang-up
                connection.close()
                raise
            return Upstream(status, headers, first_chunk, _Body(connection, self))

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    def release(self, connection: _Connection) -> None:
        """Keep a connection whose answer was read to the end, if the worker keeps it alive."""
        idle = self._idle.setdefault(connection.key, collections.deque())
        if connection.is_reusable and len(idle) < self.max_idle_per_host:
            idle.append(connection)
        else:
            connection.close()

    async def _acquire(self, target: _Target) -> tuple[_Connection, bool]:
        idle = self._idle.get((target.host, target.port))
        while idle:
            connection = idle.pop()
            if connection.is_reusable:
                connection.begin()
                return connection, True
        return await self._connect(target), False

    async def _connect(self, target: _Target) -> _Connection:
        loop = asyncio.get_running_loop()
        key = (target.host, target.port)
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(key, self.read_timeout), target.host, target.port
                )
        except TimeoutError:
            raise NotAnsweredError(
                f"connecting to {target.host}:{target.port} took over {self.connect_timeout}s"
            ) from None
        except OSError as error:
            raise NotAnsweredError(f"cannot connect to {target.host}:{target.port}: {error}") from None
        return connection

    def _target(self, url: str) -> _Target:
        """Parsed once per worker and path (workers come and go: the cache is bounded)."""
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= _MAX_CACHED_TARGETS:
                self._targets.clear()
            target = self._targets[url] = _parse(url, self._token_header)
        return target


def _parse(url: str, extra_headers: bytes) -> _Target:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise UpstreamError(f"worker URL {url!r} is not http://host[:port]/path; workers serve plain HTTP")
    port = parts.port or 80
    host_header = parts.netloc
    head = (
        f"POST {parts.path or '/'} HTTP/1.1\r\nhost: {host_header}\r\n".encode("ascii")
        + extra_headers
        + b"content-type: application/json\r\naccept: */*\r\ncontent-length: "
    )
    return _Target(parts.hostname, port, head)


class _Body:
    """The rest of one answer on one connection, handed back to the pool when read to the end."""

    def __init__(self, connection: _Connection, pool: UpstreamPool) -> None:
        self._connection = connection
        self._pool: UpstreamPool | None = pool

    async def next_chunk(self) -> bytes:
        return await self._connection.next_chunk()

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if self._connection.is_complete:
            pool.release(self._connection)
        else:
            self._connection.close()  # the worker sees the hang-up and aborts the request


class _Connection(asyncio.Protocol):
    """One keep-alive connection; its parser callbacks fill the current answer's state."""

    def __init__(self, key: tuple[str, int], read_timeout: float) -> None:
        self.key = key
        self.read_timeout = read_timeout
        """Longest wait for the worker's next byte."""
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._is_lost = False
        self._is_paused = False
        self.begin()

    def begin(self) -> None:
        """Forget the previous answer (called before each request on a reused connection)."""
        self.status = 0
        self.headers: dict[str, str] = {}
        self.has_answered = False
        self.is_complete = False
        self._keep_alive = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def is_reusable(self) -> bool:
        return self.is_complete and self._keep_alive and not self._is_lost

    def send(self, data: bytes) -> None:
        assert self._transport is not None
        if self._is_lost:
            self._fail("the worker closed the connection")
        else:
            self._transport.write(data)

    def close(self) -> None:
        self._is_lost = True
        if self._transport is not None:
            self._transport.close()

    async def read_head(self) -> tuple[int, dict[str, str]]:
        while not self.status:
            self._raise_if_failed()
            await self._wait()
        return self.status, self.headers

    async def next_chunk(self) -> bytes:
        while not self._chunks:
            if self.is_complete:
                return b""
            self._raise_if_failed()
            await self._wait()
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._is_paused and self._buffered < _RESUME_BELOW and self._transport is not None:
            self._is_paused = False
            self._transport.resume_reading()
        return chunk

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(self.read_timeout):
                await self._waiter
        except TimeoutError:
            self.close()
            raise UpstreamTimeoutError(f"the worker sent nothing for {self.read_timeout}s") from None
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, reason: str) -> None:
        if self._error is None and not self.is_complete:
            self._error = (UpstreamError if self.has_answered else NotAnsweredError)(reason)
        self._wake()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        sock = transport.get_extra_info("socket")
        if sock is not None:  # chunks are small and must leave at once: no Nagle delay
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.has_answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail("the worker tried to upgrade the connection")
            self.close()
        except httptools.HttpParserError as error:
            self._fail(f"the worker's answer is not valid HTTP/1.1: {error}")
            self.close()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._is_lost = True
        if (
            self.status
            and not self.is_complete
            and "content-length" not in self.headers
            and not self._chunked
        ):
            self._complete()  # an answer delimited by the connection's end
        self._fail(f"the worker closed the connection mid-answer ({exc or 'end of stream'})")

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if not self._is_paused and self._buffered > _PAUSE_ABOVE and self._transport is not None:
            self._is_paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self._complete()

    @property
    def _chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()

    def _complete(self) -> None:
        self.is_complete = True
        self._wake()
