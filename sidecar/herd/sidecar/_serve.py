"""``herd sidecar``'s process: the public and internal ports, vLLM's KV events, and drain on SIGTERM.

The ports open at once: ``/health`` follows vLLM's, ``/ready`` says 503 until vLLM has served its
cache geometry and its model list (it loads for minutes). The KV event subscriber starts first, so
that no batch vLLM publishes while it warms up is missed. SIGTERM (or SIGINT) drains: ``/ready`` and
the load report say so at once, the servers stop taking connections and finish what is in flight
(a second signal drops them). A subscriber that cannot run (its port taken) stops the process with
exit code 1, as does a vLLM whose block size is not ``--block-size``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
import uvloop
from starlette.types import ASGIApp

from herd.api.backends import KV_EVENTS_TOPIC
from herd.api.heap import freeze_startup_heap
from herd.api.prompt import read_tokenizer_files
from herd.api.protocol import TokenizerFiles
from herd.sidecar._internal import build_internal_app
from herd.sidecar._kv_state import KVState
from herd.sidecar._proxy import build_public_app
from herd.sidecar._subscriber import KVEventSubscriber
from herd.sidecar._vllm import VLLMView, model_layout

__all__ = ["SidecarOptions", "serve"]

logger = logging.getLogger(__name__)

_VLLM_TIMEOUT = httpx.Timeout(None, connect=5.0)
"""No read timeout: the gateway bounds a request's wait for its next byte, and a long generation may
go quiet between tokens for as long as a prefill of others takes."""
_VLLM_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=256)


@dataclass(frozen=True)
class SidecarOptions:
    vllm_url: str
    kv_events: str
    kv_replay: str
    served_name: str
    model_path: Path
    block_size: int
    internal_token: str
    host: str = "127.0.0.1"
    port: int = 8001
    internal_port: int = 9001
    kv_topic: str = KV_EVENTS_TOPIC


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to ``serve`` (two servers share one process)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def serve(options: SidecarOptions) -> int:
    """Run the sidecar until it is stopped; returns the process exit code."""
    return uvloop.run(_serve(options))


async def _serve(options: SidecarOptions) -> int:
    kv = KVState(options.served_name, options.block_size)
    subscriber = KVEventSubscriber(
        options.kv_events, options.kv_replay, options.kv_topic, kv.apply, kv.restart
    )
    tokenizer = TokenizerFiles(files=read_tokenizer_files(options.model_path))
    async with httpx.AsyncClient(
        base_url=options.vllm_url, timeout=_VLLM_TIMEOUT, limits=_VLLM_LIMITS
    ) as vllm:
        view = VLLMView(
            vllm, served_name=options.served_name, role="unified", layout=model_layout(options.model_path)
        )
        is_ready = lambda: view.is_learned and not view.is_draining  # noqa: E731
        servers = [
            _server(build_public_app(vllm, is_ready), options.host, options.port),
            _server(
                build_internal_app(
                    options.internal_token, kv, lambda: view.info(kv.epoch), view.load, tokenizer, is_ready
                ),
                options.host,
                options.internal_port,
            ),
        ]
        _install_drain(view, servers)
        tasks = [asyncio.create_task(subscriber.run()), asyncio.create_task(_learn(view, options))]
        for task in tasks:
            task.add_done_callback(lambda done: _on_failure(done, servers))
        await asyncio.gather(*(server.serve() for server in servers))
        failed = any(task.done() and not task.cancelled() and task.exception() for task in tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    logger.info("sidecar stopped")
    return 1 if failed else 0


def _server(app: ASGIApp, host: str, port: int) -> _Server:
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="off")
    return _Server(config)


async def _learn(view: VLLMView, options: SidecarOptions) -> None:
    geometry = await view.learn()
    if geometry.block_size != options.block_size:
        raise ValueError(
            f"vLLM's block size is {geometry.block_size}, --block-size {options.block_size}: the "
            "orchestrator would hash prompts unlike vLLM's KV events; start both with the manifest's "
            "engine.kvCache.blockSize"
        )
    logger.info(
        "sidecar ready",
        extra={"model": options.served_name, "num_blocks": geometry.num_blocks, "port": options.port},
    )
    freeze_startup_heap(port=options.port)


def _on_failure(task: asyncio.Task[None], servers: list[_Server]) -> None:
    """A failed subscriber (its port taken) or a vLLM unlike the flags: exit, for a restart."""
    if task.cancelled() or (error := task.exception()) is None:
        return
    logger.error("the sidecar cannot serve; exiting", exc_info=error)
    _stop(servers, force=True)


def _install_drain(view: VLLMView, servers: list[_Server]) -> None:
    """SIGTERM/SIGINT drain (``/ready`` 503, in-flight requests finish); a second one stops at once."""
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        logger.info("draining", extra={"signal": signal.Signals(signum).name})
        _stop(servers, force=view.is_draining)
        view.is_draining = True

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)


def _stop(servers: list[_Server], *, force: bool) -> None:
    for server in servers:
        server.should_exit = True
        server.force_exit = force
