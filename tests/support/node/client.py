"""The agent's REST client: requests with bounded retries, and list-then-watch loops that resume
from the last resourceVersion and list again after a gap (410 Gone) or a cut connection."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from herd.kube import Connection

__all__ = ["Kube", "KubeError"]

Object = dict[str, Any]
_log = logging.getLogger("herd.node.client")
_RETRIES = 5
_RETRY_DELAY_S = 0.5
_WATCH_TIMEOUT_S = 300
_STRATEGIC = "application/strategic-merge-patch+json"


class KubeError(RuntimeError):
    """The apiserver refused a request; ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Kube:
    """Thin async access to the apiserver with the agent's own credentials."""

    def __init__(self, connection: Connection) -> None:
        self.client = connection.http_client()

    async def close(self) -> None:
        await self.client.aclose()

    async def request(self, method: str, path: str, *, body: Object | None = None,
                      content_type: str = "application/json", params: dict[str, str] | None = None) -> Object | None:  # fmt: skip
        """One request, retried on a cut connection and on 5xx/429 up to 5 times; None on 404."""
        content = None if body is None else json.dumps(body)
        for attempt in range(_RETRIES):
            try:
                response = await self.client.request(
                    method, path, content=content, params=params, headers={"Content-Type": content_type}
                )
            except httpx.TransportError as error:
                _log.warning(json.dumps({"msg": "apiserver unreachable, retrying", "path": path, "error": str(error)}))  # fmt: skip
                await asyncio.sleep(_RETRY_DELAY_S * (attempt + 1))
                continue
            if response.status_code == httpx.codes.NOT_FOUND:
                return None
            if response.status_code >= 500 or response.status_code == 429:
                await asyncio.sleep(_RETRY_DELAY_S * (attempt + 1))
                continue
            if response.is_error:
                raise KubeError(
                    response.status_code, f"{method} {path}: {response.status_code} {response.text}"
                )
            result: Object = response.json()
            return result
        raise KubeError(503, f"{method} {path}: no answer after {_RETRIES} tries; is kube-apiserver up?")

    async def get(self, path: str, **params: str) -> Object | None:
        return await self.request("GET", path, params=params or None)

    async def create(self, path: str, body: Object) -> Object | None:
        return await self.request("POST", path, body=body)

    async def patch_status(self, path: str, status: Object) -> Object | None:
        """A strategic merge patch of ``path``'s status subresource (conditions merge by type)."""
        return await self.request("PATCH", f"{path}/status", body={"status": status}, content_type=_STRATEGIC)

    async def watch(
        self, path: str, on_list: Callable[[list[Object]], Awaitable[None]],
        on_event: Callable[[str, Object], Awaitable[None]], **params: str,
    ) -> None:  # fmt: skip
        """List ``path`` (``on_list``), then hand every change to ``on_event``; forever, listing
        again whenever the watch cannot resume."""
        while True:
            try:
                listed = await self.get(path, **params)
                assert listed is not None, f"{path} does not exist"
                await on_list(listed["items"])
                await self._follow(path, listed["metadata"]["resourceVersion"], on_event, params)
            except (httpx.TransportError, KubeError) as error:
                _log.warning(json.dumps({"msg": "watch cut, listing again", "path": path, "error": str(error)}))  # fmt: skip
                await asyncio.sleep(_RETRY_DELAY_S)
            except Exception:  # a handler's bug: logged whole, and the agent keeps serving
                _log.exception(json.dumps({"msg": "watch handler failed, listing again", "path": path}))
                await asyncio.sleep(_RETRY_DELAY_S)

    async def _follow(self, path: str, version: str, on_event: Callable[[str, Object], Awaitable[None]],
                      params: dict[str, str]) -> None:  # fmt: skip
        """Follow one watch from ``version`` and its successors; returns when it must list again."""
        while True:
            query = {**params, "watch": "1", "resourceVersion": version, "allowWatchBookmarks": "true",
                     "timeoutSeconds": str(_WATCH_TIMEOUT_S)}  # fmt: skip
            async with self.client.stream(
                "GET", path, params=query, timeout=_WATCH_TIMEOUT_S + 30
            ) as response:
                if response.status_code == httpx.codes.GONE:
                    return
                if response.is_error:
                    raise KubeError(response.status_code, f"watch {path}: {response.status_code}")
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    event = json.loads(line)
                    if event["type"] == "ERROR":
                        return  # 410 Gone, mostly: the version is too old
                    version = event["object"]["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        await on_event(event["type"], event["object"])
