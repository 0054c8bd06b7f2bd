"""Calls from the orchestrator to one worker over the internal protocol.

The status stream is held open (``status``); every other call is short and bounded by the client's
timeout. Failures surface as ``httpx.HTTPError`` (transport errors and non-2xx statuses alike) so
the registry handles one exception type; a malformed line as ``ValueError``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

import httpx
from pydantic import BaseModel

from herd.api.protocol import (
    INTERNAL_PATHS,
    TOKEN_HEADER,
    StatusQuery,
    TokenizerFiles,
    WorkerInfo,
    WorkerStatus,
)
from herd.orchestrator.discovery import WorkerEndpoint

__all__ = ["LORA_PATHS", "WorkerClient"]

_TOKENIZER_TIMEOUT = httpx.Timeout(30.0, connect=2.0)
_LORA_TIMEOUT = httpx.Timeout(60.0, connect=2.0)
"""Loading an adapter reads its weights from disk, between two of the worker's steps."""
LORA_PATHS = {"load": "/v1/load_lora_adapter", "unload": "/v1/unload_lora_adapter"}
"""vLLM's runtime LoRA routes, on a worker's public port behind the internal token."""
"""``tokenizer.json`` runs to several MB: allow far longer than a poll's short timeout."""

_M = TypeVar("_M", bound=BaseModel)


class WorkerClient:
    """The internal worker protocol over one shared ``httpx.AsyncClient``."""

    def __init__(self, http: httpx.AsyncClient, *, token: str | None, timeout_seconds: float = 0.5) -> None:
        self.http = http
        self.headers = {TOKEN_HEADER: token} if token else {}
        self.timeout = httpx.Timeout(timeout_seconds)

    async def info(self, endpoint: WorkerEndpoint) -> WorkerInfo:
        return await self._get(endpoint, INTERNAL_PATHS.info, WorkerInfo)

    @contextlib.asynccontextmanager
    async def status(
        self, endpoint: WorkerEndpoint, query: StatusQuery, *, silence_timeout: float, connect_timeout: float
    ) -> AsyncIterator[AsyncIterator[WorkerStatus]]:
        """The worker's status stream, open while the block runs: its lines as they come. No line for
        ``silence_timeout`` seconds raises ``httpx.ReadTimeout``."""
        params = query.model_dump(exclude_none=True)
        timeout = httpx.Timeout(silence_timeout, connect=connect_timeout)
        url = f"{endpoint.internal_url}{INTERNAL_PATHS.status}"
        async with self.http.stream(
            "GET", url, headers=self.headers, params=params, timeout=timeout
        ) as response:
            response.raise_for_status()
            yield _lines(response, silence_timeout)

    async def tokenizer_files(self, endpoint: WorkerEndpoint) -> TokenizerFiles:
        return await self._get(
            endpoint, INTERNAL_PATHS.tokenizer, TokenizerFiles, http_timeout=_TOKENIZER_TIMEOUT
        )

    async def change_lora(
        self, endpoint: WorkerEndpoint, action: str, body: dict[str, str]
    ) -> httpx.Response:
        """``action`` ("load" or "unload") a LoRA adapter on the worker; its answer, whatever the status."""
        url = f"{endpoint.url}{LORA_PATHS[action]}"
        return await self.http.post(url, json=body, headers=self.headers, timeout=_LORA_TIMEOUT)

    async def _get(
        self,
        endpoint: WorkerEndpoint,
        path: str,
        model: type[_M],
        params: dict[str, int] | None = None,
        http_timeout: httpx.Timeout | None = None,
    ) -> _M:
        response = await self.http.get(
            f"{endpoint.internal_url}{path}",
            headers=self.headers,
            params=params,
            timeout=http_timeout or self.timeout,
        )
        response.raise_for_status()
        return model.model_validate_json(response.content)


async def _lines(response: httpx.Response, silence_timeout: float) -> AsyncIterator[WorkerStatus]:
    """The stream's statuses; the silence is timed here, not only by the transport, so that any
    transport (a test's in-process one too) gets the same rule."""
    lines = response.aiter_lines()
    while True:
        try:
            async with asyncio.timeout(silence_timeout):
                line = await anext(lines, None)
        except TimeoutError:
            raise httpx.ReadTimeout(
                f"no status line for {silence_timeout} s (heartbeats stopped)", request=response.request
            ) from None
        if line is None:
            return
        if line:
            yield WorkerStatus.model_validate_json(line)
