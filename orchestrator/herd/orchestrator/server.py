"""Serving the orchestrator app with uvicorn on one host and port, on uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import uvicorn
import uvloop
from fastapi import FastAPI

__all__ = ["run_server", "serve"]

_STARTUP_POLL_SECONDS = 0.05
_STARTUP_LIMIT_SECONDS = 60.0


def run_server(app: FastAPI, *, host: str, port: int, on_started: Callable[[], None] | None = None) -> None:
    """``serve`` on a uvloop event loop (``asyncio.run`` would give the slower pure-Python loop)."""
    uvloop.run(serve(app, host=host, port=port, on_started=on_started))


async def serve(app: FastAPI, *, host: str, port: int, on_started: Callable[[], None] | None = None) -> None:
    """Run until SIGINT or SIGTERM; ``on_started`` runs once the socket accepts connections."""
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    if await _started(server, task) and on_started is not None:
        on_started()
    await task


async def _started(server: uvicorn.Server, task: asyncio.Task[None]) -> bool:
    """Whether the server came up (uvicorn has no startup callback, so poll its flag, bounded)."""
    for _ in range(int(_STARTUP_LIMIT_SECONDS / _STARTUP_POLL_SECONDS)):
        if server.started or task.done():
            break
        await asyncio.sleep(_STARTUP_POLL_SECONDS)
    return bool(server.started)
