"""The routing decision: one pure, synchronous function from a request and the worker views to a choice.

``decide(model, views, request)`` runs every step of the choice, in order, with no I/O and no await:

1. the capacity filter: the serving pool (the decode pool of a disaggregated model) less the workers
   the request already tried, healthy ones only, then those under ``max_in_flight_per_worker`` (for a
   background request, under its part of them: ``routing.reserve``, and none of the workers
   kept free of background work for interactive traffic: ``routing.headroom``),
   then for a LoRA request the workers ``lora_candidates`` prefers (the same for every strategy);
2. the model's strategy over what is left (``phase="decode"`` for a disaggregated model), unless
   the request carries latency targets (``RequestContext.slo``, unified models): then the worker
   predicted to meet them with the most headroom (``routing.slo``); when none is, the target's
   policy routes to the closest one anyway (``route``, ``lower``: the decision says it missed), waits
   (``UnroutableError("at_capacity")``: the gateway queues it) or refuses it
   (``UnroutableError("slo_unmet")``);
3. for a disaggregated request not yet prefilled, the prefill worker paired with that decode worker
   by the queue-bounded rule of ``pairing.choose_path`` (none: the decode worker prefills locally);
4. for a unified model, the peer the chosen worker pulls the prompt's leading blocks from, when the
   strategy prices pulls and found one cheaper than computing them (``RoutingStrategy.pull_source``);
5. the blocks to expect on the chosen workers, and the session pin to write.

Each edge (the gateway, the routing simulator, an endpoint picker) applies the returned ``Decision``
in one step: it counts the chosen workers' in-flight at once, before it awaits anything, so the next
decision already sees them. ``UnroutableError`` says why no worker could be chosen.

Cost: the strategy's own, plus a pass over the views; the strategy and the decision share one walk of
the index for each kind of run (``PromptMatch``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from herd.api.kv_hash import BlockHash
from herd.orchestrator.discovery import ModelConfig
from herd.orchestrator.kv_index import KVIndex, PromptMatch
from herd.orchestrator.routing._types import RequestContext, RoutingStrategy, WorkerView, healthy
from herd.orchestrator.routing.latency import LatencyFeatures, LatencyModel, Prediction
from herd.orchestrator.routing.pairing import choose_path, choose_prefill, num_uncached_tokens
from herd.orchestrator.routing.reserve import DEFAULT_RESERVE, SlotReserve, background_room, may_take_slot
from herd.orchestrator.routing.slo import SloChoice, choose_by_slo, features_of

__all__ = [
    "LORA_SPILL_IN_FLIGHT",
    "Decision",
    "Pin",
    "RoutedModel",
    "UnroutableError",
    "decide",
    "decide_prefill",
    "lora_candidates",
    "pin_key",
]

DEFAULT_SESSION_TTL_S = 3600
LORA_SPILL_IN_FLIGHT = 4
"""How many more requests in flight every worker holding an adapter has than the least busy worker
with a free slot before the adapter is let spill to that one (which then loads it)."""


class RoutedModel(Protocol):
    """What a decision reads of a served model (``ServedModel`` has it)."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def strategy(self) -> RoutingStrategy: ...
    @property
    def kv_index(self) -> KVIndex: ...
    @property
    def latency(self) -> LatencyModel: ...


class UnroutableError(Exception):
    """No worker can take the request now: none is healthy and untried, or every open one is full."""

    def __init__(self, reason: Literal["no_healthy_worker", "at_capacity", "slo_unmet"]) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Pin:
    """The session pin to write once the choice is counted."""

    key: str
    worker_id: str
    ttl_seconds: int
    is_claim: bool
    """No pin was read: only the first writer's pin stands (another replica may have won)."""


@dataclass(frozen=True, slots=True)
class Decision:
    worker: WorkerView
    """The worker that answers the client (a disaggregated model's decode worker)."""
    prefill: WorkerView | None = None
    """The prefill worker of a remote prefill; ``None`` when ``worker`` prefills the prompt itself."""
    num_prefill_tokens: int = 0
    """The uncached prompt tokens the prefilling worker computes (``prefill``, else ``worker``),
    counted on it until it has (``Hold.prefilled``), so that the next decision sees that work queued."""
    num_cached_blocks: int = 0
    """The prompt's leading blocks ``worker`` holds, by the KV index."""
    expected_blocks: Sequence[BlockHash] = ()
    """Blocks about to exist on ``worker`` and on ``prefill`` (``KVIndex.expect``)."""
    pin: Pin | None = None
    features: LatencyFeatures | None = None
    """The chosen worker's state as the latency model sees it, to fit it with what follows."""
    is_slo_missed: bool = False
    """The request's latency targets are predicted to be missed on ``worker`` (the best there was)."""
    predicted: Prediction | None = None
    """The latency the SLO choice predicted on ``worker`` (``None``: the strategy chose)."""
    pull_from: WorkerView | None = None
    """A peer whose device or host tier holds the prompt's leading blocks that ``worker`` lacks: it pulls
    them from it before it prefills (``kv_transfer_params.peer_url``)."""


def decide(
    model: RoutedModel,
    views: Sequence[WorkerView],
    request: RequestContext,
    reserve: SlotReserve = DEFAULT_RESERVE,
    kept: frozenset[str] = frozenset(),
) -> Decision:
    """The whole choice for ``request`` over every worker of ``model`` (both pools, any health);
    ``reserve``: the slots background requests leave to more urgent ones; ``kept``: the ids of the
    workers background requests leave free of background work (``routing.headroom.Headroom.kept``)."""
    config = model.config
    is_disaggregated = config.mode == "disaggregated"
    role = "decode" if is_disaggregated else "unified"
    excluded = request.excluded
    pool = [view for view in views if view.is_healthy and view.role == role and view.id not in excluded]
    if not pool:
        raise UnroutableError("no_healthy_worker")
    limit = config.max_in_flight_per_worker
    # A background request, a retry included, leaves the kept workers alone while another may serve
    # it; a retry whose every other worker is excluded (or down) takes a kept one, else it would block
    # its queue's head until the headroom ends.
    is_background = request.priority >= reserve.priority
    idle = kept if is_background and any(view.id not in kept for view in pool) else frozenset()
    open_pool = pool
    if is_background and limit:
        room = background_room(request.priority, limit, reserve)
        open_pool = [
            view
            for view in pool
            if may_take_slot(view.num_in_flight, view.num_background, limit, room) and view.id not in idle
        ]
    elif idle:
        # Without a limit ``may_take_slot`` opens every slot: the kept workers are all a background
        # request leaves (a call a worker was half of a batch decision's filter at 1,000 workers).
        open_pool = [view for view in pool if view.id not in idle]
    elif limit:
        # A more urgent request may take any slot under the limit: ``may_take_slot`` asks no more of
        # it, and this pass runs for every worker on every request.
        open_pool = [view for view in pool if view.num_in_flight < limit]
    open_pool = lora_candidates(open_pool, request.lora_name)
    # One walk of the index for each kind of run, shared by every step below and the strategy.
    kv = PromptMatch(model.kv_index, request.block_hashes)
    ctx = dataclasses.replace(
        request,
        phase="decode" if is_disaggregated else request.phase,
        kv=kv,
        lenders=() if is_disaggregated else pool,
    )
    matched = kv.device
    slo_choice = _by_slo(model, open_pool, request, matched)
    choice = None if slo_choice is None else slo_choice.worker
    if choice is None:
        choice = model.strategy.select(open_pool, ctx) if open_pool else None
    if choice is None:
        raise UnroutableError("at_capacity")
    num_cached = matched.get(choice.id, 0)
    # Blocks the worker holds only in a host or disk tier are restored, not computed: its queued
    # prefill counts from the end of its run over every tier.
    num_held = kv.held_run(choice.id)
    pull = None if is_disaggregated else model.strategy.pull_source(choice, pool, ctx)
    num_known = num_held if pull is None else max(num_held, pull.num_blocks)
    # A prefilled request's decode worker imports the prompt's KV blocks; it computes none of them.
    num_local = 0 if request.is_prefilled else len(request.token_ids)
    decision = Decision(
        choice,
        num_prefill_tokens=num_uncached_tokens(num_local, num_known, config.block_size),
        num_cached_blocks=num_cached,
        expected_blocks=request.block_hashes,
        pin=_pin(model, request, choice),
        features=features_of(choice, len(request.token_ids), num_cached, config.block_size),
        is_slo_missed=slo_choice is not None and not slo_choice.is_met,
        predicted=None if slo_choice is None else slo_choice.prediction,
        pull_from=None if pull is None else pull.peer,
    )
    if is_disaggregated and not request.is_prefilled:
        return _paired(model, views, request, decision, matched)
    return decision


def _by_slo(
    model: RoutedModel, workers: Sequence[WorkerView], request: RequestContext, matched: Mapping[str, int]
) -> SloChoice | None:
    """The SLO choice (it may miss the targets); ``None`` without one (no targets, a disaggregated
    model, nothing to predict with yet): the strategy chooses."""
    target = request.slo
    if target is None or not workers or model.config.mode == "disaggregated":
        return None
    choice = choose_by_slo(
        model.latency,
        workers,
        target,
        num_prompt_tokens=len(request.token_ids),
        matched=matched,
        block_size=model.config.block_size,
    )
    if choice is None:
        return None
    if not choice.is_met and target.on_miss == "queue":
        raise UnroutableError("at_capacity")
    if not choice.is_met and target.on_miss == "refuse":
        raise UnroutableError("slo_unmet")
    return choice


def lora_candidates(workers: list[WorkerView], lora_name: str | None) -> list[WorkerView]:
    """The workers a request with adapter ``lora_name`` should go to, for any strategy to choose from.

    Those holding the adapter with a slot to run it at once come first; the workers with a free slot
    join them (the chosen one loads the adapter) once every holder has ``LORA_SPILL_IN_FLIGHT``
    more requests in flight than the least busy of them, or when no worker holds it. With no free
    slot anywhere, the holders (else every LoRA worker) queue it. The base model: every worker.
    """
    if lora_name is None:
        return workers
    capable = [view for view in workers if view.max_loras > 0] or workers
    holders = [view for view in capable if lora_name in view.lora_adapters]
    ready = [view for view in holders if view.has_lora_slot(lora_name)]
    free = [view for view in capable if view not in ready and view.has_lora_slot(lora_name)]
    if not ready:
        return free or holders or capable
    if (
        free
        and min(view.num_in_flight for view in ready)
        >= min(view.num_in_flight for view in free) + LORA_SPILL_IN_FLIGHT
    ):
        return ready + free
    return ready


def decide_prefill(
    model: RoutedModel, views: Sequence[WorkerView], request: RequestContext
) -> tuple[WorkerView | None, int]:
    """The prefill worker for ``request`` among the healthy, untried prefill pool, and the uncached
    tokens it would compute; ``(None, 0)`` when none is left. ``decide`` pairs with it, and the
    gateway asks it again for a replacement when a prefill worker fails."""
    matched = model.kv_index.match(request.block_hashes) if request.block_hashes else {}
    return _prefill_of(model, views, request, matched)


def _prefill_of(
    model: RoutedModel, views: Sequence[WorkerView], request: RequestContext, matched: Mapping[str, int]
) -> tuple[WorkerView | None, int]:
    block_size = model.config.block_size
    workers = healthy([view for view in views if view.role == "prefill" and view.id not in request.excluded])
    prefill = choose_prefill(lora_candidates(workers, request.lora_name), matched, block_size)
    if prefill is None:
        return None, 0
    return prefill, num_uncached_tokens(len(request.token_ids), matched.get(prefill.id, 0), block_size)


def _paired(
    model: RoutedModel,
    views: Sequence[WorkerView],
    request: RequestContext,
    decision: Decision,
    matched: Mapping[str, int],
) -> Decision:
    """``decision`` with the prefill worker that computes its uncached part, if any should.

    A request without tokens (the model's tokenizer is not known yet) always goes to the prefill pool:
    its uncached part cannot be measured, and the prefill worker renders it.
    """
    config = model.config
    prefill, num_tokens = _prefill_of(model, views, request, matched)
    if prefill is None:
        return decision
    if request.token_ids:
        path = choose_path(
            decision.num_prefill_tokens,
            prefill,
            queued_tokens=prefill.queued_prefill_tokens,
            threshold_tokens=config.prefill_threshold_tokens,
            block_size=config.block_size,
        )
        if path == "local_prefill":
            return decision
    return dataclasses.replace(decision, prefill=prefill, num_prefill_tokens=num_tokens)


def _pin(model: RoutedModel, request: RequestContext, choice: WorkerView) -> Pin | None:
    if not (model.strategy.pins_sessions and request.session_key):
        return None
    ttl = getattr(model.config.routing, "session_ttl_seconds", DEFAULT_SESSION_TTL_S)
    key = pin_key(model.config.served_name, request.session_key)
    return Pin(key, choice.id, ttl, is_claim=request.pinned_worker_id is None)


def pin_key(model: str, session_key: str) -> str:
    """Where a session's pin is kept (``State``): sessions of different models never share one."""
    return f"{model}:{session_key}"
