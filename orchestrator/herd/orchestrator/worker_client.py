"""Calls from the orchestrator to one worker: readiness on its public port, the internal protocol.

Every call is short and bounded by the client's timeout; failures surface as ``httpx.HTTPError``
(transport errors and non-2xx statuses alike) so the registry handles one exception type.
"""

from __future__ import annotations

from typing import TypeVar

import httpx
from pydantic import BaseModel

from herd.api.protocol import (
    INTERNAL_PATHS,
    TOKEN_HEADER,
    KVEventBatch,
    KVSnapshot,
    LoadReport,
    TokenizerFiles,
    WorkerInfo,
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

    async def is_ready(self, endpoint: WorkerEndpoint) -> bool:
        """``GET /ready`` on the public port: 200 means it takes requests; raises if unreachable."""
        response = await self.http.get(f"{endpoint.url}/ready", timeout=self.timeout)
        return response.status_code == httpx.codes.OK

    async def info(self, endpoint: WorkerEndpoint) -> WorkerInfo:
        return await self._get(endpoint, INTERNAL_PATHS.info, WorkerInfo)

    async def load(self, endpoint: WorkerEndpoint) -> LoadReport:
        return await self._get(endpoint, INTERNAL_PATHS.load, LoadReport)

    async def kv_events(self, endpoint: WorkerEndpoint, *, after: int) -> KVEventBatch:
        return await self._get(endpoint, INTERNAL_PATHS.kv_events, KVEventBatch, params={"after": after})

    async def kv_snapshot(self, endpoint: WorkerEndpoint) -> KVSnapshot:
        return await self._get(endpoint, INTERNAL_PATHS.kv_snapshot, KVSnapshot)

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
