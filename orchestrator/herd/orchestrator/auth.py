"""API keys and their tenants: ``Authorization: Bearer <key>``, from a keys file or ``HERD_API_KEYS``.

``RequireApiKey`` checks them in front of every route but the probes' (``OPEN_PATHS``), so a route
added later is guarded without anyone remembering to; an unknown path answers 401 too, which tells a
client without a key nothing about the routes. The key's tenant (``herd.orchestrator.admission``)
goes into the request's scope (``tenant_of``); with authentication off, every request is
``ANONYMOUS``'s.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from herd.orchestrator.admission.tenants import ANONYMOUS, DEFAULT_TENANT, Tenant, parse_tenants
from herd.orchestrator.errors import error_response

__all__ = [
    "ADMIN_API_KEYS_ENV",
    "API_KEYS_ENV",
    "OPEN_PATHS",
    "ApiKeys",
    "RequireApiKey",
    "load_api_keys",
    "tenant_of",
]

API_KEYS_ENV = "HERD_API_KEYS"
"""Comma-separated keys, used when no keys file is given."""
ADMIN_API_KEYS_ENV = "HERD_ADMIN_API_KEYS"
"""The same for the admin keys (runtime LoRA adapters)."""
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""What probes and Prometheus read without a key."""
UNAUTHORIZED = "missing or invalid API key: send `Authorization: Bearer <key>` with a key this server accepts"
_TENANT = "herd.tenant"
"""The scope key ``RequireApiKey`` stores the request's tenant under."""


class ApiKeys:
    """The accepted keys, each with its tenant; empty means authentication is off."""

    def __init__(self, keys: Sequence[str], *, tenant: Tenant = DEFAULT_TENANT) -> None:
        self._keys = [(key.encode(), tenant) for key in keys if key]

    @classmethod
    def of_tenants(cls, pairs: Sequence[tuple[str, Tenant]]) -> ApiKeys:
        keys = cls([])
        keys._keys = [(key.encode(), tenant) for key, tenant in pairs if key]
        return keys

    @property
    def is_enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None) -> Tenant | None:
        """The key's tenant, ``None`` for a refused key. Constant-time compare against every key, so
        timing does not reveal a near miss."""
        if not self._keys:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        offered = token.strip().encode() if scheme.lower() == "bearer" else b""
        found = None
        for key, tenant in self._keys:
            if hmac.compare_digest(offered, key):
                found = tenant
        return found

    def tenant_named(self, name: str) -> Tenant | None:
        """The tenant called ``name`` as the keys define it now, ``None`` when no key has it; with
        authentication off, ``ANONYMOUS`` (what every request is then)."""
        if not self._keys:
            return ANONYMOUS
        return next((tenant for _, tenant in self._keys if tenant.name == name), None)

    def allows(self, authorization: str | None) -> bool:
        return self.tenant(authorization) is not None


def load_api_keys(path: Path | None = None, env: str = API_KEYS_ENV) -> ApiKeys:
    """Keys from ``path`` (a tenants YAML document, or one key per line with blank lines and ``#``
    comments skipped), else from the variable ``env``. ``ValueError`` for an invalid tenants document,
    a file that is not UTF-8, or one that holds no key: a keys file named and found empty (a Secret
    mounted without its data) must not start a gateway that lets every request in."""
    if path is None:
        return ApiKeys([key.strip() for key in os.environ.get(env, "").split(",")])
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: byte {error.start} is not UTF-8; write the keys file as UTF-8") from None
    pairs = parse_tenants(text, source=str(path))
    if pairs is not None:
        return ApiKeys.of_tenants(pairs)
    lines = (line.strip() for line in text.splitlines())
    keys = ApiKeys([line for line in lines if line and not line.startswith("#")])
    if not keys.is_enabled:
        raise ValueError(
            f"{path}: it holds no API key: list one key per line (or a tenants document), or leave the "
            "file out to serve without authentication"
        )
    return keys


def tenant_of(scope: Scope) -> Tenant:
    """The tenant ``RequireApiKey`` found for the request (``ANONYMOUS`` without authentication)."""
    tenant = scope.get("state", {}).get(_TENANT)
    return tenant if isinstance(tenant, Tenant) else ANONYMOUS


class RequireApiKey:
    """ASGI middleware: a request outside ``OPEN_PATHS`` without an accepted key gets 401; an accepted
    one carries its tenant in its scope. The ``exempt`` paths check keys of their own (the admin routes)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, exempt: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.keys = keys
        self.skipped = OPEN_PATHS | exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.skipped:
            authorization = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            tenant = self.keys.tenant(authorization.decode("latin-1"))
            if tenant is None:
                response = error_response(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})[_TENANT] = tenant
        await self.app(scope, receive, send)
