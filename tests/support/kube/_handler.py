"""The kmock handler: records every request kmock-style, lets test-defined reactions answer first,
and hands everything else to the emulator's router."""

from __future__ import annotations

import contextlib
import logging

import aiohttp.web
import attrs
import kmock

from ._paths import parse_request
from ._router import Router

__all__ = ["KubeHandler"]

logger = logging.getLogger(__name__)


@attrs.define(kw_only=True)
class KubeHandler(kmock.KubernetesScaffold):
    """``kube.kmock['patch', kmock.resource('pods')] << 500`` injects a fault; unclaimed requests are served."""

    router: Router

    def __attrs_post_init__(self) -> None:
        """Install none of kmock's default reactions: the router serves discovery and objects instead."""

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        try:
            request = await parse_request(raw_request, len(self._requests))
            self._requests.append(request)
            return await self._handle(request)
        except kmock.KubernetesError as error:
            return await self._render_error(error)
        except Exception as error:
            logger.exception("the emulator failed on %s %s", raw_request.method, raw_request.path_qs)
            return await self._render_error(error)

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if not isinstance(exc, kmock.KubernetesError):
            return await super()._render_error(exc)  # a Status with the traceback: an emulator bug
        status = {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "code": exc.status,
            "reason": exc.reason,
            "message": exc.message,
            "details": exc.details or {},
        }
        return aiohttp.web.json_response(status, status=exc.status)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if self._payloads:
            with contextlib.suppress(NotImplementedError):  # no reaction claimed it
                return await super()._handle(request)
        return await self.router.respond(request)
