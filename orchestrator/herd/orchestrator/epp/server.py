"""``herd epp``'s gRPC server: Envoy's ExternalProcessor and the gRPC health services.

The health services follow the Endpoint Picker protocol: ``liveness`` serves as soon as the process
answers; ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` serve once the worker
discovery has given its first membership (the picker's view of the workers has synced).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from herd.api.errors import HttpError
from herd.orchestrator.auth import ApiKeys
from herd.orchestrator.discovery import Membership, WorkerSource
from herd.orchestrator.epp import wire
from herd.orchestrator.epp.exchange import Exchange
from herd.orchestrator.epp.picker import Picker, PickerSettings
from herd.orchestrator.prepare import Preparer
from herd.orchestrator.proxy import build_http_client
from herd.orchestrator.registry import Registry, RegistrySettings
from herd.orchestrator.state import State
from herd.orchestrator.worker_client import WorkerClient

__all__ = ["EXT_PROC_SERVICE", "Epp", "EppSettings", "build_epp", "serve_epp"]

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass(frozen=True, slots=True)
class EppSettings:
    internal_token: str | None = None
    """The workers' shared internal token (``X-Herd-Token``) for their load and KV events."""
    connect_timeout: float = 2.0
    registry: RegistrySettings = field(default_factory=RegistrySettings)
    picker: PickerSettings = field(default_factory=PickerSettings)
    prepare_threads: int = 2
    grace_seconds: float = 5.0
    """How long a stopping server lets open streams finish."""
    api_keys: ApiKeys | None = None
    """The tenants of the API keys (``--api-keys-file``); ``None``: every request is anonymous."""


class _Processor(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]  # untyped generated code
    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(  # noqa: N802 (the gRPC method's name)
        self,
        request_iterator: AsyncIterator[ProcessingRequest],
        context: grpc.aio.ServicerContext[ProcessingRequest, ProcessingResponse],
    ) -> AsyncIterator[ProcessingResponse]:
        exchange = Exchange(self.picker)
        try:
            async for message in request_iterator:
                try:
                    responses = await exchange.handle(message)
                except Exception as error:  # a defect: this request fails with a 500, the stream ends cleanly
                    log.exception("endpoint picker failed on a message")
                    yield wire.immediate(
                        HttpError(500, f"the endpoint picker failed: {type(error).__name__}")
                    )
                    return
                for response in responses:
                    yield response
        finally:
            exchange.close()


class _Synced:
    """``source``, calling ``on_synced`` once its first membership is applied."""

    def __init__(self, source: WorkerSource, on_synced: Callable[[], Awaitable[None]]) -> None:
        self.source = source
        self.on_synced: Callable[[], Awaitable[None]] | None = on_synced

    async def watch(self) -> AsyncIterator[Membership]:
        async for membership in self.source.watch():
            yield membership  # the registry applies it before asking for the next
            if self.on_synced is not None:
                on_synced, self.on_synced = self.on_synced, None
                await on_synced()


@dataclass(eq=False)
class Epp:
    """A built endpoint picker: start it with ``run`` (until cancelled); ``port`` once bound."""

    server: grpc.aio.Server
    registry: Registry
    preparer: Preparer
    picker: Picker
    health: health.aio.HealthServicer
    http: httpx.AsyncClient | None
    port: int
    grace_seconds: float

    async def run(self, source: WorkerSource, *, on_started: Callable[[], None] | None = None) -> None:
        await self._set(("", "liveness"), health_pb2.HealthCheckResponse.SERVING)
        await self._set(("readiness", EXT_PROC_SERVICE), health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        tasks = [asyncio.create_task(self.registry.run(_Synced(source, self._ready)), name="herd-registry")]
        if on_started is not None:
            on_started()
        try:
            await self.server.wait_for_termination()
        finally:
            await self.server.stop(self.grace_seconds)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self.preparer.close()
            if self.http is not None:
                await self.http.aclose()

    async def _ready(self) -> None:
        await self._set(("readiness", EXT_PROC_SERVICE), health_pb2.HealthCheckResponse.SERVING)
        log.info("endpoint picker ready", extra={"models": sorted(self.registry.models)})

    async def _set(
        self, services: tuple[str, ...], status: health_pb2.HealthCheckResponse.ServingStatus
    ) -> None:
        for service in services:
            await self.health.set(service, status)


def build_epp(
    *,
    host: str,
    port: int,
    state: State,
    settings: EppSettings | None = None,
    http: httpx.AsyncClient | None = None,
) -> Epp:
    """The endpoint picker bound to ``host:port`` (0: a free port); ``http`` replaces the client for
    the workers' health, load and KV events (tests pass a fake), else one is made and closed."""
    settings = settings or EppSettings()
    client = http or build_http_client(connect_timeout=settings.connect_timeout)
    registry = Registry(
        WorkerClient(client, token=settings.internal_token),
        state,
        settings.registry,
        background_priority=settings.picker.slot_reserve.priority,
    )
    preparer = Preparer(registry, state, num_threads=settings.prepare_threads)
    picker = Picker(registry, state, preparer, settings.picker, settings.api_keys)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(_Processor(picker), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    owned = None if http is not None else client
    return Epp(server, registry, preparer, picker, health_servicer, owned, bound, settings.grace_seconds)


async def serve_epp(
    source: WorkerSource, *, host: str, port: int, state: State, settings: EppSettings | None = None
) -> None:
    """Serve until SIGINT or SIGTERM, then let open streams finish for ``grace_seconds``."""
    epp = build_epp(host=host, port=port, state=state, settings=settings)
    loop = asyncio.get_running_loop()
    stopping: set[asyncio.Task[None]] = set()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(
            signum, lambda: stopping.add(loop.create_task(epp.server.stop(epp.grace_seconds)))
        )
    log.info("endpoint picker listening", extra={"address": f"{host}:{epp.port}"})
    await epp.run(source)
