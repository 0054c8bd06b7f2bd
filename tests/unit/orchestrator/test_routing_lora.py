"""Adapter-aware routing: ``lora_candidates`` in the capacity filter, the same for every strategy."""

from __future__ import annotations

from typing import Any

import pytest

from herd.api.crd import (
    KVCacheAwareRouting,
    LeastRequestRouting,
    PrefixHashRouting,
    RandomRouting,
    RoundRobinRouting,
    RoutingSpec,
    StickySessionRouting,
)
from herd.orchestrator.discovery import ModelConfig
from herd.orchestrator.routing import (
    LORA_SPILL_IN_FLIGHT,
    RequestContext,
    WorkerView,
    decide,
    lora_candidates,
)
from herd.orchestrator.served import ServedModel


def view(
    worker_id: str, *, loaded: tuple[str, ...] = (), running: tuple[str, ...] = (), **fields: Any
) -> WorkerView:
    fields.setdefault("max_loras", 2)
    return WorkerView(
        id=worker_id,
        url=f"http://{worker_id}",
        lora_adapters=frozenset(loaded),
        running_lora_adapters=frozenset(running),
        **fields,
    )


SPILL = LORA_SPILL_IN_FLIGHT


@pytest.mark.parametrize(
    ("workers", "lora", "expected"),
    [
        ([view("a"), view("b", loaded=("x",))], None, ["a", "b"]),
        ([view("a"), view("b", loaded=("x",)), view("c", loaded=("x",))], "x", ["b", "c"]),
        # b holds x but both its slots run other adapters: a free slot elsewhere wins (it loads x)
        ([view("a"), view("b", loaded=("x", "y", "z"), running=("y", "z"))], "x", ["a"]),
        # the same, and x already runs on b: it joins its batch
        ([view("a"), view("b", loaded=("x", "y"), running=("x", "y"))], "x", ["b"]),
        ([view("a"), view("b")], "x", ["a", "b"]),
        # the holder is busy enough: a worker with a free slot joins it
        ([view("a"), view("b", loaded=("x",), num_in_flight=SPILL)], "x", ["b", "a"]),
        ([view("a", num_in_flight=1), view("b", loaded=("x",), num_in_flight=SPILL)], "x", ["b"]),
        # no free slot anywhere: the holders queue it, else any LoRA worker
        ([view("a", running=("y", "z")), view("b", loaded=("x",), running=("y", "z"))], "x", ["b"]),
        ([view("a", running=("y", "z")), view("b", running=("v", "w"))], "x", ["a", "b"]),
        # workers without LoRA are left out while any has it
        ([view("a", max_loras=0), view("b")], "x", ["b"]),
        ([view("a", max_loras=0)], "x", ["a"]),
    ],
    ids=[
        "base-model-anywhere",
        "holders-first",
        "holder-without-slot",
        "holder-running-it",
        "nobody-holds-it",
        "spill-when-busy",
        "no-spill-below-margin",
        "all-full-holder-queues",
        "all-full-nobody-holds",
        "lora-off-left-out",
        "lora-off-only",
    ],
)
def test_lora_candidates(workers: list[WorkerView], lora: str | None, expected: list[str]) -> None:
    assert [worker.id for worker in lora_candidates(workers, lora)] == expected


STRATEGIES: list[RoutingSpec] = [
    RoundRobinRouting(strategy="round_robin"),
    LeastRequestRouting(strategy="least_request"),
    RandomRouting(strategy="random"),
    PrefixHashRouting(strategy="prefix_hash"),
    StickySessionRouting(strategy="sticky_session"),
    KVCacheAwareRouting(strategy="kv_cache_aware"),
]


@pytest.mark.parametrize("routing", STRATEGIES, ids=lambda routing: routing.strategy)
def test_every_strategy_sends_an_adapter_to_its_holder(routing: RoutingSpec) -> None:
    """Whatever the strategy, a request for x lands on the worker holding x (less loaded or not)."""
    served = ServedModel(ModelConfig("m", routing))
    workers = [view("a"), view("b", loaded=("x",), num_in_flight=2), view("c", loaded=("y",))]
    for seed in range(8):
        ctx = RequestContext(model="m", token_ids=range(64), block_hashes=[seed, seed + 1], lora_name="x")
        assert decide(served, workers, ctx).worker.id == "b"
