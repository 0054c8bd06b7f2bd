"""Where workers come from: the ``WorkerSource`` interface and its static implementation.

A source yields ``Membership`` values, each the *full* current set of models and worker endpoints
(level-based, like a Kubernetes informer's list): the registry diffs consecutive values, so a source
never has to say what changed, and a missed update is repaired by the next one. ``StaticSource``
serves a fixed list (local mode, ``herd up``, tests); Kubernetes discovery implements the same
protocol in ``kube_discovery``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from herd.api.crd import ModelDeployment, RoutingSpec
from herd.api.protocol import Role

__all__ = [
    "Membership",
    "ModelConfig",
    "StaticSource",
    "WorkerEndpoint",
    "WorkerSource",
]

Mode = Literal["aggregated", "disaggregated"]


@dataclass(frozen=True, slots=True)
class WorkerEndpoint:
    """One worker: its public OpenAI base URL and its internal-protocol base URL (no trailing slash)."""

    id: str
    model: str
    url: str
    internal_url: str
    role: Role = "unified"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the orchestrator needs to know about one served model.

    ``model_path`` is a local HF folder holding the tokenizer and chat template; it is only read when
    the routing strategy needs token ids. ``max_in_flight_per_worker`` is the most requests this
    orchestrator sends one worker at once (0: no limit); beyond it the worker counts as full.
    ``cold_start_timeout_s`` is how long a request waits for a ready worker while the model has none
    (a model that scales to zero); 0: it is answered 503 at once.
    """

    served_name: str
    routing: RoutingSpec
    block_size: int = 16
    max_model_len: int = 4096
    model_path: Path | None = None
    mode: Mode = "aggregated"
    prefill_threshold_tokens: int = 256
    max_in_flight_per_worker: int = 0
    adapters: tuple[str, ...] = ()
    """The LoRA adapters its manifest lists (every worker loads them at start)."""
    cold_start_timeout_s: float = 0.0

    @classmethod
    def from_deployment(cls, deployment: ModelDeployment, *, model_path: Path | None = None) -> ModelConfig:
        """The config a ModelDeployment implies; ``model_path`` is its local folder, if any."""
        spec = deployment.spec
        serving = spec.engine_for(spec.serving_pool)  # the pool that takes clients' requests
        return cls(
            served_name=deployment.served_name,
            routing=spec.routing,
            block_size=spec.engine.kv_cache.block_size,
            max_model_len=spec.engine.max_model_len,
            model_path=model_path,
            mode=spec.serving.mode,
            prefill_threshold_tokens=spec.serving.prefill_threshold_tokens,
            max_in_flight_per_worker=serving.max_batch_size + serving.max_queue_len,
            adapters=tuple(adapter.name for adapter in spec.adapters),
            cold_start_timeout_s=spec.autoscaling.cold_start_timeout_seconds
            if spec.autoscaling.scales_to_zero
            else 0.0,
        )


@dataclass(frozen=True, slots=True)
class Membership:
    """The full current state of a source: every model served and every worker endpoint."""

    models: tuple[ModelConfig, ...] = ()
    endpoints: tuple[WorkerEndpoint, ...] = field(default=())


class WorkerSource(Protocol):
    """Yields the full membership whenever it may have changed (the first value promptly)."""

    def watch(self) -> AsyncIterator[Membership]: ...


class StaticSource:
    """A fixed membership: yields it once, then stays silent until cancelled."""

    def __init__(self, models: Sequence[ModelConfig], endpoints: Sequence[WorkerEndpoint]) -> None:
        self.membership = Membership(models=tuple(models), endpoints=tuple(endpoints))

    async def watch(self) -> AsyncIterator[Membership]:
        yield self.membership
        await asyncio.Event().wait()
