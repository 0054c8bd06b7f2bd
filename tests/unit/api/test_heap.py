"""The startup heap's freeze and the garbage collection pause histogram (``herd.api.heap``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from herd.api.heap import GC_PAUSES, GcPauses, freeze_startup_heap
from herd.api.metrics import HERD_GC_PAUSE_SECONDS


@pytest.fixture
def pauses() -> Iterator[GcPauses]:
    timer = GcPauses()
    timer.install()
    yield timer
    timer.uninstall()


def _samples(timer: GcPauses) -> dict[tuple[str, str], float]:
    """``(sample name, generation or bucket bound)`` -> value, from one collect."""
    found: dict[tuple[str, str], float] = {}
    for family in timer.collect():
        for sample in family.samples:
            key = sample.labels["generation"] + (f"/{sample.labels['le']}" if "le" in sample.labels else "")
            found[(sample.name, key)] = sample.value
    return found


@pytest.mark.parametrize("generation", [0, 1, 2])
def test_each_collection_is_counted_under_its_generation(pauses: GcPauses, generation: int) -> None:
    before = _samples(pauses)
    gc.collect(generation)
    after = _samples(pauses)
    count = f"{HERD_GC_PAUSE_SECONDS}_count"
    assert after[(count, str(generation))] >= before[(count, str(generation))] + 1
    assert after[(f"{HERD_GC_PAUSE_SECONDS}_sum", str(generation))] > 0
    # Buckets are cumulative and end in +Inf, which holds every collection.
    bounds = [value for (name, key), value in after.items() if key.startswith(f"{generation}/")]
    assert bounds == sorted(bounds)
    assert after[(f"{HERD_GC_PAUSE_SECONDS}_bucket", f"{generation}/+Inf")] == after[(count, str(generation))]


def test_an_uninstalled_timer_counts_nothing() -> None:
    timer = GcPauses()
    gc.collect()
    assert not timer.is_installed
    assert all(value == 0 for value in _samples(timer).values())


def test_installing_twice_times_each_collection_once(pauses: GcPauses) -> None:
    pauses.install()
    before = _samples(pauses)[(f"{HERD_GC_PAUSE_SECONDS}_count", "2")]
    gc.collect()
    assert _samples(pauses)[(f"{HERD_GC_PAUSE_SECONDS}_count", "2")] == before + 1


def test_the_histogram_renders_in_a_registry(pauses: GcPauses) -> None:
    registry = CollectorRegistry()
    registry.register(pauses)
    gc.collect()
    text = generate_latest(registry).decode()
    assert f"# TYPE {HERD_GC_PAUSE_SECONDS} histogram" in text
    assert f'{HERD_GC_PAUSE_SECONDS}_bucket{{generation="2",le="+Inf"}}' in text


def test_freezing_takes_the_startup_heap_out_of_the_collectors_sight() -> None:
    kept = [[n] for n in range(1000)]  # tracked containers alive at "startup"
    try:
        frozen = freeze_startup_heap()
        # A frozen object that dies leaves the permanent generation (another thread may drop one
        # meanwhile), so the count can only have fallen since the freeze.
        assert frozen >= gc.get_freeze_count() >= len(kept)
        # A full collection now walks only what was made since: far fewer objects than the freeze held.
        assert len(gc.get_objects(2)) < frozen
    finally:
        gc.unfreeze()
        GC_PAUSES.uninstall()
