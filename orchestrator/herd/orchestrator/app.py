"""The orchestrator's HTTP app: the OpenAI API, health, metrics, the dashboard and its OpenAPI document.

``build_app`` wires a ``WorkerSource`` into a ``Registry`` (started with the app), a ``State`` and a
``Gateway``. Request handlers stay thin: read the body within its size and time limits and hand it
to the gateway, which validates it. API keys are checked in front of every route but the probes'
(``RequireApiKey``), and every error leaves in the OpenAI envelope (``herd.orchestrator.errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.datastructures import FormData
from starlette.requests import ClientDisconnect
from starlette.types import Message

from herd.api.body import BodyError, check_content_type, json_object, read_limited
from herd.api.errors import HttpError, invalid_request
from herd.api.openai import LoadLoraAdapterRequest, ModelCard, ModelList, UnloadLoraAdapterRequest
from herd.orchestrator.auth import ApiKeys, RequireApiKey, tenant_of
from herd.orchestrator.batch.routes import add_batch_routes
from herd.orchestrator.batch.runner import BatchRunner
from herd.orchestrator.batch.store import BatchStore
from herd.orchestrator.dashboard import DASHBOARD_HTML, dashboard_data
from herd.orchestrator.discovery import WorkerSource
from herd.orchestrator.errors import install_error_handlers
from herd.orchestrator.gateway import Gateway, GatewaySettings
from herd.orchestrator.history_sampler import HistorySampler, HistorySettings
from herd.orchestrator.lora_admin import ADMIN_PATHS, LOAD_LORA_PATH, UNLOAD_LORA_PATH, LoraAdmin
from herd.orchestrator.openapi import build_openapi, route_docs
from herd.orchestrator.proxy import build_http_client
from herd.orchestrator.registry import Registry, RegistrySettings, WorkerState
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
    body_timeout: float = 30.0
    """Longest time a client may take to send a request body (a slow client gets 408)."""
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    registry: RegistrySettings = field(default_factory=RegistrySettings)
    history: HistorySettings = field(default_factory=HistorySettings)
    """The dashboard's history: how often it samples, what each point covers, how far back it keeps."""
    batch_dir: Path | None = None
    """Where the Batch API keeps its files and batches (a volume, so they outlive the process);
    ``None``: no ``/v1/files`` and ``/v1/batches`` routes."""
    batch_concurrency: int = 8
    """Lines of one batch in flight at once (each waits behind interactive requests)."""
    max_batch_file_bytes: int = 200 * 1024 * 1024
    ready_when_synced: bool = False
    """What ``/ready`` waits for. False (a fixed list of workers): every model has a healthy worker.
    True (discovered workers, as on Kubernetes): the discovery's first membership, models or none; a
    model without workers then fails its own requests (503) and takes no other model's traffic with
    it, as it would if one model's outage took the orchestrator out of its Service."""


def build_app(
    source: WorkerSource,
    *,
    settings: AppSettings | None = None,
    state: State | None = None,
    api_keys: ApiKeys | None = None,
    admin_keys: ApiKeys | None = None,
    http: httpx.AsyncClient | None = None,
    upstream: UpstreamClient | None = None,
) -> FastAPI:
    """The orchestrator app. ``upstream`` replaces the proxy's client and ``http`` the one for every
    other call to workers (tests pass fakes); the app closes the clients it creates. ``admin_keys``
    guard the runtime LoRA routes (``lora_admin``); without them those routes refuse."""
    settings = settings or AppSettings()
    api_keys = api_keys or ApiKeys([])
    client = http or build_http_client(connect_timeout=settings.gateway.connect_timeout)
    pool = upstream or UpstreamPool(
        connect_timeout=settings.gateway.connect_timeout,
        read_timeout=settings.gateway.request_timeout,
        token=settings.internal_token,
    )
    state = state or MemoryState()
    telemetry = Telemetry()
    worker_client = WorkerClient(client, token=settings.internal_token)
    registry = Registry(
        worker_client,
        state,
        settings.registry,
        on_restart=_count_restart(telemetry),
        background_priority=settings.gateway.slot_reserve.priority,
    )
    gateway = Gateway(registry, state, client, pool, telemetry, settings.gateway)
    sampler = HistorySampler(registry, telemetry, client, settings.history)

    owned: list[httpx.AsyncClient | UpstreamClient] = []
    if http is None:
        owned.append(client)
    if upstream is None:
        owned.append(pool)
    runner = None
    if settings.batch_dir is not None:
        runner = BatchRunner(
            BatchStore(settings.batch_dir),
            gateway.forward,
            api_keys.tenant_named,
            concurrency=settings.batch_concurrency,
        )
    lifespan = _lifespan(registry, gateway, sampler, source, owned, runner)
    app = FastAPI(
        title="herd orchestrator", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.registry, app.state.gateway, app.state.telemetry = registry, gateway, telemetry
    _add_openai_routes(app, gateway, settings)
    if runner is not None:
        add_batch_routes(
            app,
            runner.store,
            runner,
            max_file_bytes=settings.max_batch_file_bytes,
            read_body=lambda request: _read_body(request, settings),
            read_form=lambda request, max_bytes, max_fields: _read_form(
                request, settings, max_bytes, max_fields
            ),
        )
    _add_lora_admin_routes(app, LoraAdmin(registry, admin_keys or ApiKeys([])), settings)
    _add_ops_routes(
        app,
        registry,
        telemetry,
        sampler,
        is_key_required=api_keys.is_enabled,
        ready_when_synced=settings.ready_when_synced,
    )
    if api_keys.is_enabled:
        app.add_middleware(RequireApiKey, keys=api_keys, exempt=ADMIN_PATHS)
    install_error_handlers(app)  # last: its catch-all wraps everything else
    return app


def _count_restart(telemetry: Telemetry) -> Callable[[WorkerState], None]:
    def count(worker: WorkerState) -> None:
        telemetry.restarts.labels(worker.endpoint.model, worker.endpoint.id).inc()

    return count


def _lifespan(
    registry: Registry,
    gateway: Gateway,
    sampler: HistorySampler,
    source: WorkerSource,
    owned_clients: list[httpx.AsyncClient | UpstreamClient],
    runner: BatchRunner | None,
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Follow the source, sample the dashboard's history and run the batches while the app runs;
    close the clients the app created."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [
            asyncio.create_task(registry.run(source), name="herd-registry"),
            asyncio.create_task(sampler.run(), name="herd-history"),
        ]
        if runner is not None:
            runner.resume()
        try:
            yield
        finally:
            if runner is not None:
                await runner.close()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            gateway.close()
            for owned in owned_clients:
                await owned.aclose()

    return lifespan


def _add_openai_routes(app: FastAPI, gateway: Gateway, settings: AppSettings) -> None:
    async def proxy(request: Request) -> Response:
        body = await _read_body(request, settings)
        # The scope's path, not request.url.path: building the full URL per request costs more.
        return await gateway.forward(request.scope["path"], body, request.headers, tenant_of(request.scope))

    async def models(request: Request) -> Response:
        """Each served model the tenant may use, then its LoRA adapters with the model as their ``parent``."""
        tenant = tenant_of(request.scope)
        cards = []
        for name, served in sorted(gateway.registry.models.items()):
            if not tenant.may_use(name):
                continue
            max_model_len = served.config.max_model_len
            cards.append(ModelCard(id=name, max_model_len=max_model_len))
            cards += [
                ModelCard(
                    id=adapter, parent=name, root=served.lora_paths.get(adapter), max_model_len=max_model_len
                )
                for adapter in sorted(gateway.registry.adapters_of(name))
            ]
        return JSONResponse(ModelList(data=cards).model_dump())

    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        app.add_api_route(path, proxy, methods=["POST"], **route_docs(path))
    app.add_api_route("/v1/models", models, methods=["GET"], **route_docs("/v1/models"))


def _add_lora_admin_routes(app: FastAPI, admin: LoraAdmin, settings: AppSettings) -> None:
    """vLLM's runtime LoRA routes, for operators with an admin key (left out of the OpenAPI document,
    which describes the clients' API)."""

    async def load(request: Request) -> Response:
        admin.check(request.headers.get("authorization"))
        body = _validated(LoadLoraAdapterRequest, await _read_body(request, settings))
        return PlainTextResponse(await admin.load(body))

    async def unload(request: Request) -> Response:
        admin.check(request.headers.get("authorization"))
        body = _validated(UnloadLoraAdapterRequest, await _read_body(request, settings))
        return PlainTextResponse(await admin.unload(body))

    app.add_api_route(LOAD_LORA_PATH, load, methods=["POST"], include_in_schema=False)
    app.add_api_route(UNLOAD_LORA_PATH, unload, methods=["POST"], include_in_schema=False)


_M = TypeVar("_M", bound=BaseModel)


def _validated(model: type[_M], raw: bytes) -> _M:
    try:
        return model.model_validate(json_object(raw))
    except BodyError as error:
        raise HttpError(error.status, str(error)) from None
    except ValidationError as error:
        raise invalid_request(error.errors(include_url=False)) from None


def _add_ops_routes(
    app: FastAPI,
    registry: Registry,
    telemetry: Telemetry,
    sampler: HistorySampler,
    *,
    is_key_required: bool,
    ready_when_synced: bool,
) -> None:
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    async def ready() -> Response:
        waiting = [
            name for name in registry.models if not any(view.is_healthy for view in registry.views(name))
        ]
        if not registry.has_membership:
            return JSONResponse({"status": "waiting", "reason": "discovery has not synced"}, status_code=503)
        if ready_when_synced or (registry.models and not waiting):
            return JSONResponse({"status": "ready", "models_without_workers": waiting})
        return JSONResponse({"status": "waiting", "models_without_workers": waiting}, status_code=503)

    async def metrics() -> Response:
        _update_worker_gauges(registry, telemetry)
        return Response(generate_latest(telemetry.registry), media_type=CONTENT_TYPE_LATEST)

    async def dashboard() -> Response:
        return HTMLResponse(DASHBOARD_HTML)

    async def data(since: float | None = None) -> Response:
        return JSONResponse(dashboard_data(registry, sampler, since=since))

    async def openapi() -> Response:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, requires_key=is_key_required)
        return JSONResponse(app.openapi_schema)

    for path, endpoint in [
        ("/health", health),
        ("/ready", ready),
        ("/metrics", metrics),
        ("/dashboard", dashboard),
        ("/dashboard/data", data),
        ("/openapi.json", openapi),
    ]:
        app.add_api_route(path, endpoint, methods=["GET"], include_in_schema=False)


def _update_worker_gauges(registry: Registry, telemetry: Telemetry) -> None:
    telemetry.circuit.clear()  # workers that left take their series with them
    now = time.monotonic()
    for name in registry.models:
        views = registry.views(name)
        num_healthy = sum(view.is_healthy for view in views)
        telemetry.workers.labels(name, "healthy").set(num_healthy)
        telemetry.workers.labels(name, "unhealthy").set(len(views) - num_healthy)
    for worker in registry.workers.values():
        current = worker.breaker.state(now)
        for state in ("closed", "open", "half_open"):
            telemetry.circuit.labels(worker.endpoint.model, worker.endpoint.id, state).set(state == current)


async def _read_body(request: Request, settings: AppSettings) -> bytes:
    """The raw body of a JSON media type (415), within ``max_body_bytes`` (413) and ``body_timeout``
    (``_receiving``)."""
    declared = request.headers.get("content-length")
    try:
        check_content_type(request.headers.get("content-type"))
        async with _receiving(settings):
            return await read_limited(request.stream(), settings.max_body_bytes, declared_length=declared)
    except BodyError as error:
        raise HttpError(error.status, str(error)) from None


async def _read_form(request: Request, settings: AppSettings, max_bytes: int, max_fields: int) -> FormData:
    """A multipart form of one file and at most ``max_fields`` other fields, within ``max_bytes``
    (413: by its Content-Length before anything is read, else as a chunked body arrives, before it
    all lands in a temporary file) and ``body_timeout`` (``_receiving``). The caller closes it."""
    message = f"the request body (the file and its form) is larger than {max_bytes} bytes; split the file"
    too_large = HttpError(413, message)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    received = 0

    async def receive() -> Message:
        nonlocal received
        message = await request.receive()
        received += len(message.get("body", b""))
        if received > max_bytes:
            raise too_large
        return message

    async with _receiving(settings):
        return await Request(request.scope, receive).form(max_files=1, max_fields=max_fields)


@contextlib.asynccontextmanager
async def _receiving(settings: AppSettings) -> AsyncIterator[None]:
    """Reading a request body: within ``body_timeout`` (408, and the connection closes: the rest of a
    slow body is not worth waiting for), and 400 when the client leaves before it is complete."""
    try:
        async with asyncio.timeout(settings.body_timeout):
            yield
    except TimeoutError:
        message = f"the request body did not arrive within {settings.body_timeout}s; send it faster"
        raise HttpError(408, message, headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise HttpError(400, "the client closed the connection before its body was complete") from None
