"""A small fake OpenAI server for load-generator tests (the server is not what is under test).

It streams ``max_tokens`` chunks of one word each, ``first_token_delay_s`` then ``token_delay_s``
apart, ends with a usage chunk (``cached_tokens`` = a quarter of the prompt words) and ``[DONE]``,
names a worker in ``X-Herd-Worker`` (cycling over ``workers``), and records every request. With
``reject_unknown`` it answers 422 to fields outside the OpenAI API, as ``transformers serve`` does.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from support.procs import free_port, wait_until

__all__ = ["FakeOpenAI", "serving"]

_KNOWN_FIELDS = {"model", "messages", "prompt", "max_tokens", "stream", "stream_options"}


@dataclass
class FakeOpenAI:
    workers: tuple[str, ...] = ("worker-a", "worker-b")
    first_token_delay_s: float = 0.0
    token_delay_s: float = 0.0
    reject_unknown: bool = False
    fail_mode: str | None = None
    """``"http"`` (503 every 3rd request), ``"event"`` (an error event), ``"truncate"`` (no finish, no [DONE]),
    ``"no-done"`` (a complete answer without [DONE], as transformers serve sends),
    ``"no-cache-details"`` (usage without ``prompt_tokens_details``)."""
    requests: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._worker_cycle = itertools.cycle(self.workers)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self._models),
                Route("/v1/chat/completions", self._complete, methods=["POST"]),
                Route("/v1/completions", self._complete, methods=["POST"]),
            ]
        )

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
        unknown = set(body) - _KNOWN_FIELDS
        if self.reject_unknown and unknown:
            return _error(422, f"unknown fields {sorted(unknown)}")
        if self.fail_mode == "http" and len(self.requests) % 3 == 0:
            return _error(503, "no worker available")
        headers = {"X-Herd-Worker": next(self._worker_cycle)}
        return StreamingResponse(self._chunks(body), media_type="text/event-stream", headers=headers)

    async def _chunks(self, body: dict[str, Any]) -> AsyncIterator[str]:
        chat = "messages" in body
        await asyncio.sleep(self.first_token_delay_s)
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(self.token_delay_s)
            if self.fail_mode == "event" and i == 1:
                yield _sse({"error": {"message": "worker died", "type": "server_error"}})
                return
            choice = {"index": 0, "delta": {"content": f"w{i} "}} if chat else {"index": 0, "text": f"w{i} "}
            yield _sse({"choices": [choice]})
        if self.fail_mode == "truncate":
            return
        finish = (
            {"index": 0, "delta": {}, "finish_reason": "length"}
            if chat
            else {"index": 0, "text": "", "finish_reason": "length"}
        )
        yield _sse({"choices": [finish]})
        if body.get("stream_options", {}).get("include_usage"):
            usage = _usage(body)
            if self.fail_mode == "no-cache-details":
                del usage["prompt_tokens_details"]
            yield _sse({"choices": [], "usage": usage})
        if self.fail_mode != "no-done":
            yield "data: [DONE]\n\n"


def _usage(body: dict[str, Any]) -> dict[str, Any]:
    texts = [m["content"] for m in body["messages"]] if "messages" in body else [body["prompt"]]
    prompt_tokens = sum(len(text.split()) for text in texts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": body["max_tokens"],
        "total_tokens": prompt_tokens + body["max_tokens"],
        "prompt_tokens_details": {"cached_tokens": prompt_tokens // 4},
    }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error(status: int, message: str) -> Response:
    return JSONResponse(
        {"error": {"message": message, "type": "error", "param": None, "code": status}}, status
    )


@contextmanager
def serving(app: Starlette) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a loopback port in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=30.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)
