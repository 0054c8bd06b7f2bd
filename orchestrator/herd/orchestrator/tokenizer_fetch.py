"""A model's tokenizer fetched from its workers, for an orchestrator without the model folder.

On Kubernetes the model comes from hf://, s3:// or pvc:// and only the worker pods hold it. When a
model that needs token ids has no renderer, the registry offers each healthy worker it polls; the
fetcher asks one of them for its tokenizer files (``INTERNAL_PATHS.tokenizer``) and builds the
renderer off the event loop. One fetch runs at a time per model, and a model gives up after
``max_attempts`` failures (until its config changes, which makes a new ``ServedModel``). Until a
renderer is there the gateway routes the model's requests without tokens.

The worker a renderer came from is remembered: when it leaves or restarts (a new epoch; a restart
fails ``/ready`` while the model loads, so the registry sees it re-admitted) the next healthy
worker is asked again, which picks up a new model revision; the old renderer serves meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref

from herd.api.prompt import PromptRenderer
from herd.api.protocol import INTERNAL_PATHS
from herd.orchestrator.discovery import WorkerEndpoint
from herd.orchestrator.served import ServedModel
from herd.orchestrator.worker_client import WorkerClient

__all__ = ["TokenizerFetcher"]

log = logging.getLogger(__name__)


class TokenizerFetcher:
    """Fetches tokenizers from workers: at most one fetch per model at a time, bounded failures."""

    def __init__(self, client: WorkerClient, *, max_attempts: int = 5) -> None:
        self.client = client
        self.max_attempts = max_attempts
        self._tasks: dict[ServedModel, asyncio.Task[None]] = {}
        self._num_failures: weakref.WeakKeyDictionary[ServedModel, int] = weakref.WeakKeyDictionary()
        self._sources: weakref.WeakKeyDictionary[ServedModel, str] = weakref.WeakKeyDictionary()
        """The worker each model's renderer came from."""

    def offer(self, served: ServedModel, endpoint: WorkerEndpoint) -> None:
        """Fetch from this healthy worker if the model still wants a tokenizer and none is under way."""
        if served in self._sources or served in self._tasks:
            return
        if not served.needs_tokens or served.config.model_path is not None:
            return
        if self._num_failures.get(served, 0) >= self.max_attempts:
            return
        task = asyncio.create_task(self._fetch(served, endpoint), name=f"herd-tokenizer-{served.name}")
        self._tasks[served] = task
        task.add_done_callback(lambda _: self._tasks.pop(served, None))

    def forget_source(self, served: ServedModel, worker_id: str) -> None:
        """The worker left or restarted: if the model's renderer came from it, fetch it anew."""
        if self._sources.get(served) == worker_id:
            del self._sources[served]
            self._num_failures.pop(served, None)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _fetch(self, served: ServedModel, endpoint: WorkerEndpoint) -> None:
        try:
            files = await self.client.tokenizer_files(endpoint)
            renderer = await asyncio.to_thread(PromptRenderer.from_files, files.files)
        except Exception as error:  # any bad answer (HTTP, JSON, tokenizer) costs routing quality only
            self._record_failure(served, endpoint, f"{type(error).__name__}: {error}")
            return
        served.use_renderer(renderer)
        self._sources[served] = endpoint.id
        log.info("tokenizer fetched from worker", extra={"model": served.name, "worker": endpoint.id})

    def _record_failure(self, served: ServedModel, endpoint: WorkerEndpoint, reason: str) -> None:
        num_failures = self._num_failures[served] = self._num_failures.get(served, 0) + 1
        extra = {"model": served.name, "worker": endpoint.id, "reason": reason, "attempt": num_failures}
        if num_failures < self.max_attempts:
            log.warning("tokenizer fetch failed; the next poll retries", extra=extra)
            return
        log.error(
            "tokenizer fetch failed too often: the model is routed without tokens (least in-flight) "
            f"until its config changes; check that its workers answer GET {INTERNAL_PATHS.tokenizer} "
            "with the orchestrator's internal token, or give the orchestrator the model folder",
            extra=extra,
        )
