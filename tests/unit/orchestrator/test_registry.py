"""The registry over fake workers' status streams: ejection of a dead or a silent worker, not of a slow one,
re-admission, load, KV sync, resume and resync."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import re
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, wait_for

from herd.api.crd import KVCacheAwareRouting
from herd.api.protocol import INTERNAL_PATHS, KVEvent, LoadReport
from herd.orchestrator import registry as registry_module
from herd.orchestrator.breaker import BreakerSettings
from herd.orchestrator.discovery import Membership, ModelConfig
from herd.orchestrator.registry import Hold, Registry, RegistrySettings, WorkerState, _SharedCounts
from herd.orchestrator.routing.reserve import BACKGROUND_PRIORITY
from herd.orchestrator.state import IN_FLIGHT_TTL_S, InFlightCounts, MemoryState
from herd.orchestrator.worker_client import WorkerClient

KV_AWARE = KVCacheAwareRouting(strategy="kv_cache_aware")


@contextlib.asynccontextmanager
async def registry_for(
    cluster: FakeCluster,
    settings: RegistrySettings | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    background_priority: int = BACKGROUND_PRIORITY,
) -> AsyncIterator[Registry]:
    async with httpx.AsyncClient(transport=transport or cluster.transport()) as http:
        registry = Registry(
            WorkerClient(http, token="t"),
            MemoryState(),
            settings or RegistrySettings(),
            background_priority=background_priority,
        )
        task = asyncio.create_task(registry.run(cluster.source(KV_AWARE)))
        try:
            await wait_for(lambda: len(registry.workers) == len(cluster.workers))
            yield registry
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_a_dead_worker_is_ejected_by_its_broken_stream_and_refused_reconnect_then_readmitted() -> None:
    cluster = FakeCluster([FakeWorker("w0"), FakeWorker("w1")])
    down = cluster.workers[0]
    registries: list[Registry] = []
    admitted_at_refusal: list[bool] = []  # per refused reconnect of w0: was it still admitted?

    def handle(request: httpx.Request) -> httpx.Response:
        worker = next(worker for worker in cluster.workers if request.url.host.startswith(f"{worker.id}."))
        if worker is down and not worker.is_up and request.url.path == INTERNAL_PATHS.status:
            admitted_at_refusal.append(registries[0].workers["w0"].is_healthy)
        return worker.handle(request)

    async with registry_for(cluster, transport=httpx.MockTransport(handle)) as registry:
        registries.append(registry)
        await wait_for(lambda: all(view.is_healthy for view in registry.views(MODEL)))
        down.is_up = False
        await wait_for(lambda: not registry.workers["w0"].is_healthy)
        assert registry.workers["w1"].is_healthy
        down.is_up = True
        await wait_for(lambda: registry.workers["w0"].is_healthy)
    # Counted in attempts, not seconds, so a loaded machine cannot fail it: the broken stream is the
    # first failure and the first refused reconnect, `retry_delay(1)` later, the second, which ejects.
    defaults = RegistrySettings()
    assert admitted_at_refusal[:1] == [True] and not any(admitted_at_refusal[1:])
    assert defaults.failures_to_eject == 2 and defaults.retry_delay(1) <= 0.5


async def test_a_silent_stream_ejects_at_once_and_a_slow_one_does_not() -> None:
    cluster = FakeCluster([FakeWorker("w0"), FakeWorker("w1", line_delay=0.3)])
    settings = RegistrySettings(poll_interval=0.02, heartbeat=0.05, silence_timeout=2.0)
    async with registry_for(cluster, settings) as registry:
        await wait_for(lambda: all(view.is_healthy for view in registry.views(MODEL)))
        cluster.workers[0].is_stalled = True
        await wait_for(lambda: not registry.workers["w0"].is_healthy)
        assert registry.workers["w1"].is_healthy and registry.workers["w1"].num_failures == 0
        cluster.workers[0].is_stalled = False
        await wait_for(lambda: registry.workers["w0"].is_healthy)
        assert registry.workers["w1"].num_failures == 0 and cluster.workers[1].num_status_streams == 1


async def test_silence_ejects_at_most_the_capped_share_of_workers_at_a_time() -> None:
    cluster = FakeCluster([FakeWorker(f"w{n}") for n in range(3)])
    settings = RegistrySettings(poll_interval=0.02, heartbeat=0.05, silence_timeout=0.3, max_silent_share=0.1)
    async with registry_for(cluster, settings) as registry:
        await wait_for(lambda: all(view.is_healthy for view in registry.views(MODEL)))
        for worker in cluster.workers:
            worker.is_stalled = True  # all at once: more likely the orchestrator's stall than theirs
        # Counted, not slept: every stream timed out and was reopened at least twice.
        await wait_for(lambda: all(worker.num_status_streams >= 3 for worker in cluster.workers))
        assert sorted(view.is_healthy for view in registry.views(MODEL)) == [False, True, True]
        for worker in cluster.workers:
            worker.is_stalled = False
        await wait_for(lambda: all(view.is_healthy for view in registry.views(MODEL)))


@pytest.mark.parametrize(("num_failures", "expected"), [(0, 0.25), (1, 0.25), (2, 0.5), (3, 1.0), (9, 1.0)])
def test_retries_back_off_to_a_bound(num_failures: int, expected: float) -> None:
    assert RegistrySettings().retry_delay(num_failures) == expected


async def test_not_ready_worker_is_ejected_and_draining_is_unhealthy() -> None:
    cluster = FakeCluster([FakeWorker("w0"), FakeWorker("w1")])
    async with registry_for(cluster, RegistrySettings(poll_interval=0.02)) as registry:
        await wait_for(lambda: all(view.is_healthy for view in registry.views(MODEL)))
        cluster.workers[0].is_ready = False
        cluster.workers[1].load = LoadReport(num_running=3, num_total_blocks=500, is_draining=True)
        await wait_for(lambda: not registry.workers["w0"].is_healthy)
        await wait_for(lambda: registry.workers["w1"].report.num_running == 3)
        views = {view.id: view for view in registry.views(MODEL)}
    assert not views["w1"].is_healthy and views["w1"].num_total_blocks == 500


async def test_a_worker_whose_load_report_is_invalid_is_ejected_not_ranked_until_it_reports_sense() -> None:
    cluster = FakeCluster([FakeWorker("w0"), FakeWorker("w1")])
    async with registry_for(cluster, RegistrySettings(poll_interval=0.02)) as registry:
        await wait_for(lambda: all(view.is_healthy for view in registry.views(MODEL)))
        # Past validation on the fake's side: the line on the wire says num_running -1.
        cluster.workers[0].load = LoadReport.model_construct(num_running=-1)
        await wait_for(lambda: not registry.workers["w0"].is_healthy)
        assert registry.workers["w0"].report.num_running >= 0
        assert registry.workers["w1"].is_healthy
        cluster.workers[0].load = LoadReport(num_running=1)
        await wait_for(lambda: registry.workers["w0"].is_healthy)
        assert registry.workers["w0"].report.num_running == 1


async def test_kv_events_snapshot_gap_epoch_and_leave() -> None:
    worker = FakeWorker("w0", snapshot_blocks=[1, 2])
    cluster = FakeCluster([worker])
    async with registry_for(cluster, RegistrySettings(poll_interval=0.02)) as registry:
        index = registry.models[MODEL].kv_index
        await wait_for(lambda: index.match([1, 2]) == {"w0": 2})
        assert worker.num_snapshots == 1
        worker.events.append(KVEvent(seq=1, kind="stored", block_hashes=[3]))
        await wait_for(lambda: index.match([1, 2, 3]) == {"w0": 3})
        assert worker.num_snapshots == 1
        worker.events.append(KVEvent(seq=3, kind="stored", block_hashes=[9]))  # seq 2 lost: a gap
        worker.snapshot_blocks = [1, 2, 3, 4]
        await wait_for(lambda: index.match([1, 2, 3, 4]) == {"w0": 4})
        assert worker.num_snapshots == 2
        worker.epoch, worker.events, worker.snapshot_blocks = "e2", [], [7]  # the worker restarted
        await wait_for(lambda: index.match([7]) == {"w0": 1} and index.match([1]) == {})
        registry.apply_membership(Membership(models=(ModelConfig(MODEL, KV_AWARE),), endpoints=()))
        assert index.match([7]) == {} and registry.workers == {}


async def test_in_flight_counts_feed_the_views() -> None:
    cluster = FakeCluster([FakeWorker("w0")])
    async with registry_for(cluster) as registry:
        registry.hold("w0")
        registry.hold("w0").release("none")
        assert registry.views(MODEL)[0].num_in_flight == 1


async def test_a_view_is_given_again_until_its_worker_changes() -> None:
    """Views are reused between decisions while nothing they show changed, and a view taken earlier
    keeps what it showed (the registry replaces what it changes, never edits it)."""
    cluster = FakeCluster([FakeWorker("w0")])
    async with registry_for(cluster) as registry:
        worker = registry.workers["w0"]
        await wait_for(lambda: worker.is_healthy)
        first = registry.views(MODEL)[0]
        assert registry.views(MODEL)[0] is first
        hold = registry.hold("w0", priority=BACKGROUND_PRIORITY)
        held = registry.views(MODEL)[0]
        hold.release("none")
        released = registry.views(MODEL)[0]
        worker.take_report(LoadReport(num_running=2))
        reported = registry.views(MODEL)[0]
        worker.is_healthy = False
        ejected = registry.all_views(MODEL)[0]
        seen = [
            (v.num_in_flight, v.num_background, v.num_running, v.is_healthy)
            for v in (first, held, released, reported, ejected)
        ]
        assert seen == [(0, 0, 0, True), (1, 1, 0, True), (0, 0, 0, True), (0, 0, 2, True), (0, 0, 2, False)]
        assert len({id(view) for view in (first, held, released, reported, ejected)}) == 5
        registry.forget_views()  # the next view is built afresh, showing the same
        rebuilt = registry.all_views(MODEL)[0]
        assert rebuilt is not ejected and rebuilt == ejected


def expected_views(registry: Registry) -> list[tuple[str, int, int, int, int, bool]]:
    """What every worker's view must show now, worked out from the registry's state, not its views."""
    now, elsewhere = time.monotonic(), registry._elsewhere.totals(time.monotonic())
    return [
        (
            worker.endpoint.id,
            worker.num_in_flight + elsewhere.get(worker.endpoint.id, 0),
            worker.num_background,
            worker.num_prefill_tokens_in_flight,
            worker.report.num_running,
            worker.is_healthy and not worker.report.is_draining and worker.breaker.can_send(now),
        )
        for worker in registry.model_workers(MODEL)
    ]


@pytest.mark.parametrize("seed", range(4))
async def test_views_kept_between_decisions_show_every_change(seed: int) -> None:
    """Holds, releases (failures open breakers, probes half-open ones), prefills, reports, health and
    the other replicas' counts in a seeded random order: after each, the views the registry keeps
    show what its state says (a view is taken again only for a worker marked changed)."""
    rng = random.Random(seed)
    cluster = FakeCluster([FakeWorker(f"w{i}") for i in range(4)])
    breaker = BreakerSettings(failures_to_open=2, cooldown_seconds=0.0)
    async with registry_for(cluster, RegistrySettings(breaker=breaker)) as registry:
        await wait_for(lambda: all(worker.is_healthy for worker in registry.workers.values()))
        holds: list[Hold] = []
        for step in range(300):
            worker = registry.workers[f"w{rng.randrange(4)}"]
            match rng.randrange(7):
                case 0 | 1:
                    priority = rng.choice([0, BACKGROUND_PRIORITY])
                    holds.append(
                        registry.hold(
                            worker.endpoint.id, num_prefill_tokens=rng.randrange(64), priority=priority
                        )
                    )
                case 2 if holds:
                    holds.pop(rng.randrange(len(holds))).release(rng.choice(["success", "failure", "none"]))
                case 3 if holds:
                    rng.choice(holds).prefilled()
                case 4:
                    worker.take_report(
                        LoadReport(num_running=rng.randrange(8), is_draining=rng.random() < 0.2)
                    )
                case 5:
                    worker.is_healthy = rng.random() < 0.7
                case _:
                    counts = {f"w{i}": rng.randrange(1, 4) for i in rng.sample(range(4), rng.randrange(3))}
                    registry.receive_kv("", InFlightCounts(origin=rng.choice(["r2", "r3"]), counts=counts))
            seen = [
                (
                    v.id,
                    v.num_in_flight,
                    v.num_background,
                    v.num_prefill_tokens_in_flight,
                    v.num_running,
                    v.is_healthy,
                )
                for v in registry.all_views(MODEL)
            ]
            assert seen == expected_views(registry), step


def test_every_field_a_view_reads_marks_its_worker_changed() -> None:
    """A field ``WorkerState.view`` reads but setting it does not mark would leave a kept view stale."""
    read = set(re.findall(r"self\.(\w+)", inspect.getsource(WorkerState.view)))
    assert read - {"endpoint", "breaker", "_viewed"} == set(registry_module._VIEWED_FIELDS)


async def test_a_view_shows_a_breaker_half_open_when_its_cooldown_ends() -> None:
    """Nothing happens to the worker while its breaker cools down: the registry views a worker whose
    breaker is not closed on every decision."""
    cluster = FakeCluster([FakeWorker("w0")])
    breaker = BreakerSettings(failures_to_open=1, cooldown_seconds=0.05)
    async with registry_for(cluster, RegistrySettings(breaker=breaker)) as registry:
        await wait_for(lambda: registry.workers["w0"].is_healthy)
        assert registry.all_views(MODEL)[0].is_healthy
        registry.hold("w0").release("failure")
        assert not registry.all_views(MODEL)[0].is_healthy  # open
        await asyncio.sleep(0.06)
        assert registry.all_views(MODEL)[0].is_healthy  # half-open: a probe may go
        registry.hold("w0").release("success")
        assert registry.all_views(MODEL)[0].is_healthy and registry._by_model[MODEL].unsettled == set()


async def test_a_view_counts_the_background_requests_held_on_its_worker() -> None:
    """``num_background``: the requests in flight at the registry's background priority or a larger
    number (the slot reserve's), kept as they are held and released."""
    cluster = FakeCluster([FakeWorker("w0"), FakeWorker("w1")])
    async with registry_for(cluster, background_priority=5) as registry:
        holds = [registry.hold("w0", priority=p) for p in (0, 4, 5, 9)] + [registry.hold("w1", priority=7)]
        counted = [[view.num_background for view in registry.all_views(MODEL)]]
        holds[2].release("success")
        holds[1].release("success")
        counted.append([view.num_background for view in registry.all_views(MODEL)])
        holds[4].release("none")
        holds[3].release("none")
        counted.append([view.num_background for view in registry.all_views(MODEL)])
        assert counted == [[2, 1], [1, 1], [0, 0]]


async def test_the_models_requests_in_flight_by_priority_follow_holds_releases_and_leaves() -> None:
    """Counted on serving workers only (a disaggregated request counts once, on its decode worker);
    a worker that leaves takes its requests off, and their later releases take nothing more."""
    cluster = FakeCluster(
        [FakeWorker("d0", role="decode"), FakeWorker("d1", role="decode"), FakeWorker("p0", role="prefill")]
    )
    async with registry_for(cluster) as registry:
        holds = [
            registry.hold("d0", priority=0),
            registry.hold("d0", priority=9),
            registry.hold("d1", priority=9),
        ]
        prefill = registry.hold("p0", priority=0)
        counted = [dict(registry.in_flight_by_priority(MODEL))]
        holds[1].release("success")
        prefill.release("success")
        counted.append(dict(registry.in_flight_by_priority(MODEL)))
        registry.apply_membership(
            Membership(models=(ModelConfig(MODEL, KV_AWARE),), endpoints=(cluster.workers[1].endpoint,))
        )
        counted.append(dict(registry.in_flight_by_priority(MODEL)))
        holds[0].release("none")  # its worker left: nothing more to take off
        holds[2].release("success")
        counted.append(dict(registry.in_flight_by_priority(MODEL)))
        assert counted == [{0: 1, 9: 2}, {0: 1, 9: 1}, {9: 1}, {}]


async def test_a_hold_counts_its_prefill_tokens_until_the_worker_has_computed_them() -> None:
    cluster = FakeCluster([FakeWorker("w0")])
    async with registry_for(cluster) as registry:
        held = [registry.hold("w0", num_prefill_tokens=300), registry.hold("w0", num_prefill_tokens=50)]
        counted = [registry.views(MODEL)[0].num_prefill_tokens_in_flight]
        held[0].prefilled()
        held[0].prefilled()  # once only
        counted.append(registry.views(MODEL)[0].num_prefill_tokens_in_flight)
        held[0].release("success")  # its tokens are already off
        held[1].release("success")  # released before a first token: its tokens go with it
        view = registry.views(MODEL)[0]
        assert [*counted, view.num_prefill_tokens_in_flight, view.num_in_flight] == [350, 50, 0, 0]


async def test_a_reopened_stream_resumes_the_kv_events_without_a_snapshot() -> None:
    worker = FakeWorker("w0", snapshot_blocks=[5])
    async with registry_for(FakeCluster([worker]), RegistrySettings(poll_interval=0.02)) as registry:
        index = registry.models[MODEL].kv_index
        await wait_for(lambda: index.match([5]) == {"w0": 1})
        worker.is_up = False
        await wait_for(lambda: not registry.workers["w0"].is_healthy)
        worker.events.append(KVEvent(seq=1, kind="stored", block_hashes=[6]))
        worker.is_up = True
        await wait_for(lambda: index.match([5, 6]) == {"w0": 2})
        assert registry.workers["w0"].is_healthy and worker.num_snapshots == 1


def test_a_replicas_republished_counts_mark_only_the_workers_whose_total_moved() -> None:
    counts = _SharedCounts()
    counts.update(InFlightCounts(origin="r2", counts={"w0": 2, "w1": 1}), now=0.0)
    counts.update(InFlightCounts(origin="r3", counts={"w1": 4}), now=0.0)
    assert counts.drain_changed() == {"w0", "w1"} and counts.totals(0.0) == {"w0": 2, "w1": 5}
    counts.update(InFlightCounts(origin="r2", counts={"w0": 2, "w1": 1}), now=1.0)
    assert counts.drain_changed() == set()
    counts.update(InFlightCounts(origin="r2", counts={"w0": 2, "w2": 3}), now=2.0)
    assert counts.drain_changed() == {"w1", "w2"} and counts.totals(2.0) == {"w0": 2, "w1": 4, "w2": 3}
    counts.update(InFlightCounts(origin="r3", counts={}), now=3.0)
    assert counts.drain_changed() == {"w1"} and counts.totals(3.0) == {"w0": 2, "w2": 3}
    assert counts.totals(3.0 + IN_FLIGHT_TTL_S + 1) == {} and counts.drain_changed() == {"w0", "w2"}


async def test_the_other_replicas_in_flight_counts_add_to_the_views_until_they_go_stale() -> None:
    cluster = FakeCluster([FakeWorker("w0"), FakeWorker("w1")])
    async with registry_for(cluster) as registry:
        registry.hold("w0")
        registry.receive_kv("", InFlightCounts(origin="r2", counts={"w0": 2, "w1": 1}))
        registry.receive_kv("", InFlightCounts(origin="r3", counts={"w1": 4}))
        registry.receive_kv(
            "", InFlightCounts(origin="r2", counts={"w0": 1})
        )  # r2's latest replaces its first
        assert {view.id: view.num_in_flight for view in registry.views(MODEL)} == {"w0": 2, "w1": 4}
        stale = time.monotonic() + IN_FLIGHT_TTL_S + 1
        assert registry._elsewhere.totals(stale) == {}
