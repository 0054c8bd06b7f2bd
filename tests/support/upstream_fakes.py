"""The proxy's ``UpstreamClient`` over an httpx client, for tests whose workers sit behind
``httpx.MockTransport`` or ``httpx.ASGITransport`` (no sockets). The real pool has its own tests."""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from herd.api.protocol import TOKEN_HEADER
from herd.orchestrator.upstream import NotAnsweredError, Upstream, UpstreamError, UpstreamTimeoutError


class HttpxUpstream:
    """``UpstreamClient`` over an httpx client (in-process workers), sending the internal ``token`` on
    every request as ``UpstreamPool`` does."""

    def __init__(self, http: httpx.AsyncClient, *, token: str | None = None) -> None:
        self.http = http
        self.token = token

    async def post(
        self,
        url: str,
        body: bytes,
        *,
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Upstream:
        headers = {
            "content-type": "application/json",
            **({"x-request-id": request_id} if request_id else {}),
            **(headers or {}),
        }
        if self.token:
            headers[TOKEN_HEADER] = self.token
        request = self.http.build_request("POST", url, content=body, headers=headers)
        try:
            response = await self.http.send(request, stream=True)
        except httpx.HTTPError as error:
            raise _as_upstream_error(error) from None
        stream = _HttpxBody(response)
        try:
            first_chunk = await stream.next_chunk()
        except BaseException:
            await stream.close()
            raise
        return Upstream(response.status_code, dict(response.headers), first_chunk, stream)

    async def aclose(self) -> None:
        """The httpx client belongs to the test."""


class _HttpxBody:
    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._chunks = response.aiter_raw()

    async def next_chunk(self) -> bytes:
        try:
            return await anext(self._chunks, b"")
        except httpx.HTTPError as error:
            raise _as_upstream_error(error, has_answered=True) from None

    async def close(self) -> None:
        await self.response.aclose()


def _as_upstream_error(error: httpx.HTTPError, *, has_answered: bool = False) -> UpstreamError:
    """The pool's error for ``error``: before any answer, a failed connection (refused, or dropped
    without an answer) is ``NotAnsweredError``, as ``UpstreamPool`` raises it."""
    message = f"{type(error).__name__}: {error}"
    if isinstance(error, httpx.TimeoutException) and not isinstance(error, httpx.ConnectTimeout):
        return UpstreamTimeoutError(message)
    if not has_answered and isinstance(
        error, httpx.ConnectError | httpx.ConnectTimeout | httpx.RemoteProtocolError
    ):
        return NotAnsweredError(message)
    return UpstreamError(message)
