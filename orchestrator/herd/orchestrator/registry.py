"""The worker registry: membership from a ``WorkerSource``, health, load and KV events per worker.

One task per worker holds the worker's status stream open (``INTERNAL_PATHS.status``, see
``herd.api.protocol.WorkerStatus``): readiness, the load report and KV events arrive together, as
they change and at least every ``heartbeat`` seconds, instead of three polls per worker per period.
That is what lets one orchestrator follow hundreds of workers: it reads lines when they come, so a
worker (or its own event loop) that is slow to answer is late, not failed.

Health: a line that says ready admits the worker at once (re-admission included); one that says not
ready takes it out of routing at once. A failure is a stream that could not open, broke, or stayed
silent for ``silence_timeout`` seconds; ``failures_to_eject`` of them in a row eject a worker. A
dead worker's connection breaks at once and its reconnect is refused, so it is ejected within a
fraction of a second. A silence (several heartbeats: a stalled worker or a partition, not a slow
one), or a connection not accepted within ``connect_timeout``, ejects at once, but only up to
``max_silent_share`` of the model's workers at a time; a timeout is never shorter than that, so a worker, or an orchestrator loop, that is merely busy for a second is
late rather than failed. Retries back off from ``poll_interval`` to
``max_retry_delay``. A proxy error ejects a worker at once too
(``report_failure``).

KV: the stream resumes after the index's last ``seq`` of the worker's epoch (the worker sends a
snapshot when it cannot: a new epoch, no position); a gap in the events reopens it for a snapshot.
KV payloads go through ``State.publish_kv`` so that with Redis every replica's index receives them;
``receive_kv`` applies them here. Beside the stream, each worker's ``CircuitBreaker`` hears the
outcome of every request sent to it (a ``Hold``, taken when the request is routed there and released
with its outcome) and stops routing to a worker whose requests keep failing even while it says ready.
A new KV epoch is a restarted worker process: it is counted (``on_restart``) and its breaker closed.
A model that needs token ids but has no local folder gets its tokenizer from its first healthy
worker (``TokenizerFetcher``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType

import httpx

from herd.api.errors import HttpError
from herd.api.protocol import KVEventBatch, KVSnapshot, LoadReport, StatusQuery, WorkerStatus
from herd.orchestrator.breaker import BreakerSettings, CircuitBreaker, Outcome
from herd.orchestrator.discovery import Membership, ModelConfig, WorkerEndpoint, WorkerSource
from herd.orchestrator.routing import WorkerView, pull_block_tokens, restore_block_tokens
from herd.orchestrator.routing.reserve import BACKGROUND_PRIORITY
from herd.orchestrator.served import ServedModel
from herd.orchestrator.state import IN_FLIGHT_TTL_S, ExpectedBlocks, InFlightCounts, KVPayload, State
from herd.orchestrator.tokenizer_fetch import TokenizerFetcher
from herd.orchestrator.worker_client import WorkerClient

__all__ = ["Hold", "Registry", "RegistrySettings", "WorkerState"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RegistrySettings:
    """How the registry follows its workers (the defaults eject a dead worker within a second and a
    silent one within ``silence_timeout``), and the circuit breakers."""

    poll_interval: float = 0.25
    """Least seconds between a worker's status lines (its load and KV events go out at most this
    often), and the first retry delay after a failure."""
    heartbeat: float = 1.0
    """Most seconds between a worker's status lines when nothing changes."""
    silence_timeout: float = 3.0
    """Seconds without a line after which a stream counts as failed."""
    connect_timeout: float = 2.0
    failures_to_eject: int = 2
    max_silent_share: float = 0.1
    """At most this share of a model's workers (at least one) is ejected for silence at a time, as
    Envoy caps outlier ejection: a silence that hits many workers at once is more likely this
    orchestrator's own stall, or the host's, than theirs. Beyond it a silence only reopens the stream;
    a worker that is really gone still fails its connection or its requests, which eject it."""
    max_retry_delay: float = 1.0
    """Retries after failures in a row back off, doubling from ``poll_interval`` up to this."""
    breaker: BreakerSettings = field(default_factory=BreakerSettings)

    def retry_delay(self, num_failures: int) -> float:
        """Seconds before reopening a stream after ``num_failures`` failures in a row."""
        doubled = self.poll_interval * float(2 ** min(max(num_failures - 1, 0), 16))
        return min(doubled, max(self.max_retry_delay, self.poll_interval))


_ADAPTER_REFUSALS = frozenset({400, 404, 409, 422})
"""A worker's answers to a LoRA change that are about the adapter (a bad folder, a name taken or
unknown); any other is the worker's or the gateway's fault, a 502."""
_VIEWED_FIELDS = frozenset(
    {
        "is_healthy",
        "num_in_flight",
        "num_prefill_tokens_in_flight",
        "num_background",
        "report",
        "host_block_tokens",
        "disk_block_tokens",
        "pull_block_tokens",
    }
)
"""The fields of ``WorkerState`` a ``WorkerView`` shows; its endpoint never changes (a moved worker is
a new one) and its breaker is watched apart (``Registry._breaker_changed``)."""


@dataclass(eq=False)
class WorkerState:
    endpoint: WorkerEndpoint
    is_healthy: bool = False
    num_failures: int = 0
    num_in_flight: int = 0
    num_prefill_tokens_in_flight: int = 0
    in_flight_by_priority: Mapping[int, int] = field(default_factory=dict)
    """Requests in flight by priority: replaced on every change, never edited (its counts feed the
    model's serving count and ``num_background``)."""
    num_background: int = 0
    """Those of them at the registry's background priority or a larger number."""
    report: LoadReport = field(default_factory=LoadReport)
    needs_snapshot: bool = True
    task: asyncio.Task[None] | None = None
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    epoch: str | None = None
    """The worker process's KV epoch as last seen; a new one means it restarted."""
    is_silent: bool = False
    """Ejected for a silent stream and not heard from since."""
    num_restarts: int = 0
    host_block_tokens: float | None = None
    disk_block_tokens: float | None = None
    pull_block_tokens: float | None = None
    _viewed: tuple[LoadReport, WorkerView] | None = field(default=None, init=False, repr=False)
    """The last view and the report it was built from (``view``)."""
    changed: set[str] | None = field(default=None, repr=False)
    """Its model's set of workers whose view may have changed (``_ModelViews.changed``): setting a
    field a view shows adds this worker's id to it."""

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name in _VIEWED_FIELDS and (changed := self.__dict__.get("changed")) is not None:
            changed.add(self.endpoint.id)

    def take_report(self, report: LoadReport) -> None:
        """A new load report, with the tier restore and peer pull costs routing reads from it (worked out once here,
        not for every decision)."""
        self.report = report
        self.host_block_tokens = restore_block_tokens(report, "host")
        self.disk_block_tokens = restore_block_tokens(report, "disk")
        self.pull_block_tokens = pull_block_tokens(report)

    def view(self, now: float, num_elsewhere: int = 0) -> WorkerView:
        """``num_elsewhere``: the requests other orchestrator replicas have in flight to it.

        The registry asks only for the views of workers marked changed (``_ModelViews``), and a
        mark may be spurious (a count set to what it was), so the last view is given again while
        nothing it shows has changed: the same report object (``take_report`` assigns a new one;
        nothing edits one in place), the same counts and the same health."""
        report = self.report
        num_in_flight = self.num_in_flight + num_elsewhere
        is_healthy = self.is_healthy and not report.is_draining and self.breaker.can_send(now)
        if (
            (viewed := self._viewed) is not None
            and viewed[0] is report
            and (last := viewed[1]).num_in_flight == num_in_flight
            and last.is_healthy == is_healthy
            and last.num_background == self.num_background
            and last.num_prefill_tokens_in_flight == self.num_prefill_tokens_in_flight
        ):
            return last
        view = WorkerView(
            id=self.endpoint.id,
            url=self.endpoint.url,
            role=self.endpoint.role,
            num_in_flight=num_in_flight,
            num_prefill_tokens_in_flight=self.num_prefill_tokens_in_flight,
            num_background=self.num_background,
            num_running=report.num_running,
            num_waiting=report.num_waiting,
            num_waiting_prefill_tokens=report.num_waiting_prefill_tokens,
            num_total_blocks=report.num_total_blocks,
            max_batch_tokens=report.max_batch_tokens,
            is_healthy=is_healthy,
            host_block_tokens=self.host_block_tokens,
            disk_block_tokens=self.disk_block_tokens,
            pull_block_tokens=self.pull_block_tokens,
            prefill_tokens_per_s=report.prefill_tokens_per_s,
            decode_step_s=report.decode_step_s,
            max_loras=report.max_loras,
            lora_adapters=frozenset(report.lora_adapters),
            running_lora_adapters=frozenset(report.running_lora_adapters),
        )
        self._viewed = (report, view)
        return view


def _message_of(answer: httpx.Response) -> str:
    """The message of a worker's error answer (the OpenAI envelope's, else its text)."""
    try:
        return str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return answer.text[:300] or f"status {answer.status_code}"


class _ModelViews:
    """One model's workers in the order they joined, and their views, kept between decisions: a
    view is taken again only for a worker marked changed (a field it shows was set, its breaker
    changed, another replica's count of it changed) or whose breaker is not closed (its cooldown
    runs out with time). At 1,000 workers that turns the views from a pass over every worker into
    a few lookups; ``WorkerState.view`` still gives the same view again when nothing it shows
    differs."""

    def __init__(self) -> None:
        self.workers: list[WorkerState] = []
        self.changed: set[str] = set()
        self.unsettled: set[str] = set()
        """Workers whose breaker is not closed."""
        self._views: list[WorkerView] = []
        self._position: dict[str, int] = {}
        self._is_whole = False

    def add(self, worker: WorkerState) -> None:
        worker.changed = self.changed
        self.workers.append(worker)
        self.forget()

    def remove(self, worker: WorkerState) -> None:
        self.workers.remove(worker)
        self.unsettled.discard(worker.endpoint.id)
        self.forget()

    def forget(self) -> None:
        """Take every view again at the next ``views``."""
        self._is_whole = False

    def views(self, now: float, elsewhere: Mapping[str, int]) -> list[WorkerView]:
        if not self._is_whole:
            self._views = [worker.view(now, elsewhere.get(worker.endpoint.id, 0)) for worker in self.workers]
            self._position = {worker.endpoint.id: i for i, worker in enumerate(self.workers)}
            self._is_whole = True
        else:
            for worker_id in self.changed.union(self.unsettled) if self.unsettled else self.changed:
                if (i := self._position.get(worker_id)) is not None:
                    self._views[i] = self.workers[i].view(now, elsewhere.get(worker_id, 0))
        self.changed.clear()
        return list(self._views)


class Registry:
    """Models and workers currently known, with live health and load."""

    def __init__(
        self,
        client: WorkerClient,
        state: State,
        settings: RegistrySettings | None = None,
        *,
        on_restart: Callable[[WorkerState], None] | None = None,
        background_priority: int = BACKGROUND_PRIORITY,
    ) -> None:
        """``background_priority``: the slot reserve's (``SlotReserve.priority``); a worker's view
        counts its requests in flight at that priority or a larger number (``num_background``)."""
        self.client = client
        self.state = state
        self.settings = settings or RegistrySettings()
        self.on_restart = on_restart
        self.background_priority = background_priority
        self.models: dict[str, ServedModel] = {}
        self.workers: dict[str, WorkerState] = {}
        self._by_model: dict[str, _ModelViews] = {}
        """``workers`` by model, in the order they joined, with their views."""
        self.tokenizers = TokenizerFetcher(client)
        self.has_membership = False
        """The source has given its first membership (a discovery has synced)."""
        self.on_room: Callable[[str], None] | None = None
        """Told a model's name when one of its workers may have room: a request on it ended, or a
        worker was admitted (the gateway's admission queue wakes its next request)."""
        self._own_in_flight: dict[str, int] = {}
        """This replica's requests in flight per worker, shared with the other replicas (``State``)."""
        self._elsewhere = _SharedCounts()
        """The other replicas' requests in flight per worker, as they last shared them."""
        self._serving_in_flight: dict[str, Mapping[int, int]] = {}
        """Per model, this replica's requests in flight to its serving workers, by priority."""
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
        """The model's workers in the order they joined (kept per model: every decision asks)."""
        return list(by_model.workers) if (by_model := self._by_model.get(model)) is not None else []

    def views(self, model: str) -> list[WorkerView]:
        """Views of the workers that answer the model's clients (a disaggregated model's decode pool)."""
        role = "decode" if self.models[model].config.mode == "disaggregated" else "unified"
        return [view for view in self.all_views(model) if view.role == role]

    def adapters_of(self, model: str) -> set[str]:
        """The LoRA adapters of ``model``: its manifest's, those loaded through the gateway, and
        those its workers report loaded."""
        served = self.models[model]
        names = {*served.config.adapters, *served.lora_paths}
        for worker in self.model_workers(model):
            names.update(worker.report.lora_adapters)
        return names

    def resolve(self, name: str) -> tuple[ServedModel, str | None] | None:
        """The served model a request's ``model`` names, and the LoRA adapter when it names one."""
        if (served := self.models.get(name)) is not None:
            return served, None
        for model, served in self.models.items():
            if name in self.adapters_of(model):
                return served, name
        return None

    async def change_lora(self, worker_id: str, action: str, body: dict[str, str]) -> None:
        """Load or unload (``action``) a LoRA adapter on a worker; ``HttpError`` with the worker's
        status and message when it refuses, 502 when it cannot be reached. A load shows in the
        worker's view at once, before its next load report."""
        worker = self.workers.get(worker_id)
        if worker is None:
            raise HttpError(503, f"worker {worker_id} left before its LoRA adapter could change; retry")
        try:
            answer = await self.client.change_lora(worker.endpoint, action, body)
        except httpx.HTTPError as error:
            raise HttpError(502, f"worker {worker_id} could not {action} LoRA adapter: {error}") from None
        if answer.status_code != httpx.codes.OK:
            if answer.status_code in _ADAPTER_REFUSALS:  # the adapter's fault: the admin's to fix
                raise HttpError(
                    answer.status_code, f"worker {worker_id}: {_message_of(answer)}", param="lora_name"
                )
            raise HttpError(
                502,
                f"worker {worker_id} answered the LoRA {action} with {answer.status_code}: "
                f"{_message_of(answer)} (a 401 or 403 means the gateway's --internal-token is not the workers')",
            )
        loaded, name = worker.report.lora_adapters, body["lora_name"]
        if action == "load" and name not in loaded:
            loaded = [*loaded, name]
        elif action == "unload" and name in loaded:
            loaded = [adapter for adapter in loaded if adapter != name]
        worker.take_report(worker.report.model_copy(update={"lora_adapters": loaded}))

    def forget_views(self) -> None:
        """Drop every worker's kept view: the next decision builds each afresh, as every decision did
        before views were kept (``bench/gateway_decision.py`` times both)."""
        for worker in self.workers.values():
            worker._viewed = None
        for by_model in self._by_model.values():
            by_model.forget()

    def all_views(self, model: str) -> list[WorkerView]:
        """Views of every worker of the model, both pools of a disaggregated one (what ``decide`` takes),
        counting in flight the requests this replica sent and those the other replicas shared."""
        now = time.monotonic()
        elsewhere = self._elsewhere.totals(now)
        for worker_id in self._elsewhere.drain_changed():
            if (worker := self.workers.get(worker_id)) is not None and worker.changed is not None:
                worker.changed.add(worker_id)
        by_model = self._by_model.get(model)
        return [] if by_model is None else by_model.views(now, elsewhere)

    def hold(self, worker_id: str, *, num_prefill_tokens: int = 0, priority: int = 0) -> Hold:
        """Count a request of ``priority`` routed to the worker now (in the breaker's half-open state,
        it is the probe); the returned ``Hold`` releases it."""
        if (worker := self.workers.get(worker_id)) is not None:
            worker.num_in_flight += 1
            self._count(worker, priority, 1)
            worker.num_prefill_tokens_in_flight += num_prefill_tokens
            if not worker.breaker.is_closed:
                worker.breaker.on_send(time.monotonic())  # a half-open breaker's probe
                self._breaker_changed(worker)
            self._share_in_flight(worker)
        return Hold(self, worker_id, num_prefill_tokens, priority)

    def in_flight_by_priority(self, model: str) -> Mapping[int, int]:
        """This replica's requests in flight to ``model``'s serving workers, by priority (its prefill
        pool left out: a disaggregated request counts once, on its decode worker), kept as requests
        are held and released, so reading it costs nothing at any fleet size."""
        return self._serving_in_flight.get(model, {})

    def _count(self, worker: WorkerState, priority: int, delta: int) -> None:
        """``delta`` requests of ``priority`` on ``worker``, and on its model's serving count."""
        worker.in_flight_by_priority = _counted(worker.in_flight_by_priority, priority, delta)
        if priority >= self.background_priority:
            worker.num_background += delta
        if worker.endpoint.role != "prefill":
            model = worker.endpoint.model
            self._serving_in_flight[model] = _counted(self.in_flight_by_priority(model), priority, delta)

    def _share_in_flight(self, worker: WorkerState) -> None:
        self._own_in_flight[worker.endpoint.id] = worker.num_in_flight
        self.state.share_in_flight(self._own_in_flight)

    def _prefilled(self, worker_id: str, num_prefill_tokens: int) -> None:
        if (worker := self.workers.get(worker_id)) is not None:
            worker.num_prefill_tokens_in_flight = max(
                0, worker.num_prefill_tokens_in_flight - num_prefill_tokens
            )

    def _release(self, worker_id: str, num_prefill_tokens: int, priority: int, outcome: Outcome) -> None:
        if (worker := self.workers.get(worker_id)) is None:
            return
        worker.num_in_flight = max(0, worker.num_in_flight - 1)
        if worker.in_flight_by_priority.get(priority, 0):  # not a request held on a worker it replaced
            self._count(worker, priority, -1)
        self._share_in_flight(worker)
        self._prefilled(worker_id, num_prefill_tokens)
        self._room(worker)
        breaker = worker.breaker
        was_closed = breaker.state(now := time.monotonic()) == "closed"
        breaker.record(outcome, now)
        if not (was_closed and breaker.is_closed):
            self._breaker_changed(worker)
        if was_closed != (breaker.state(now) == "closed"):
            log.warning(
                "worker circuit opened" if was_closed else "worker circuit closed",
                extra={"worker": worker_id, "num_failures": breaker.num_failures},
            )

    def _breaker_changed(self, worker: WorkerState) -> None:
        """The worker's breaker may have changed: view it again, and on every decision while it is
        not closed (its cooldown ends with time, not with an event)."""
        if (by_model := self._by_model.get(worker.endpoint.model)) is None:
            return
        by_model.changed.add(worker.endpoint.id)
        if worker.breaker.is_closed:
            by_model.unsettled.discard(worker.endpoint.id)
        else:
            by_model.unsettled.add(worker.endpoint.id)

    def _room(self, worker: WorkerState) -> None:
        if self.on_room is not None:
            self.on_room(worker.endpoint.model)

    def report_failure(self, worker_id: str, reason: str) -> None:
        """Eject a worker the proxy could not reach; the poller re-admits it once it answers."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.is_healthy:
            worker.num_failures = self.settings.failures_to_eject
            self._eject(worker, reason)

    def receive_kv(self, worker_id: str, payload: KVPayload) -> None:
        """Apply a worker's KV batch or snapshot, or the blocks another replica expects on it, to its
        model's index; keep another replica's in-flight counts (the ``State`` sink)."""
        if isinstance(payload, InFlightCounts):
            self._elsewhere.update(payload, time.monotonic())
            return
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
        worker.task = asyncio.create_task(self._follow(worker), name=f"herd-status-{endpoint.id}")
        self.workers[endpoint.id] = worker
        self._by_model.setdefault(endpoint.model, _ModelViews()).add(worker)
        log.info("worker joined", extra={"worker": endpoint.id, "model": endpoint.model, "url": endpoint.url})

    def _remove_worker(self, worker_id: str) -> None:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return
        self._by_model[worker.endpoint.model].remove(worker)
        worker.changed = None
        self._own_in_flight.pop(worker_id, None)
        for priority, num in worker.in_flight_by_priority.items():
            self._count(worker, priority, -num)
        if worker.task is not None:
            worker.task.cancel()
        served = self.models.get(worker.endpoint.model)
        if served is not None:
            served.kv_index.remove_worker(worker_id)
            served.strategy.forget_worker(worker_id)
            served.latency.forget_worker(worker_id)
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

    async def _follow(self, worker: WorkerState) -> None:
        """Hold the worker's status stream open until the worker leaves; reopen it after a failure."""
        while True:
            try:
                await self._read_status(worker)
            except httpx.TimeoutException as error:
                self._record_silence(worker, f"{type(error).__name__}: {error}")
            except (httpx.HTTPError, ValueError) as error:
                self._record_failure(worker, f"{type(error).__name__}: {error}")
            except Exception as error:  # a line this registry cannot apply: the follow goes on
                log.exception("worker status line not applied", extra={"worker": worker.endpoint.id})
                self._record_failure(worker, f"{type(error).__name__}: {error}")
            else:
                if worker.needs_snapshot:
                    continue  # a gap in the events: reopen at once for a snapshot
                self._record_failure(worker, "the worker ended its status stream (draining or stopping)")
            await asyncio.sleep(self.settings.retry_delay(worker.num_failures))

    async def _read_status(self, worker: WorkerState) -> None:
        """Apply the stream's lines until it ends, or until the KV index needs a snapshot."""
        settings = self.settings
        served = self.models.get(worker.endpoint.model)
        position = None if served is None else served.kv_index.position(worker.endpoint.id)
        if worker.needs_snapshot:
            position = None
        worker.needs_snapshot = False
        query = StatusQuery(
            epoch=None if position is None else position[0],
            after=-1 if position is None else position[1],
            interval=settings.poll_interval,
            heartbeat=settings.heartbeat,
        )
        async with self.client.status(
            worker.endpoint,
            query,
            silence_timeout=settings.silence_timeout,
            connect_timeout=settings.connect_timeout,
        ) as lines:
            async for status in lines:
                await self._apply_status(worker, status)
                if worker.needs_snapshot:
                    return

    async def _apply_status(self, worker: WorkerState, status: WorkerStatus) -> None:
        worker.take_report(status.load)
        if status.is_ready:
            self._record_success(worker)
        else:
            self._mark_not_ready(worker)
        self._note_epoch(worker, status.epoch)
        if status.snapshot is not None:
            await self.state.publish_kv(worker.endpoint.id, status.snapshot)
        if status.events:
            await self.state.publish_kv(
                worker.endpoint.id, KVEventBatch(epoch=status.epoch, events=status.events)
            )

    def _record_silence(self, worker: WorkerState, reason: str) -> None:
        """Silence past several heartbeats on an open connection, or a connection not accepted within
        ``connect_timeout``, is a stalled worker (a hung process or host, a partition), not a slow one:
        out at once rather than after more silence, within the cap. A dead process refuses or resets
        the connection instead, which counts as a plain failure."""
        model = worker.endpoint.model
        workers = self.model_workers(model)
        cap = max(1, int(self.settings.max_silent_share * len(workers)))
        if worker.is_silent or sum(other.is_silent for other in workers) >= cap:
            return
        if worker.is_healthy:
            worker.is_silent = True
        self._record_failure(worker, reason, is_conclusive=True)

    def _record_success(self, worker: WorkerState) -> None:
        worker.num_failures = 0
        worker.is_silent = False
        if not worker.is_healthy:
            worker.is_healthy = True
            log.info("worker admitted", extra={"worker": worker.endpoint.id})
            self._room(worker)
            if self.on_admitted is not None:
                self.on_admitted(worker.endpoint.model)
            if (served := self.models.get(worker.endpoint.model)) is not None:
                self.tokenizers.forget_source(served, worker.endpoint.id)  # it may have restarted
        if (served := self.models.get(worker.endpoint.model)) is not None:
            self.tokenizers.offer(served, worker.endpoint)

    def _mark_not_ready(self, worker: WorkerState) -> None:
        """The worker says it takes no requests (loading, draining): out of routing at once."""
        worker.num_failures = 0
        if worker.is_healthy:
            worker.is_healthy = False
            log.warning("worker not ready", extra={"worker": worker.endpoint.id})

    def _record_failure(self, worker: WorkerState, reason: str, *, is_conclusive: bool = False) -> None:
        worker.num_failures = max(worker.num_failures + 1, self.settings.failures_to_eject * is_conclusive)
        if worker.is_healthy and worker.num_failures >= self.settings.failures_to_eject:
            self._eject(worker, reason)

    def _eject(self, worker: WorkerState, reason: str) -> None:
        worker.is_healthy = False
        log.warning("worker ejected", extra={"worker": worker.endpoint.id, "reason": reason})

    def _note_epoch(self, worker: WorkerState, epoch: str) -> None:
        """A new epoch is a new worker process (its supervisor or the kubelet restarted it)."""
        if worker.epoch is not None and epoch != worker.epoch:
            worker.num_restarts += 1
            worker.breaker.reset()  # the failures were the old process's
            self._breaker_changed(worker)
            log.warning("worker restarted", extra={"worker": worker.endpoint.id, "epoch": epoch})
            if self.on_restart is not None:
                self.on_restart(worker)
        worker.epoch = epoch


def _counted(counts: Mapping[int, int], priority: int, delta: int) -> dict[int, int]:
    """A copy of ``counts`` with ``delta`` added at ``priority`` (a count that reaches 0 is dropped):
    counts are replaced, never edited, so that views may share them."""
    updated = {p: n for p, n in counts.items() if p != priority}
    if (count := counts.get(priority, 0) + delta) > 0:
        updated[priority] = count
    return updated


class _SharedCounts:
    """The other replicas' in-flight counts: each replica's latest, summed per worker; a replica not
    heard from for ``IN_FLIGHT_TTL_S`` is dropped (it stopped, or lost Redis)."""

    def __init__(self) -> None:
        self._by_origin: dict[str, tuple[float, dict[str, int]]] = {}
        self._totals: dict[str, int] = {}
        self._changed: set[str] = set()

    def update(self, counts: InFlightCounts, now: float) -> None:
        """Replace the replica's counts; a worker is marked changed only when its total moved, since
        a replica republishes every count it has, most of them unchanged."""
        previous = self._by_origin.get(counts.origin, (now, {}))[1]
        self._by_origin[counts.origin] = (now, counts.counts)
        for worker_id in previous.keys() | counts.counts.keys():
            self._add(worker_id, counts.counts.get(worker_id, 0) - previous.get(worker_id, 0))

    def drain_changed(self) -> set[str]:
        """The workers whose total changed since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    def totals(self, now: float) -> dict[str, int]:
        """Per worker; an empty dict (nothing to add) with one replica."""
        for origin in [origin for origin, (at, _) in self._by_origin.items() if now - at > IN_FLIGHT_TTL_S]:
            self._drop(origin)
        return self._totals

    def _drop(self, origin: str) -> None:
        if (entry := self._by_origin.pop(origin, None)) is not None:
            for worker_id, count in entry[1].items():
                self._add(worker_id, -count)

    def _add(self, worker_id: str, delta: int) -> None:
        if not delta:
            return
        self._changed.add(worker_id)
        if total := self._totals.get(worker_id, 0) + delta:
            self._totals[worker_id] = total
        else:
            del self._totals[worker_id]


class Hold:
    """One request's count on one worker, taken by ``Registry.hold`` at the moment of choice.

    ``release`` ends it exactly once (later calls do nothing) and feeds the outcome to the worker's
    breaker; ``prefilled`` drops its prefill tokens earlier, once the worker has computed the prompt. As a context manager it releases with ``"none"`` whatever was not released in the block,
    so no path out of a request, a cancellation included, leaves a worker counted.
    """

    def __init__(
        self, registry: Registry, worker_id: str, num_prefill_tokens: int, priority: int = 0
    ) -> None:
        self.worker_id = worker_id
        self._registry: Registry | None = registry
        self._num_prefill_tokens = num_prefill_tokens
        self._priority = priority

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
            registry._release(self.worker_id, self._num_prefill_tokens, self._priority, outcome)

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release("none")
