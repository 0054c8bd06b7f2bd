"""Holding requests for a model that has no ready worker while one starts (scale from zero).

A model that scales to zero (``ModelConfig.cold_start_timeout_s`` above 0) answers its first request
after idling by starting a worker, which takes seconds to minutes. Its requests wait here instead of
getting a 503: each edge (herd's gateway, the endpoint picker) calls ``ColdStarts.wait`` before it
decides, and the count of waiting requests per model is the demand signal
(``herd_router_requests_held``) that the operator's autoscaler and ``herd up`` read to start workers.
When the registry admits a worker of the model (its ``/ready`` answered), ``wake`` lets every waiting
request go on to the decision at once. The line is bounded: ``max_held`` requests per model, each for
at most the model's ``cold_start_timeout_s``; past either, a 503 with ``Retry-After`` says the model is
starting. Models that do not scale to zero never wait: with no worker they are refused at once, as before.

This is not the admission queue for workers that are full: a request waits here only while its model
has no ready worker at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from herd.api.errors import HttpError
from herd.orchestrator.registry import Registry
from herd.orchestrator.served import ServedModel

__all__ = ["ColdStartSettings", "ColdStarts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ColdStartSettings:
    max_held: int = 256
    """Requests that may wait per model (per gateway replica); the next one gets a 503 at once."""
    retry_after_seconds: int = 10
    """``Retry-After`` of a 503 from a full line or a wait that ran out: a worker is still starting."""


class ColdStarts:
    """The requests each edge holds for models without a ready worker; ``on_held(model, count)`` hears
    every change of a model's count (the gateway's gauge)."""

    def __init__(
        self,
        registry: Registry,
        settings: ColdStartSettings | None = None,
        *,
        on_held: Callable[[str, int], None] | None = None,
    ) -> None:
        self.registry = registry
        self.settings = settings or ColdStartSettings()
        self.on_held = on_held
        self._waiting: dict[str, set[asyncio.Event]] = {}

    def num_held(self, model: str) -> int:
        return len(self._waiting.get(model, ()))

    async def wait(self, served: ServedModel) -> None:
        """Return once ``served`` has a ready worker to route to (at once if it has one, or if it does
        not scale to zero); raise the 503 when its line is full or its wait ran out."""
        timeout = served.config.cold_start_timeout_s
        if timeout <= 0 or self._has_worker(served.name):
            return
        waiting = self._waiting.setdefault(served.name, set())
        if len(waiting) >= self.settings.max_held:
            raise self._starting(served.name, f"{len(waiting)} requests already wait for it")
        event = asyncio.Event()
        waiting.add(event)
        if len(waiting) == 1:
            log.info("model has no ready worker: holding its requests", extra={"model": served.name})
        self._changed(served.name)
        try:
            await self._until_ready(served.name, event, time.monotonic() + timeout)
        finally:
            waiting.discard(event)
            self._changed(served.name)

    def wake(self, model: str) -> None:
        """A worker of ``model`` was admitted: every request waiting for it checks again."""
        for event in self._waiting.get(model, ()):
            event.set()

    async def _until_ready(self, model: str, event: asyncio.Event, deadline: float) -> None:
        # A worker of another pool (a disaggregated model's prefill worker) wakes the line too: check again.
        while not self._has_worker(model):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._starting(model, "no worker became ready in time")
            event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)

    def _has_worker(self, model: str) -> bool:
        return model in self.registry.models and any(view.is_healthy for view in self.registry.views(model))

    def _changed(self, model: str) -> None:
        if self.on_held is not None:
            self.on_held(model, self.num_held(model))

    def _starting(self, model: str, why: str) -> HttpError:
        retry_after = str(self.settings.retry_after_seconds)
        message = f"model {model!r} is starting (it scaled to zero) and {why}; retry after {retry_after}s"
        return HttpError(503, message, headers={"Retry-After": retry_after})
