"""The proxy's HTTP/1.1 pool against a scripted loopback server: framing, keep-alive, failures."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio
import uvloop

from herd.orchestrator.upstream import NotAnsweredError, UpstreamError, UpstreamPool, UpstreamTimeoutError

pytestmark = pytest.mark.timeout(30)

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
JSON = b'{"ok": true}'


class Server:
    """Loopback HTTP server: reads each request whole, then runs ``answer``; counts connections."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.num_connections = 0
        self.bodies: list[bytes] = []
        self.heads: list[bytes] = []
        self.hung_up = asyncio.Event()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1/chat/completions"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.bodies.append(await reader.readexactly(length))
                await self.answer(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.hung_up.set()
        finally:
            writer.close()


async def start_server(answer: Answer) -> Server:
    server = Server(answer)
    server.server = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    return server


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Callable[[Answer], Awaitable[Server]]]:
    servers: list[Server] = []

    async def start(answer: Answer) -> Server:
        servers.append(await start_server(answer))
        return servers[-1]

    yield start
    for server in servers:
        assert server.server is not None
        server.server.close()


def pool(read_timeout: float = 5.0) -> UpstreamPool:
    return UpstreamPool(connect_timeout=2.0, read_timeout=read_timeout)


async def sized(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
        % (len(JSON), JSON)
    )


async def chunked(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    for n in range(3):
        event = b"data: %d\n\n" % n
        writer.write(b"%x\r\n%b\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(0.01)
    writer.write(b"0\r\n\r\n")


async def test_a_sized_answer_is_read_whole_and_the_connection_is_reused(
    serve: Callable[[Answer], Awaitable[Server]],
) -> None:
    server = await serve(sized)
    client = pool()
    for number in range(3):
        upstream = await client.post(server.url, b'{"n": %d}' % number)
        assert upstream.status_code == 200
        assert upstream.headers_for_client() == {"content-type": "application/json"}
        assert await upstream.read_rest() == JSON
    assert server.bodies == [b'{"n": 0}', b'{"n": 1}', b'{"n": 2}']
    assert server.num_connections == 1
    await client.aclose()


async def test_a_request_id_travels_as_a_header(serve: Callable[[Answer], Awaitable[Server]]) -> None:
    server = await serve(sized)
    client = pool()
    await (await client.post(server.url, b"{}", request_id="trace-7")).read_rest()
    await (await client.post(server.url, b"{}")).read_rest()
    assert b"\r\nx-request-id: trace-7\r\n" in server.heads[0]
    assert b"x-request-id" not in server.heads[1]
    assert server.bodies == [b"{}", b"{}"]
    await client.aclose()


@pytest.mark.parametrize(("token", "expected"), [("s3cret", b"\r\nx-herd-token: s3cret\r\n"), (None, None)])
async def test_the_internal_token_travels_on_every_request_when_set(
    serve: Callable[[Answer], Awaitable[Server]], token: str | None, expected: bytes | None
) -> None:
    server = await serve(sized)
    client = UpstreamPool(connect_timeout=2.0, read_timeout=5.0, token=token)
    for _ in range(2):
        await (await client.post(server.url, b"{}")).read_rest()
    for head in server.heads:
        assert (expected in head) if expected is not None else (b"x-herd-token" not in head)
    assert server.bodies == [b"{}", b"{}"]
    await client.aclose()


async def test_a_chunked_stream_arrives_chunk_by_chunk(serve: Callable[[Answer], Awaitable[Server]]) -> None:
    server = await serve(chunked)
    client = pool()
    upstream = await client.post(server.url, b"{}")
    chunks = [upstream.first_chunk, *[chunk async for chunk in upstream]]
    await upstream.aclose()
    assert chunks == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert (await (await client.post(server.url, b"{}")).read_rest()).count(b"data:") == 3
    assert server.num_connections == 1
    await client.aclose()


async def test_an_answer_ended_by_closing_the_connection(
    serve: Callable[[Answer], Awaitable[Server]],
) -> None:
    async def close_delimited(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    server = await serve(close_delimited)
    client = pool()
    assert await (await client.post(server.url, b"{}")).read_rest() == b"all of it"
    assert await (await client.post(server.url, b"{}")).read_rest() == b"all of it"
    assert server.num_connections == 2  # "connection: close" is never reused
    await client.aclose()


async def test_a_keep_alive_connection_closed_while_idle_is_replaced(
    serve: Callable[[Answer], Awaitable[Server]],
) -> None:
    async def then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await sized(reader, writer)
        await writer.drain()
        writer.close()  # like a worker's keep-alive timeout, but without saying so in the headers

    server = await serve(then_close)
    client = pool()
    assert await (await client.post(server.url, b"{}")).read_rest() == JSON
    assert await (await client.post(server.url, b"{}")).read_rest() == JSON
    assert server.num_connections == 2
    await client.aclose()


async def test_a_stale_connection_that_fails_on_send_is_retried_once_on_a_new_one(
    serve: Callable[[Answer], Awaitable[Server]],
) -> None:
    server = await serve(sized)
    client = pool()
    assert await (await client.post(server.url, b"{}")).read_rest() == JSON
    (connection,) = next(iter(client._idle.values()))
    connection._is_lost = False  # the close is not seen yet: the race a pool cannot rule out
    connection._transport.close()  # type: ignore[union-attr]
    assert await (await client.post(server.url, b"{}")).read_rest() == JSON
    assert server.num_connections == 2
    await client.aclose()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"", "closed the connection"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort", "closed the connection mid-answer"),
        (b"not http at all\r\n\r\n", "not valid HTTP/1.1"),
    ],
    ids=["no-answer", "cut-short", "garbage"],
)
async def test_a_broken_answer_raises(
    serve: Callable[[Answer], Awaitable[Server]], answer: bytes, message: str
) -> None:
    async def broken(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await serve(broken)
    client = pool()
    with pytest.raises(UpstreamError, match=message):
        await (await client.post(server.url, b"{}")).read_rest()
    assert not client._idle.get(("127.0.0.1", int(server.url.split(":")[2].split("/")[0])))
    await client.aclose()


async def test_silence_past_the_read_timeout_raises_and_hangs_up(
    serve: Callable[[Answer], Awaitable[Server]],
) -> None:
    async def silent(reader: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client hangs up

    server = await serve(silent)
    client = pool(read_timeout=0.2)
    with pytest.raises(UpstreamError, match=r"sent nothing for 0\.2s"):
        await client.post(server.url, b"{}")
    await asyncio.wait_for(server.hung_up.wait(), 5)


async def test_nothing_listening_raises() -> None:
    with pytest.raises(UpstreamError, match=r"cannot connect to 127\.0\.0\.1:1"):
        await pool().post("http://127.0.0.1:1/v1/completions", b"{}")


async def test_a_url_that_is_not_plain_http_is_refused() -> None:
    with pytest.raises(UpstreamError, match="not http://host"):
        await pool().post("https://worker:8000/v1/completions", b"{}")


async def test_closing_an_unfinished_answer_hangs_up_on_the_worker(
    serve: Callable[[Answer], Awaitable[Server]],
) -> None:
    async def endless(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _n in range(500):
            writer.write(b"5\r\nhello\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    server = await serve(endless)
    client = pool()
    upstream = await client.post(server.url, b"{}")
    assert upstream.first_chunk == b"hello"
    await upstream.aclose()
    await asyncio.wait_for(server.hung_up.wait(), 5)
    assert not any(client._idle.values())


async def test_a_slow_reader_pauses_the_worker_instead_of_buffering_everything(
    serve: Callable[[Answer], Awaitable[Server]],
) -> None:
    size = 8 << 20

    async def large(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        block = b"x" * 65536
        for _n in range(size // len(block)):
            writer.write(block)
            await writer.drain()

    server = await serve(large)
    client = pool()
    upstream = await client.post(server.url, b"{}")
    connection = upstream.body._connection  # type: ignore[attr-defined]
    await asyncio.sleep(0.3)  # the reader lags: the pool stops reading past its high-water mark
    assert connection._buffered <= 2 << 20
    assert len(upstream.first_chunk) + sum([len(chunk) async for chunk in upstream]) == size
    await upstream.aclose()
    await client.aclose()
    assert server.num_connections == 1


def test_the_pool_works_on_uvloop_the_loop_the_orchestrator_serves_on() -> None:
    """uvloop's transports are not asyncio's classes (the rest of this module runs on asyncio)."""

    async def scenario() -> None:
        server = await start_server(chunked)
        client = pool()
        upstream = await client.post(server.url, b"{}")
        assert [upstream.first_chunk, *[chunk async for chunk in upstream]][-1] == b"data: 2\n\n"
        await upstream.aclose()
        assert (await (await client.post(server.url, b"{}")).read_rest()).count(b"data:") == 3
        assert server.num_connections == 1
        await client.aclose()
        assert server.server is not None
        server.server.close()

    uvloop.run(scenario())


async def _reset(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset before answering (SO_LINGER 0), as a killed process's socket does."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _answer(answer: bytes) -> Answer:
    async def send(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await writer.drain()
        writer.close()

    return send


@pytest.mark.parametrize(
    ("how", "error"),
    [
        ("closed-before-answering", NotAnsweredError),
        ("reset-before-answering", NotAnsweredError),
        ("nothing-listening", NotAnsweredError),
        ("cut-after-the-head", UpstreamError),
        ("garbage", UpstreamError),
        ("silent", UpstreamTimeoutError),
    ],
    ids=str,
)
async def test_only_a_connection_that_failed_before_any_answer_is_not_answered(
    serve: Callable[[Answer], Awaitable[Server]], how: str, error: type[UpstreamError]
) -> None:
    """The gateway retries ``NotAnsweredError`` on another worker, and nothing else."""
    answers: dict[str, Answer] = {
        "closed-before-answering": _answer(b""),
        "reset-before-answering": _reset,
        "cut-after-the-head": _answer(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n"),
        "garbage": _answer(b"not http at all\r\n\r\n"),
        "silent": lambda reader, _: reader.read(),
    }
    url = (
        "http://127.0.0.1:1/v1/completions" if how == "nothing-listening" else (await serve(answers[how])).url
    )
    client = pool(read_timeout=0.5)
    with pytest.raises(UpstreamError) as raised:
        await client.post(url, b"{}")
    assert type(raised.value) is error
    await client.aclose()
