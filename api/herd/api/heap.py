"""A serving process's garbage collector: the startup heap frozen, every collection's pause measured.

CPython's full collection (generation 2) walks every tracked container alive in the process, and
while it runs nothing else in the process does: every request in flight waits. A server holds most
of those containers from its start (the modules it imported, the tokenizer's tables, the model's
configuration, the app's routes), none of them garbage, and a full collection walked them all again
while serving: 165-175 ms each in a process of 8 simulated workers serving a batch (300,000 objects),
55-60 ms in the orchestrator (100,000) after its start. ``freeze_startup_heap``, once a server is ready, collects
what startup left behind and moves the rest out of the collector's sight (``gc.freeze``, as vLLM's
engine does once it has started), so a full collection walks only what serving made since.

``GC_PAUSES`` times every collection of the process (``gc.callbacks``) into the
``herd_gc_pause_seconds`` histogram, by generation; the orchestrator's and each worker's
``/metrics`` expose it.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from herd.api.metrics import HERD_GC_PAUSE_SECONDS

__all__ = ["GC_PAUSES", "GcPauses", "freeze_startup_heap"]

log = logging.getLogger(__name__)

_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_GENERATIONS = 3


class GcPauses(Collector):
    """Every garbage collection's pause while installed, by generation, as a Prometheus collector.

    The callback runs inside each collection, so it only counts: two clock reads and a few integer
    additions, no allocation that could itself start a collection."""

    def __init__(self) -> None:
        self._began = 0.0
        self._counts = [[0] * (len(_BUCKETS) + 1) for _ in range(_GENERATIONS)]
        self._sums = [0.0] * _GENERATIONS

    @property
    def is_installed(self) -> bool:
        return self._on_collection in gc.callbacks

    def install(self) -> None:
        """Start timing collections (once; a second call changes nothing)."""
        if not self.is_installed:
            gc.callbacks.append(self._on_collection)

    def uninstall(self) -> None:
        if self.is_installed:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._began = now
            return
        generation, seconds = info["generation"], now - self._began
        bucket = 0
        while bucket < len(_BUCKETS) and seconds > _BUCKETS[bucket]:
            bucket += 1
        self._counts[generation][bucket] += 1
        self._sums[generation] += seconds

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            HERD_GC_PAUSE_SECONDS,
            "This process's garbage collection pauses (the whole process waits), by generation.",
            labels=["generation"],
        )
        for generation in range(_GENERATIONS):
            cumulative, buckets = 0, []
            for bound, count in zip((*_BUCKETS, float("inf")), self._counts[generation], strict=True):
                cumulative += count
                buckets.append((_bound(bound), cumulative))
            family.add_metric([str(generation)], buckets, self._sums[generation])
        yield family


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


GC_PAUSES = GcPauses()
"""The process's one timer: collections are the process's, whichever server's registry exposes it."""


def freeze_startup_heap(**context: Any) -> int:
    """Collect the garbage startup left, then freeze every object alive (``gc.freeze``) and start
    ``GC_PAUSES``; returns how many objects the collector no longer walks. Call it once the server is
    ready to serve; calling it again also freezes what was made in between (a second worker of the
    same process loading its model). ``context`` goes into the log line."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    GC_PAUSES.install()
    frozen = gc.get_freeze_count()
    log.info(
        "startup heap frozen",
        extra={"frozen_objects": frozen, "ms": round(1000 * (time.perf_counter() - started), 1), **context},
    )
    return frozen
