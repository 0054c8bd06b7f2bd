"""The types every strategy module imports: the interface and the per-decision inputs it sees.

The registry builds one ``WorkerView`` per worker for each decision; ``decide``
(``herd.orchestrator.routing.decision``) filters them with ``healthy`` and the capacity limit once,
then calls the model's strategy's ``select``, which is synchronous, pure and does no I/O. This
module is the bottom layer of the package: it imports no strategy, no factory and no decision
(an import-linter contract keeps it so).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from herd.api.protocol import LoadReport, Medium, Role
from herd.orchestrator.kv_index import PromptMatch

__all__ = [
    "PeerPull",
    "Phase",
    "RequestContext",
    "RoutingStrategy",
    "SloMiss",
    "SloTarget",
    "WorkerView",
    "healthy",
    "pull_block_tokens",
    "restore_block_tokens",
]

Phase = Literal["unified", "prefill", "decode"]
SloMiss = Literal["route", "queue", "lower", "refuse"]
"""What happens to a request whose latency targets no worker is predicted to meet: it goes to the
worker predicted closest to them, waits in the gateway's queue for one that meets them, goes to the
closest at the lowest priority, or is refused (429)."""


@dataclass(frozen=True, slots=True)
class SloTarget:
    """A request's latency targets (``None``: no target for that one) and its policy on a miss."""

    ttft_seconds: float | None = None
    tpot_seconds: float | None = None
    on_miss: SloMiss = "route"


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A read-only view of one worker, as the registry saw it at a decision. The registry gives the
    same view to later decisions while the worker has not changed, so none is edited (frozen): a
    changed worker gets a new one (``dataclasses.replace``)."""

    id: str
    url: str
    role: Role = "unified"
    num_in_flight: int = 0
    """Requests in flight to the worker: this orchestrator's own count, plus what the other replicas
    last shared of theirs (``State.share_in_flight``; none with one replica)."""
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_prefill_tokens: int = 0
    num_total_blocks: int = 0
    """Its KV pool's size in blocks, from its load report (0 until one arrives)."""
    max_batch_tokens: int = 0
    """The prompt tokens one of its steps computes at most, from its load report (0: not reported)."""
    is_healthy: bool = True
    num_prefill_tokens_in_flight: int = 0
    """Uncached prompt tokens of the prefills this orchestrator has in flight on the worker."""
    num_background: int = 0
    """Those of them at the slot reserve's priority or a larger number (background work), counted by
    the registry as requests are held and released (what the idle headroom ranks workers by)."""
    host_block_tokens: float | None = None
    """What restoring one block from its host tier costs the worker, in prompt tokens it could
    prefill meanwhile (``restore_block_tokens``); None until it measured both rates."""
    disk_block_tokens: float | None = None
    """The same for its disk tier."""
    prefill_tokens_per_s: float | None = None
    """Its measured prefill rate, from its load report (None until measured): the prior of its
    latency fit's TTFT slopes (``herd.orchestrator.routing.latency``)."""
    decode_step_s: float | None = None
    """Its measured decode step's seconds, from its load report (None until measured): what a lease on
    it waits for besides its queued prefill while it has requests (``kv_cache_aware.lease_wait_tokens``)."""
    pull_block_tokens: float | None = None
    """What pulling one block from a peer costs the worker, in prompt tokens it could prefill
    meanwhile (``pull_block_tokens``); None until it measured both rates."""
    max_loras: int = 0
    """Distinct LoRA adapters one of its steps runs (0: LoRA is off), from its load report."""
    lora_adapters: frozenset[str] = frozenset()
    """The LoRA adapters it has loaded."""
    running_lora_adapters: frozenset[str] = frozenset()
    """The adapters its running requests use: while they fill ``max_loras``, another waits."""
    queued_prefill_tokens: int = field(init=False, compare=False, repr=False)
    """The prefill work ahead of a new prompt: the uncached tokens of the prefills this orchestrator
    has in flight there, or the waiting ones of its last load report if more (the report lags and
    leaves out the prompt being computed; the count misses other orchestrators). Derived once, when
    the view is built, as is ``num_requests``: strategies read both for every worker on every request."""
    num_requests: int = field(init=False, compare=False, repr=False)
    """Requests on the worker: its reported running + waiting, or this orchestrator's in-flight count
    if more (the report covers other replicas, the count what the report has not seen yet)."""

    def __post_init__(self) -> None:
        # A frozen dataclass sets its own derived fields through object.__setattr__.
        object.__setattr__(
            self,
            "queued_prefill_tokens",
            max(self.num_prefill_tokens_in_flight, self.num_waiting_prefill_tokens),
        )
        object.__setattr__(self, "num_requests", max(self.num_running + self.num_waiting, self.num_in_flight))

    def has_lora_slot(self, lora_name: str) -> bool:
        """A request with ``lora_name`` can run at once: it is running, or a slot is free."""
        running = self.running_lora_adapters
        return lora_name in running or len(running) < self.max_loras


@dataclass(slots=True, frozen=True)
class RequestContext:
    """What a strategy may know about a request; a new input goes here, not into every signature."""

    model: str
    token_ids: Sequence[int] = ()
    """Rendered prompt ids; filled only when the strategy ``needs_tokens``."""
    block_hashes: Sequence[int] = ()
    """``herd.api.kv_hash.block_hashes`` of ``token_ids`` (served name as model id, cache salt)."""
    session_key: str | None = None
    pinned_worker_id: str | None = None
    """The session's current pin, looked up by the gateway before routing."""
    headers: Mapping[str, str] = field(default_factory=dict)
    phase: Phase = "unified"
    excluded: frozenset[str] = frozenset()
    """Workers this request already tried: ``decide`` leaves them out before any strategy runs."""
    is_prefilled: bool = False
    """The prefill phase already ran (a retry of a disaggregated request): a decode worker only."""
    slo: SloTarget | None = None
    """Latency targets: ``decide`` then picks by predicted latency rather than by the strategy."""
    lora_name: str | None = None
    """The LoRA adapter the request runs with (``None``: the base model); its hashes carry it."""
    priority: int = 0
    """Its admission priority (0 most urgent): background ones leave the reserved slots free."""
    kv: PromptMatch | None = field(default=None, compare=False, repr=False)
    """The prompt's runs in the model's KV index, for one decision: ``decide`` sets it so that the
    strategy and the decision walk the index once; a strategy given none looks them up itself."""
    lenders: Sequence[WorkerView] | None = field(default=None, compare=False, repr=False)
    """The workers a chosen one may pull the prompt's blocks from, for one decision: ``decide`` sets
    it to every healthy worker of the request's role (none for a disaggregated model), a wider set
    than the strategy chooses among (a holder at its in-flight limit still lends); ``None``: those
    the strategy was given."""


@dataclass(slots=True, frozen=True)
class PeerPull:
    """Where the chosen worker pulls a prompt's leading blocks from: ``peer``, whose device or host tier
    holds the first ``num_blocks`` of them (more than the chosen worker holds in any tier)."""

    peer: WorkerView
    num_blocks: int


class RoutingStrategy(ABC):
    """Chooses a worker for a request.

    ``needs_tokens``: the gateway must render, tokenize and hash the prompt first.
    ``pins_sessions``: the gateway must store ``(session_key -> chosen worker)`` after a decision.
    """

    name: ClassVar[str]
    needs_tokens: ClassVar[bool] = False
    pins_sessions: ClassVar[bool] = False

    @abstractmethod
    def select(self, workers: Sequence[WorkerView], ctx: RequestContext) -> WorkerView | None:
        """Pick one of ``workers`` (healthy, never empty), or ``None`` if none is acceptable."""

    def pull_source(
        self, choice: WorkerView, workers: Sequence[WorkerView], ctx: RequestContext
    ) -> PeerPull | None:
        """The peer among the decision's lenders (``ctx.lenders``; ``workers`` when it has none) that
        ``choice`` should pull the prompt's leading blocks from, if any; only a strategy that prices
        pulls names one."""
        return None

    def forget_worker(self, worker_id: str) -> None:
        """Drop any per-worker state when a worker leaves; stateless strategies need nothing."""
        return


def restore_block_tokens(report: LoadReport, medium: Medium) -> float | None:
    """A block restore from ``medium`` in prefill tokens: the worker's measured prefill rate times the
    seconds its measured restore bandwidth takes for a block; None while either is unmeasured."""
    return _block_tokens(report, report.restore_bytes_per_s.get(medium))


def pull_block_tokens(report: LoadReport) -> float | None:
    """A block pulled from a peer in prefill tokens, as ``restore_block_tokens`` with the worker's
    measured pull bandwidth."""
    return _block_tokens(report, report.pull_bytes_per_s)


def _block_tokens(report: LoadReport, bandwidth: float | None) -> float | None:
    if not bandwidth or report.prefill_tokens_per_s is None or not report.bytes_per_block:
        return None
    return report.prefill_tokens_per_s * report.bytes_per_block / bandwidth


def healthy(workers: Sequence[WorkerView]) -> list[WorkerView]:
    """The workers a strategy may choose from: filtered once, before any strategy runs."""
    return [worker for worker in workers if worker.is_healthy]
