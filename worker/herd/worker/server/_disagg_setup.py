"""Wiring disaggregation into a worker: the decode side's KV pulls and the prefill-side routes.

Every worker gets both, whatever its role: a unified worker can then serve either phase, and the
orchestrator alone decides who prefills and who decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from fastapi import APIRouter, FastAPI

from herd.worker.engine_protocol import ServingEngine
from herd.worker.kv_transfer import HttpKVTransfer
from herd.worker.server._disagg import DisaggMetrics, PrefillService
from herd.worker.server._metrics import WorkerMetrics
from herd.worker.server._remote_prefill import RemotePrefill

__all__ = ["Disaggregation", "attach_disaggregation"]


@dataclass(frozen=True)
class Disaggregation:
    """What ``attach_disaggregation`` built: the internal router to mount and the client to close."""

    router: APIRouter
    http: httpx.AsyncClient
    prefill: PrefillService
    puller: RemotePrefill

    async def probe(self, internal_url: str) -> None:
        """Time the KV transport once the worker's ports are up (``RemotePrefill.probe``)."""
        await self.puller.probe(internal_url)


def attach_disaggregation(
    public: FastAPI, engine: ServingEngine, token: str, *, http: httpx.AsyncClient | None = None
) -> Disaggregation:
    """Give ``public``'s handlers their KV puller (``RemotePrefill``); the prefill routes are returned to mount.

    ``http`` carries the KV pulls to peers (tests pass one with an in-process transport).
    """
    worker_metrics: WorkerMetrics = public.state.metrics
    metrics = DisaggMetrics(worker_metrics.registry, worker_metrics.model_name)
    http = http or httpx.AsyncClient(limits=httpx.Limits(max_connections=64))
    puller = RemotePrefill(engine=engine, transfer=HttpKVTransfer(http, token), metrics=metrics, token=token)
    public.state.remote_prefill = puller
    prefill = PrefillService(
        engine, metrics, worker_metrics, public.state.prompt_threads, public.state.grammars
    )
    return Disaggregation(prefill.router(), http, prefill, puller)
