"""``herd worker``'s process: both ports, the engine loading behind them, and drain on SIGTERM.

The ports open before the model loads so that ``/health`` answers and ``/ready`` says 503 while it
does. SIGTERM (or SIGINT) drains: ``/ready`` turns 503, new requests get 503, in-flight requests
finish (up to ``drain_timeout_s``), then both servers stop and the process exits.

An engine that fails beyond recovery (it could not reset after a failed batch) stops both servers
at once and the process exits 1, so that ``herd up`` or the kubelet restarts it: a worker that
answers 503 forever would only look alive.

Several workers may share the process and its event loop (``serve_many``: a fleet of simulated
workers); each keeps its own engine thread, ports, metrics and KV events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import uvicorn
import uvloop
from fastapi import FastAPI

from herd.api.heap import freeze_startup_heap
from herd.api.prompt import PromptRenderer
from herd.worker.async_engine import AsyncEngine
from herd.worker.backends import build_engine
from herd.worker.config import EngineConfig
from herd.worker.engine_protocol import EngineCore, ServingEngine
from herd.worker.server._disagg_setup import attach_disaggregation
from herd.worker.server._internal import build_internal_app
from herd.worker.server._public import PublicOptions, build_public_app

__all__ = ["ServeOptions", "serve", "serve_many"]

logger = logging.getLogger(__name__)

_PROBE_WAITS = 100
_EXIT_GRACE_S = 5.0
"""How long a worker whose engine died waits for the answers of its failed requests to go out."""


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8001
    internal_port: int = 9001
    internal_token: str = ""
    max_body_bytes: int = 4 * 1024 * 1024
    drain_timeout_s: float = 30.0


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to ``serve`` (two servers share one process)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def serve(config: EngineConfig, options: ServeOptions) -> int:
    """Run the worker until it is drained; returns the process exit code."""
    return serve_many([(config, options)])


def serve_many(
    workers: Sequence[tuple[EngineConfig, ServeOptions]], renderer: PromptRenderer | None = None
) -> int:
    """Run several workers on one event loop (a simulated fleet), each with its own engine, ports,
    metrics and KV events; one signal drains them all. ``renderer`` is shared by the engines that
    take one (the simulated backend), so that a fleet loads its tokenizer once. Exit code 1 when
    any engine failed."""
    return uvloop.run(
        _serve(
            [_Worker(partial(build_engine, config, renderer), config, options) for config, options in workers]
        )
    )


class _Worker:
    """One worker's engine and its two servers."""

    def __init__(
        self, factory: Callable[[], EngineCore], config: EngineConfig, options: ServeOptions
    ) -> None:
        self.engine = AsyncEngine(factory)
        self.served_name = served_name = config.served_name
        self.options = options
        public = build_public_app(
            self.engine,
            PublicOptions(
                served_name, options.max_body_bytes, options.internal_token, config.engine.max_queue_len
            ),
        )
        self.disagg = attach_disaggregation(public, self.engine, options.internal_token)
        internal = build_internal_app(self.engine, options.internal_token, routers=[self.disagg.router])
        self.servers = [
            _server(public, options.host, options.port),
            _server(internal, options.host, options.internal_port),
        ]


async def _serve(workers: list[_Worker]) -> int:
    for worker in workers:
        worker.engine.start()
    stopping = _install_drain(workers, workers[0].options.drain_timeout_s)
    watchers = [asyncio.create_task(_watch_engine(worker)) for worker in workers]
    await asyncio.gather(*(server.serve() for worker in workers for server in worker.servers))
    for watcher in watchers:
        watcher.cancel()
    for worker in workers:
        await worker.engine.stop()
        await worker.disagg.http.aclose()
    logger.info("worker stopped", extra={"num_workers": len(workers)})
    has_failed = any(worker.engine.error is not None for worker in workers)
    return 1 if has_failed and not stopping.is_set() else 0


def _server(app: FastAPI, host: str, port: int) -> _Server:
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="off")
    return _Server(config)


async def _watch_engine(worker: _Worker) -> None:
    engine, servers, options = worker.engine, worker.servers, worker.options
    try:
        await engine.wait_loaded()
    except Exception:
        logger.error("the model failed to load; exiting (see the error above)")
        _stop(servers)
        return
    logger.info(
        "worker ready",
        extra={"model": worker.served_name, "port": options.port, "internal_port": options.internal_port},
    )
    freeze_startup_heap(port=options.port)
    if worker.engine.info.embedding_size is None:  # an encoder holds no KV blocks to pull
        await _probe_transport(worker)
    await engine.wait_failed()
    logger.error("the engine cannot serve any more; exiting so that the supervisor restarts this worker")
    _stop(servers)  # the requests in flight have failed: their answers go out first
    await asyncio.sleep(_EXIT_GRACE_S)
    _stop(servers, force=True)


async def _probe_transport(worker: _Worker) -> None:
    """Time the KV transport over the worker's own internal port once it listens (a bounded wait)."""
    for _ in range(_PROBE_WAITS):
        if worker.servers[1].started:
            await worker.disagg.probe(f"http://{worker.options.host}:{worker.options.internal_port}")
            return
        await asyncio.sleep(0.1)
    logger.warning("the internal port did not start in time; no KV transport probe")


def _install_drain(workers: list[_Worker], timeout: float) -> asyncio.Event:
    """SIGTERM/SIGINT start a drain of every worker; a second one stops at once. Returns the
    'drain began' flag."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()
    servers = [server for worker in workers for server in worker.servers]

    def on_signal(signum: int) -> None:
        if stopping.is_set():
            _stop(servers, force=True)
            return
        stopping.set()
        num_in_flight = sum(worker.engine.num_in_flight for worker in workers)
        logger.info("draining", extra={"signal": signal.Signals(signum).name, "num_in_flight": num_in_flight})
        for worker in workers:
            task = loop.create_task(_drain(worker.engine, worker.servers, timeout))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    return stopping


async def _drain(engine: ServingEngine, servers: list[_Server], grace_s: float) -> None:
    is_clean = await engine.drain(grace_s)
    logger.info("drained" if is_clean else "drain timed out; stopping anyway")
    _stop(servers, force=not is_clean)


def _stop(servers: list[_Server], *, force: bool = False) -> None:
    """Stop serving; ``force`` also drops open connections instead of waiting for them."""
    for server in servers:
        server.should_exit = True
        server.force_exit = force
