"""``herd worker``'s process: both ports, the engine loading behind them, and drain on SIGTERM.

The ports open before the model loads so that ``/health`` answers and ``/ready`` says 503 while it
does. SIGTERM (or SIGINT) drains: ``/ready`` turns 503, new requests get 503, in-flight requests
finish (up to ``drain_timeout_s``), then both servers stop and the process exits.

An engine that fails beyond recovery (it could not reset after a failed batch) stops both servers
at once and the process exits 1, so that ``herd up`` or the kubelet restarts it: a worker that
answers 503 forever would only look alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import uvicorn
import uvloop
from fastapi import FastAPI

from herd.worker.async_engine import AsyncEngine
from herd.worker.config import EngineConfig
from herd.worker.engine_protocol import EngineCore, ServingEngine
from herd.worker.model_runner import torch_engine
from herd.worker.server._disagg_setup import attach_disaggregation
from herd.worker.server._internal import build_internal_app
from herd.worker.server._public import PublicOptions, build_public_app

__all__ = ["ServeOptions", "serve"]

logger = logging.getLogger(__name__)

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
    return uvloop.run(_serve(lambda: torch_engine(config), config.served_name, options))


async def _serve(factory: Callable[[], EngineCore], served_name: str, options: ServeOptions) -> int:
    engine = AsyncEngine(factory)
    public = build_public_app(engine, PublicOptions(served_name, options.max_body_bytes))
    disagg = attach_disaggregation(public, engine, options.internal_token)
    internal = build_internal_app(engine, options.internal_token, routers=[disagg.router])
    servers = [
        _server(public, options.host, options.port),
        _server(internal, options.host, options.internal_port),
    ]
    engine.start()
    stopping = _install_drain(engine, servers, options.drain_timeout_s)
    watcher = asyncio.create_task(_watch_engine(engine, servers, served_name, options))
    await asyncio.gather(*(server.serve() for server in servers))
    watcher.cancel()
    await engine.stop()
    await disagg.http.aclose()
    logger.info("worker stopped")
    return 1 if engine.error is not None and not stopping.is_set() else 0


def _server(app: FastAPI, host: str, port: int) -> _Server:
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="off")
    return _Server(config)


async def _watch_engine(
    engine: ServingEngine, servers: list[_Server], served_name: str, options: ServeOptions
) -> None:
    try:
        await engine.wait_loaded()
    except Exception:
        logger.error("the model failed to load; exiting (see the error above)")
        _stop(servers)
        return
    logger.info(
        "worker ready",
        extra={"model": served_name, "port": options.port, "internal_port": options.internal_port},
    )
    await engine.wait_failed()
    logger.error("the engine cannot serve any more; exiting so that the supervisor restarts this worker")
    _stop(servers)  # the requests in flight have failed: their answers go out first
    await asyncio.sleep(_EXIT_GRACE_S)
    _stop(servers, force=True)


def _install_drain(engine: ServingEngine, servers: list[_Server], timeout: float) -> asyncio.Event:
    """SIGTERM/SIGINT start a drain; a second one stops at once. Returns the 'drain began' flag."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()

    def on_signal(signum: int) -> None:
        if stopping.is_set():
            _stop(servers, force=True)
            return
        stopping.set()
        logger.info(
            "draining", extra={"signal": signal.Signals(signum).name, "num_in_flight": engine.num_in_flight}
        )
        task = loop.create_task(_drain(engine, servers, timeout))
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
