"""SLO-aware choice: the worker predicted to meet a request's latency targets with the most headroom.

For each open worker, ``LatencyModel`` predicts the request's TTFT and time per output token from
the worker's queued prefill tokens, its batch and the request's uncached prompt there (the TTFT
slopes on prefill tokens start from the worker's reported prefill rate). A worker's
headroom is the smallest relative slack over the targets the request set (``(target - predicted) /
target``); the worker with the largest headroom wins, and it meets the targets when that headroom
is not negative. Before the model has samples enough to predict, there is no SLO choice and the
model's strategy decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from herd.orchestrator.routing._types import SloTarget, WorkerView
from herd.orchestrator.routing.latency import LatencyFeatures, LatencyModel, Prediction
from herd.orchestrator.routing.pairing import num_uncached_tokens

__all__ = ["SloChoice", "choose_by_slo", "features_of", "headroom"]


@dataclass(frozen=True, slots=True)
class SloChoice:
    worker: WorkerView
    prediction: Prediction
    headroom: float

    @property
    def is_met(self) -> bool:
        return self.headroom >= 0.0


def features_of(
    worker: WorkerView, num_prompt_tokens: int, num_cached_blocks: int, block_size: int
) -> LatencyFeatures:
    return LatencyFeatures(
        queued_prefill_tokens=worker.queued_prefill_tokens,
        batch=max(worker.num_running, worker.num_in_flight),
        uncached_prompt_tokens=num_uncached_tokens(num_prompt_tokens, num_cached_blocks, block_size),
    )


def headroom(prediction: Prediction, target: SloTarget) -> float:
    """The smallest relative slack over the targets set; negative when one is missed."""
    slack = [
        (wanted - predicted) / wanted
        for wanted, predicted in (
            (target.ttft_seconds, prediction.ttft_seconds),
            (target.tpot_seconds, prediction.tpot_seconds),
        )
        if wanted is not None
    ]
    return min(slack, default=0.0)


def choose_by_slo(
    latency: LatencyModel,
    workers: Sequence[WorkerView],
    target: SloTarget,
    *,
    num_prompt_tokens: int,
    matched: Mapping[str, int],
    block_size: int,
) -> SloChoice | None:
    """The worker with the most headroom over ``target``; ``None`` while no prediction is possible."""
    best: SloChoice | None = None
    for worker in workers:
        features = features_of(worker, num_prompt_tokens, matched.get(worker.id, 0), block_size)
        prediction = latency.predict(worker.id, features, worker.prefill_tokens_per_s)
        if prediction is None:
            return None
        choice = SloChoice(worker, prediction, headroom(prediction, target))
        if best is None or _rank(choice) > _rank(best):
            best = choice
    return best


def _rank(choice: SloChoice) -> tuple[float, int]:
    """More headroom first; among equals (idle workers), fewer requests in flight."""
    return choice.headroom, -choice.worker.num_in_flight
