"""Optional API keys: ``Authorization: Bearer <key>``, from a file (one per line) or ``HERD_API_KEYS``.

``RequireApiKey`` checks them in front of every route but the probes' (``OPEN_PATHS``), so a route
added later is guarded without anyone remembering to; an unknown path answers 401 too, which tells a
client without a key nothing about the routes.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from herd.orchestrator.errors import error_response

__all__ = ["ADMIN_API_KEYS_ENV", "API_KEYS_ENV", "OPEN_PATHS", "ApiKeys", "RequireApiKey", "load_api_keys"]

API_KEYS_ENV = "HERD_API_KEYS"
"""Comma-separated keys, used when no keys file is given."""
ADMIN_API_KEYS_ENV = "HERD_ADMIN_API_KEYS"
"""The same for the admin keys (runtime LoRA adapters)."""
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""What probes and Prometheus read without a key."""
UNAUTHORIZED = "missing or invalid API key: send `Authorization: Bearer <key>` with a key this server accepts"


class ApiKeys:
    """The accepted keys; empty means authentication is off."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = [key.encode() for key in keys if key]

    @property
    def is_enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None) -> bool:
        """Constant-time compare against every key, so timing does not reveal a near miss."""
        if not self._keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        offered = token.strip().encode() if scheme.lower() == "bearer" else b""
        matches = [hmac.compare_digest(offered, key) for key in self._keys]
        return any(matches)


def load_api_keys(path: Path | None = None, env: str = API_KEYS_ENV) -> ApiKeys:
    """Keys from ``path`` (blank lines and ``#`` comments skipped), else from the variable ``env``."""
    if path is not None:
        lines = (line.strip() for line in path.read_text().splitlines())
        return ApiKeys([line for line in lines if line and not line.startswith("#")])
    return ApiKeys([key.strip() for key in os.environ.get(env, "").split(",")])


class RequireApiKey:
    """ASGI middleware: a request outside ``OPEN_PATHS`` without an accepted key gets 401; the
    ``exempt`` paths check keys of their own (the admin routes)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, exempt: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.keys = keys
        self.skipped = OPEN_PATHS | exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.skipped:
            authorization = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not self.keys.allows(authorization.decode("latin-1")):
                response = error_response(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
