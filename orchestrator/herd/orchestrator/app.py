"""The orchestrator's HTTP app: the OpenAI API, health, metrics and the dashboard.

``build_app`` wires a ``WorkerSource`` into a ``Registry`` (started with the app), a ``State`` and a
``Gateway``. Request handlers stay thin: authenticate, bound and parse the body, hand it to the
gateway; every error leaves in the OpenAI envelope.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from herd.api.body import BodyError, json_object, read_limited
from herd.api.openai import ErrorResponse, ModelCard, ModelList
from herd.orchestrator.auth import ApiKeys
from herd.orchestrator.dashboard import DASHBOARD_HTML, dashboard_data
from herd.orchestrator.discovery import WorkerSource
from herd.orchestrator.gateway import Gateway, GatewayError, GatewaySettings
from herd.orchestrator.proxy import build_http_client
from herd.orchestrator.registry import Registry, RegistrySettings
from herd.orchestrator.state import MemoryState, State
from herd.orchestrator.telemetry import Telemetry
from herd.orchestrator.upstream import UpstreamClient, UpstreamPool
from herd.orchestrator.worker_client import WorkerClient

__all__ = ["AppSettings", "build_app"]


@dataclass(frozen=True, slots=True)
class AppSettings:
    internal_token: str | None = None
    """The workers' shared internal token (``X-Herd-Token``)."""
    max_body_bytes: int = 4 * 1024 * 1024
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    registry: RegistrySettings = field(default_factory=RegistrySettings)


def build_app(
    source: WorkerSource,
    *,
    settings: AppSettings | None = None,
    state: State | None = None,
    api_keys: ApiKeys | None = None,
    http: httpx.AsyncClient | None = None,
    upstream: UpstreamClient | None = None,
) -> FastAPI:
    """The orchestrator app. ``upstream`` replaces the proxy's client and ``http`` the one for every
    other call to workers (tests pass fakes); the app closes the clients it creates."""
    settings = settings or AppSettings()
    client = http or build_http_client(connect_timeout=settings.gateway.connect_timeout)
    pool = upstream or UpstreamPool(
        connect_timeout=settings.gateway.connect_timeout, read_timeout=settings.gateway.request_timeout
    )
    state = state or MemoryState()
    telemetry = Telemetry()
    registry = Registry(WorkerClient(client, token=settings.internal_token), state, settings.registry)
    gateway = Gateway(registry, state, client, pool, telemetry, settings.gateway)

    owned: list[httpx.AsyncClient | UpstreamClient] = []
    if http is None:
        owned.append(client)
    if upstream is None:
        owned.append(pool)
    lifespan = _lifespan(registry, source, owned)
    app = FastAPI(title="herd orchestrator", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.registry, app.state.gateway, app.state.telemetry = registry, gateway, telemetry
    app.exception_handler(GatewayError)(_gateway_error)
    _add_openai_routes(app, gateway, api_keys or ApiKeys([]), settings.max_body_bytes)
    _add_ops_routes(app, registry, telemetry)
    return app


def _lifespan(
    registry: Registry, source: WorkerSource, owned_clients: list[httpx.AsyncClient | UpstreamClient]
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Follow the source while the app runs; close the clients the app created."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(registry.run(source), name="herd-registry")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for owned in owned_clients:
                await owned.aclose()

    return lifespan


def _add_openai_routes(app: FastAPI, gateway: Gateway, api_keys: ApiKeys, max_body_bytes: int) -> None:
    async def proxy(request: Request) -> Response:
        _authenticate(request, api_keys)
        body, payload = await _read_json(request, max_body_bytes)
        # The scope's path, not request.url.path: building the full URL per request costs more.
        return await gateway.forward(request.scope["path"], body, payload, request.headers)

    async def models(request: Request) -> Response:
        _authenticate(request, api_keys)
        cards = [
            ModelCard(id=name, max_model_len=served.config.max_model_len)
            for name, served in sorted(gateway.registry.models.items())
        ]
        return JSONResponse(ModelList(data=cards).model_dump())

    app.add_api_route("/v1/chat/completions", proxy, methods=["POST"])
    app.add_api_route("/v1/completions", proxy, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])


def _add_ops_routes(app: FastAPI, registry: Registry, telemetry: Telemetry) -> None:
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    async def ready() -> Response:
        waiting = [
            name for name in registry.models if not any(view.is_healthy for view in registry.views(name))
        ]
        if registry.models and not waiting:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "waiting", "models_without_workers": waiting}, status_code=503)

    async def metrics() -> Response:
        _update_worker_gauges(registry, telemetry)
        return Response(generate_latest(telemetry.registry), media_type=CONTENT_TYPE_LATEST)

    async def dashboard() -> Response:
        return HTMLResponse(DASHBOARD_HTML)

    async def data() -> Response:
        return JSONResponse(dashboard_data(registry, telemetry))

    for path, endpoint in [
        ("/health", health),
        ("/ready", ready),
        ("/metrics", metrics),
        ("/dashboard", dashboard),
        ("/dashboard/data", data),
    ]:
        app.add_api_route(path, endpoint, methods=["GET"])


def _update_worker_gauges(registry: Registry, telemetry: Telemetry) -> None:
    for name in registry.models:
        views = registry.views(name)
        num_healthy = sum(view.is_healthy for view in views)
        telemetry.workers.labels(name, "healthy").set(num_healthy)
        telemetry.workers.labels(name, "unhealthy").set(len(views) - num_healthy)


def _authenticate(request: Request, api_keys: ApiKeys) -> None:
    if not api_keys.allows(request.headers.get("authorization")):
        message = (
            "missing or invalid API key: send `Authorization: Bearer <key>` with a key this server accepts"
        )
        raise GatewayError(401, message, headers={"WWW-Authenticate": "Bearer"})


async def _read_json(request: Request, max_body_bytes: int) -> tuple[bytes, dict[str, Any]]:
    """The raw body (forwarded as is) and its JSON object; 413 / 400 in the OpenAI envelope."""
    declared = request.headers.get("content-length")
    try:
        body = await read_limited(request.stream(), max_body_bytes, declared_length=declared)
        return body, json_object(body)
    except BodyError as error:
        raise GatewayError(error.status, str(error)) from None


async def _gateway_error(_: Request, error: Exception) -> Response:
    assert isinstance(error, GatewayError)
    envelope = ErrorResponse.of(error.status, error.message).model_dump()
    return JSONResponse(envelope, status_code=error.status, headers=error.headers)
