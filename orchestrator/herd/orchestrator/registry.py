"""The worker registry: membership from a ``WorkerSource``, health, load and KV events per worker.

One polling task per worker runs every ``poll_interval`` seconds: ``/ready`` on the public port
(``failures_to_eject`` failures in a row eject it, one success re-admits it), then the load report,
then KV events after the index's last ``seq`` (every model keeps an index: cache-aware routing scores
with it, and the dashboard and the predicted-hit metric show it for any strategy). A new epoch, a gap or a
re-admission makes the next poll fetch a snapshot. KV payloads go through ``State.publish_kv`` so
that with Redis every replica's index receives them; ``receive_kv`` applies them here. A proxy
error ejects a worker at once (``report_failure``) instead of waiting for the next poll. Beside the
polling, each worker's ``CircuitBreaker`` hears the outcome of every request sent to it (a ``Hold``,
taken when the request is routed there and released with its outcome) and stops routing to a worker
whose requests keep failing even while its ``/ready`` says yes.
A new KV epoch is a restarted worker process: it is counted (``on_restart``) and its breaker closed.
A model that needs token ids but has no local folder gets its tokenizer from its first healthy
worker (``TokenizerFetcher``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType

import httpx

from herd.api.protocol import KVSnapshot, LoadReport
from herd.orchestrator.breaker import BreakerSettings, CircuitBreaker, Outcome
from herd.orchestrator.discovery import Membership, ModelConfig, WorkerEndpoint, WorkerSource
from herd.orchestrator.routing import WorkerView
from herd.orchestrator.served import ServedModel
from herd.orchestrator.state import ExpectedBlocks, KVPayload, State
from herd.orchestrator.tokenizer_fetch import TokenizerFetcher
from herd.orchestrator.worker_client import WorkerClient

__all__ = ["Hold", "Registry", "RegistrySettings", "WorkerState"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RegistrySettings:
    """Polling cadence (the defaults eject an unreachable worker within 2 s) and the circuit breakers."""

    poll_interval: float = 0.25
    failures_to_eject: int = 2
    breaker: BreakerSettings = field(default_factory=BreakerSettings)


@dataclass(eq=False)
class WorkerState:
    endpoint: WorkerEndpoint
    is_healthy: bool = False
    num_failures: int = 0
    num_in_flight: int = 0
    num_prefill_tokens_in_flight: int = 0
    report: LoadReport = field(default_factory=LoadReport)
    needs_snapshot: bool = True
    task: asyncio.Task[None] | None = None
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    epoch: str | None = None
    """The worker process's KV epoch as last seen; a new one means it restarted."""
    num_restarts: int = 0

    def view(self, now: float) -> WorkerView:
        report = self.report
        return WorkerView(
            id=self.endpoint.id,
            url=self.endpoint.url,
            role=self.endpoint.role,
            num_in_flight=self.num_in_flight,
            num_prefill_tokens_in_flight=self.num_prefill_tokens_in_flight,
            num_running=report.num_running,
            num_waiting=report.num_waiting,
            num_waiting_prefill_tokens=report.num_waiting_prefill_tokens,
            num_total_blocks=report.num_total_blocks,
            is_healthy=self.is_healthy and not report.is_draining and self.breaker.can_send(now),
        )


class Registry:
    """Models and workers currently known, with live health and load."""

    def __init__(
        self,
        client: WorkerClient,
        state: State,
        settings: RegistrySettings | None = None,
        *,
        on_restart: Callable[[WorkerState], None] | None = None,
    ) -> None:
        self.client = client
        self.state = state
        self.settings = settings or RegistrySettings()
        self.on_restart = on_restart
        self.models: dict[str, ServedModel] = {}
        self.workers: dict[str, WorkerState] = {}
        self.tokenizers = TokenizerFetcher(client)
        self.has_membership = False
        """The source has given its first membership (a discovery has synced)."""
        self.on_admitted: Callable[[str], None] | None = None
        """Told a model's name when one of its workers is admitted (requests held for it go on)."""

    async def run(self, source: WorkerSource) -> None:
        """Follow the source until cancelled; every worker task stops with it."""
        await self.state.start(self.receive_kv)
        try:
            async for membership in source.watch():
                self.apply_membership(membership)
        finally:
            await self._stop_all()

    def apply_membership(self, membership: Membership) -> None:
        self.has_membership = True
        self._apply_models(membership.models)
        wanted = {endpoint.id: endpoint for endpoint in membership.endpoints if endpoint.model in self.models}
        for worker_id in [worker_id for worker_id in self.workers if worker_id not in wanted]:
            self._remove_worker(worker_id)
        for endpoint in wanted.values():
            current = self.workers.get(endpoint.id)
            if current is None or current.endpoint != endpoint:
                self._remove_worker(endpoint.id)
                self._add_worker(endpoint)

    def model_workers(self, model: str) -> list[WorkerState]:
        return [worker for worker in self.workers.values() if worker.endpoint.model == model]

    def views(self, model: str) -> list[WorkerView]:
        """Views of the workers that answer the model's clients (a disaggregated model's decode pool)."""
        role = "decode" if self.models[model].config.mode == "disaggregated" else "unified"
        return [view for view in self.all_views(model) if view.role == role]

    def all_views(self, model: str) -> list[WorkerView]:
        """Views of every worker of the model, both pools of a disaggregated one (what ``decide`` takes)."""
        now = time.monotonic()
        return [worker.view(now) for worker in self.model_workers(model)]

    def hold(self, worker_id: str, *, num_prefill_tokens: int = 0) -> Hold:
        """Count a request routed to the worker now (in the breaker's half-open state, it is the probe);
        the returned ``Hold`` releases it."""
        if (worker := self.workers.get(worker_id)) is not None:
            worker.num_in_flight += 1
            worker.num_prefill_tokens_in_flight += num_prefill_tokens
            worker.breaker.on_send(time.monotonic())
        return Hold(self, worker_id, num_prefill_tokens)

    def _prefilled(self, worker_id: str, num_prefill_tokens: int) -> None:
        if (worker := self.workers.get(worker_id)) is not None:
            worker.num_prefill_tokens_in_flight = max(
                0, worker.num_prefill_tokens_in_flight - num_prefill_tokens
            )

    def _release(self, worker_id: str, num_prefill_tokens: int, outcome: Outcome) -> None:
        if (worker := self.workers.get(worker_id)) is None:
            return
        worker.num_in_flight = max(0, worker.num_in_flight - 1)
        self._prefilled(worker_id, num_prefill_tokens)
        breaker = worker.breaker
        was_closed = breaker.state(now := time.monotonic()) == "closed"
        breaker.record(outcome, now)
        if was_closed != (breaker.state(now) == "closed"):
            log.warning(
                "worker circuit opened" if was_closed else "worker circuit closed",
                extra={"worker": worker_id, "num_failures": breaker.num_failures},
            )

    def report_failure(self, worker_id: str, reason: str) -> None:
        """Eject a worker the proxy could not reach; the poller re-admits it once it answers."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.is_healthy:
            worker.num_failures = self.settings.failures_to_eject
            self._eject(worker, reason)

    def receive_kv(self, worker_id: str, payload: KVPayload) -> None:
        """Apply a worker's KV batch or snapshot, or the blocks another replica expects on it, to its
        model's index (the ``State`` sink)."""
        worker = self.workers.get(worker_id)
        served = None if worker is None else self.models.get(worker.endpoint.model)
        if worker is None or served is None:
            return
        index = served.kv_index
        if isinstance(payload, ExpectedBlocks):
            index.expect(worker_id, payload.block_hashes)
        elif isinstance(payload, KVSnapshot):
            position = index.position(worker_id)
            if position is None or position[0] != payload.epoch or position[1] < payload.seq:
                index.reset(worker_id, payload)
        elif not index.apply(worker_id, payload):
            worker.needs_snapshot = True

    def _apply_models(self, configs: Iterable[ModelConfig]) -> None:
        wanted = {config.served_name: config for config in configs}
        for name in [name for name in self.models if name not in wanted]:
            del self.models[name]
        for name, config in wanted.items():
            if name not in self.models or self.models[name].config != config:
                self.models[name] = ServedModel(config)
                for worker in self.model_workers(name):
                    worker.needs_snapshot = True

    def _add_worker(self, endpoint: WorkerEndpoint) -> None:
        worker = WorkerState(endpoint, breaker=CircuitBreaker(self.settings.breaker))
        worker.task = asyncio.create_task(self._poll_forever(worker), name=f"herd-poll-{endpoint.id}")
        self.workers[endpoint.id] = worker
        log.info("worker joined", extra={"worker": endpoint.id, "model": endpoint.model, "url": endpoint.url})

    def _remove_worker(self, worker_id: str) -> None:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return
        if worker.task is not None:
            worker.task.cancel()
        served = self.models.get(worker.endpoint.model)
        if served is not None:
            served.kv_index.remove_worker(worker_id)
            served.strategy.forget_worker(worker_id)
            self.tokenizers.forget_source(served, worker_id)
        log.info("worker left", extra={"worker": worker_id, "model": worker.endpoint.model})

    async def _stop_all(self) -> None:
        tasks = [worker.task for worker in self.workers.values() if worker.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.tokenizers.close()
        await self.state.close()

    async def _poll_forever(self, worker: WorkerState) -> None:
        while True:
            await self.poll_once(worker)
            await asyncio.sleep(self.settings.poll_interval)

    async def poll_once(self, worker: WorkerState) -> None:
        """One health, load and KV round for a worker; never raises for a worker's failure."""
        try:
            is_ready = await self.client.is_ready(worker.endpoint)
            if is_ready:
                worker.report = await self.client.load(worker.endpoint)
        except (httpx.HTTPError, ValueError) as error:
            self._record_failure(worker, f"{type(error).__name__}: {error}")
            return
        if not is_ready:
            self._record_failure(worker, "/ready answered not ready")
            return
        self._record_success(worker)
        if (served := self.models.get(worker.endpoint.model)) is not None:
            self.tokenizers.offer(served, worker.endpoint)
        try:
            await self._sync_kv(worker)
        except (httpx.HTTPError, ValueError) as error:
            # A KV feed problem costs routing quality only: keep serving, resync on the next poll.
            worker.needs_snapshot = True
            log.debug("KV sync failed", extra={"worker": worker.endpoint.id, "error": str(error)})

    def _record_success(self, worker: WorkerState) -> None:
        worker.num_failures = 0
        if not worker.is_healthy:
            worker.is_healthy = True
            log.info("worker admitted", extra={"worker": worker.endpoint.id})
            if self.on_admitted is not None:
                self.on_admitted(worker.endpoint.model)
            if (served := self.models.get(worker.endpoint.model)) is not None:
                self.tokenizers.forget_source(served, worker.endpoint.id)  # it may have restarted

    def _record_failure(self, worker: WorkerState, reason: str) -> None:
        worker.num_failures += 1
        if worker.is_healthy and worker.num_failures >= self.settings.failures_to_eject:
            self._eject(worker, reason)

    def _eject(self, worker: WorkerState, reason: str) -> None:
        worker.is_healthy = False
        worker.needs_snapshot = True
        log.warning("worker ejected", extra={"worker": worker.endpoint.id, "reason": reason})

    async def _sync_kv(self, worker: WorkerState) -> None:
        served = self.models.get(worker.endpoint.model)
        if served is None:
            return
        position = served.kv_index.position(worker.endpoint.id)
        if position is not None and not worker.needs_snapshot:
            batch = await self.client.kv_events(worker.endpoint, after=position[1])
            self._note_epoch(worker, batch.epoch)
            if batch.epoch == position[0]:
                if batch.events:
                    await self.state.publish_kv(worker.endpoint.id, batch)
                if not worker.needs_snapshot:
                    return
        worker.needs_snapshot = False
        snapshot = await self.client.kv_snapshot(worker.endpoint)
        self._note_epoch(worker, snapshot.epoch)
        await self.state.publish_kv(worker.endpoint.id, snapshot)

    def _note_epoch(self, worker: WorkerState, epoch: str) -> None:
        """A new epoch is a new worker process (its supervisor or the kubelet restarted it)."""
        if worker.epoch is not None and epoch != worker.epoch:
            worker.num_restarts += 1
            worker.breaker.reset()  # the failures were the old process's
            log.warning("worker restarted", extra={"worker": worker.endpoint.id, "epoch": epoch})
            if self.on_restart is not None:
                self.on_restart(worker)
        worker.epoch = epoch


class Hold:
    """One request's count on one worker, taken by ``Registry.hold`` at the moment of choice.

    ``release`` ends it exactly once (later calls do nothing) and feeds the outcome to the worker's
    breaker; ``prefilled`` drops its prefill tokens earlier, once the worker has computed the prompt. As a context manager it releases with ``"none"`` whatever was not released in the block,
    so no path out of a request, a cancellation included, leaves a worker counted.
    """

    def __init__(self, registry: Registry, worker_id: str, num_prefill_tokens: int) -> None:
        self.worker_id = worker_id
        self._registry: Registry | None = registry
        self._num_prefill_tokens = num_prefill_tokens

    @property
    def is_held(self) -> bool:
        return self._registry is not None

    def prefilled(self) -> None:
        """The worker has computed the prompt (its first token is out): stop counting its prefill."""
        if self._registry is not None and self._num_prefill_tokens:
            self._registry._prefilled(self.worker_id, self._num_prefill_tokens)
            self._num_prefill_tokens = 0

    def release(self, outcome: Outcome) -> None:
        registry, self._registry = self._registry, None
        if registry is not None:
            registry._release(self.worker_id, self._num_prefill_tokens, outcome)

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release("none")
