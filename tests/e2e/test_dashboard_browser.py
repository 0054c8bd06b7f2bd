"""The orchestrator's /dashboard page in headless Chromium: what a person sees matches /dashboard/data,
and its history charts draw the sampled points.

A real orchestrator app is served by uvicorn on a loopback port over fake workers (their health, load
and KV events are chosen here), or over one real tiny-Llama worker with a host KV tier; Chromium
loads the page, runs its script against the live server and dumps the DOM it rendered. Console output goes to stderr, where an uncaught JavaScript error shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse
from support.dashboard_worker import (
    cycle_prompts,
    orchestrator_over_worker,
    restored_from_host,
    tiered_worker,
    wait_for_point,
)
from support.engine_metrics import EngineMetrics
from support.gateway_fakes import FAST_REGISTRY, FakeCluster, FakeWorker, running_gateway, wait_for
from support.procs import free_port

from herd.api.protocol import LoadReport
from herd.orchestrator.app import AppSettings
from herd.orchestrator.dashboard import DASHBOARD_HTML
from herd.orchestrator.history_sampler import HistorySettings

CHROMIUM = shutil.which("chromium")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        CHROMIUM is None, reason="chromium is not installed: run `make test` (it installs Debian's chromium)"
    ),
]

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}
BROWSER_LIMIT_SECONDS = 90.0
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # required as root; the page is our own, served on loopback
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--enable-logging=stderr",
    "--v=0",
    # Virtual time runs the page's 1 s polling a few times without waiting that long for real.
    "--virtual-time-budget=3500",
)


@dataclass
class Chart:
    """One history chart as drawn: the values it plotted and each line's values and path."""

    num_points: int
    lines: dict[str, tuple[int, str]] = field(default_factory=dict)
    zero_y: float | None = None
    """The height of the chart's zero axis (its first line)."""

    def peak_height(self, series: str) -> float:
        """How far above zero the line ``series`` rises at its highest point, in SVG units."""
        assert self.zero_y is not None
        heights = [
            self.zero_y - float(y) for y in re.findall(r"[ML][-\d.]+ ([-\d.]+)", self.lines[series][1])
        ]
        return max(heights, default=0.0)


class RenderedDashboard(HTMLParser):
    """The text of every ``data-summary`` element and of every ``data-field`` cell per worker row; the
    history charts by (model, chart)."""

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.summary: dict[str, str] = {}
        self.rows: dict[str, dict[str, str]] = {}
        self.status = ""
        self.empty = ""
        self.charts: dict[tuple[str, str], Chart] = {}
        self._open: list[tuple[str, dict[str, str], list[str]]] = []
        self._worker: str | None = None
        self._model = ""
        self._chart: Chart | None = None
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        if "data-worker" in values:
            self._worker = values["data-worker"]
            self.rows[self._worker] = {}
        self._chart_tag(tag, values)
        self._open.append((tag, values, []))

    def _chart_tag(self, tag: str, values: dict[str, str]) -> None:
        if "data-model" in values:
            self._model = values["data-model"]
        elif "data-chart" in values:
            self._chart = Chart(int(values["data-points"]))
            self.charts[self._model, values["data-chart"]] = self._chart
        elif tag == "path" and self._chart is not None:
            self._chart.lines[values["data-series"]] = (int(values["data-count"]), values["d"])
        elif tag == "line" and self._chart is not None and self._chart.zero_y is None:
            self._chart.zero_y = float(values["y1"])

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            name, values, texts = self._open.pop()
            self._close(values, "".join(texts))
            if self._open:
                self._open[-1][2].append("".join(texts))
            if name == tag:
                return

    def handle_data(self, data: str) -> None:
        if self._open:
            self._open[-1][2].append(data)

    def _close(self, values: dict[str, str], text: str) -> None:
        if "data-summary" in values:
            self.summary[values["data-summary"]] = text
        elif values.get("data-field") == "empty":
            self.empty = text
        elif "data-field" in values and self._worker is not None:
            self.rows[self._worker][values["data-field"]] = text
        elif values.get("id") == "status":
            self.status = text


@contextlib.asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[str]:
    """``app`` (already started by ``running_gateway``) on a free loopback port; yields its base URL."""
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, lifespan="off", log_config=None, access_log=False
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        await wait_for(lambda: server.started or task.done(), within=30.0)
        assert server.started, "uvicorn did not start the dashboard server"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=10.0)


async def chromium(url: str, profile: Path, *flags: str) -> tuple[str, str]:
    """Run headless Chromium once on ``url``; its stdout and stderr. Stopped by its own pid if late."""
    assert CHROMIUM is not None
    argv = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *flags, url]
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=BROWSER_LIMIT_SECONDS)
    finally:
        if process.returncode is None:
            # Its own session: the group id is its pid, which also reaches its renderer children.
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    assert process.returncode == 0, f"chromium failed ({process.returncode}): {err.decode()[-2000:]}"
    return out.decode(), err.decode()


async def render(url: str, tmp_path: Path) -> RenderedDashboard:
    dom, console = await chromium(f"{url}/dashboard", tmp_path / "profile", "--dump-dom")
    errors = [line for line in console.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not errors, f"the page logged to the console: {errors}"
    return RenderedDashboard(dom)


def cluster() -> FakeCluster:
    """Two busy workers (one with KV blocks indexed), one draining, one down; streams stall an hour.

    A held stream must stay in flight while Chromium renders, however slowly a loaded machine starts
    it; the test closes it, so the stall never costs its length.
    """
    busy = LoadReport(num_running=3, num_waiting=1, kv_usage=0.42, num_free_blocks=290, num_total_blocks=500)
    calm = LoadReport(num_running=1, kv_usage=0.068, num_free_blocks=466, num_total_blocks=500)
    draining = LoadReport(
        num_running=2, kv_usage=0.9, num_free_blocks=50, num_total_blocks=500, is_draining=True
    )
    slow = {"chunk_delay": 3600.0, "num_chunks": 2}
    return FakeCluster(
        [
            FakeWorker("w0", load=busy, snapshot_blocks=list(range(40)), **slow),  # type: ignore[arg-type]
            FakeWorker("w1", load=calm, **slow),  # type: ignore[arg-type]
            FakeWorker("w2", load=draining),
            FakeWorker("w3", is_up=False),
        ]
    )


async def send(client: httpx.AsyncClient, count: int) -> None:
    for _ in range(count):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200, response.text


@contextlib.asynccontextmanager
async def held_stream(url: str) -> AsyncIterator[None]:
    """One streamed request kept open (its second chunk comes after an hour): one request in flight."""
    async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
        request = client.build_request("POST", "/v1/chat/completions", json={**CHAT, "stream": True})
        response = await client.send(request, stream=True)
        try:
            yield
        finally:
            await response.aclose()


def expected_row(row: dict[str, Any]) -> dict[str, str]:
    """What the page should show for one ``/dashboard/data`` worker row."""
    used, total = row["kv_blocks_used"], row["kv_blocks_total"]
    kv = {"kv_usage": f"{row['kv_usage'] * 100:.1f} %", "kv_blocks": f"{used} / {total} blocks"}
    return {
        "id": f"{row['id']}{row['url']}",
        "health": row["state"],
        "circuit": f"{row['circuit'].replace('_', '-')}{row['consecutive_failures']} failed in a row",
        "restarts": str(row["restarts"]),
        "requests_total": str(row["requests_total"]),
        "in_flight": str(row["in_flight"]),
        "running": str(row["running"]),
        "waiting": str(row["waiting"]),
        **(kv if total else {"kv_usage": "no report yet"}),
        "kv_blocks_indexed": str(row["kv_blocks_indexed"]),
    }


def shown_row(rendered: RenderedDashboard, row: dict[str, Any]) -> dict[str, str]:
    fields = rendered.rows.get(row["id"], {})
    return {name: fields.get(name, "<missing>") for name in expected_row(row)}


def indexed_blocks(app: FastAPI, worker_id: str) -> int:
    return int(app.state.registry.models["tiny"].kv_index.num_blocks(worker_id))


async def test_dashboard_shows_each_worker_as_its_data_says_and_counts_move(tmp_path: Path) -> None:
    async with running_gateway(cluster()) as (app, client), serving(app) as url:
        await send(client, 4)
        await wait_for(lambda: indexed_blocks(app, "w0") == 40, within=30.0)
        async with held_stream(url):
            first = await render(url, tmp_path)
            data = (await client.get("/dashboard/data")).json()
            await send(client, 3)
            second = await render(url, tmp_path)
            later = (await client.get("/dashboard/data")).json()
    assert sorted(first.rows) == ["w0", "w1", "w2", "w3"]
    assert sum(row["in_flight"] for row in data["workers"]) == 1
    assert [shown_row(first, row) for row in data["workers"]] == [
        expected_row(row) for row in data["workers"]
    ]
    assert [first.rows[worker]["health"] for worker in ("w0", "w1", "w2", "w3")] == [
        "up",
        "up",
        "draining",
        "down",
    ]
    assert first.rows["w0"]["kv_blocks_indexed"] == "40"
    assert (first.summary["workers"], first.summary["requests_total"]) == ("2 / 4", "4")
    assert first.summary["errors_total"] == str(data["errors_total"]) == "0"
    assert second.summary["requests_total"] == "7" == str(later["requests_total"])
    assert [shown_row(second, row) for row in later["workers"]] == [
        expected_row(row) for row in later["workers"]
    ]
    assert first.status.startswith("updated") and second.status.startswith("updated")


async def test_dashboard_without_workers_says_so(tmp_path: Path) -> None:
    async with running_gateway(FakeCluster([])) as (app, _), serving(app) as url:
        rendered = await render(url, tmp_path)
    assert rendered.rows == {}
    assert rendered.summary["workers"] == "0 / 0"
    assert "No workers yet" in rendered.empty


async def test_dashboard_screenshot_is_a_picture(tmp_path: Path) -> None:
    fakes = cluster()
    engines = {"w0": EngineMetrics(), "w1": EngineMetrics()}
    shot = tmp_path / "dashboard.png"
    settings = AppSettings(registry=FAST_REGISTRY, history=SHORT_HISTORY)
    async with running_gateway(fakes, settings=settings) as (app, client), serving(app) as url:
        await send(client, 6)
        await wait_for(lambda: indexed_blocks(app, "w0") == 40, within=30.0)
        for round_number in range(40):  # 4 s of traffic that rises and falls, for the charts
            await stream_quickly(fakes, client, 1 + round_number % 8)
            await count_work(fakes, engines, round_number)
        async with held_stream(url):
            # Traffic goes on while Chromium starts, so the charts' right ends are not a lull; unstreamed,
            # so the held stream stays stalled.
            more = asyncio.create_task(unstreamed_rounds(fakes, client, engines, start=40))
            try:
                size = "--window-size=1280,1380"
                await chromium(f"{url}/dashboard", tmp_path / "profile", f"--screenshot={shot}", size)
            finally:
                more.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await more
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000


async def unstreamed_rounds(
    fakes: FakeCluster, client: httpx.AsyncClient, engines: dict[str, EngineMetrics], start: int
) -> None:
    """Rounds of traffic as the screenshot's, with requests that are not streamed, for at most 60 s."""
    for round_number in range(start, start + 600):
        await send(client, 1 + round_number % 8)
        await count_work(fakes, engines, round_number)


async def count_work(fakes: FakeCluster, engines: dict[str, EngineMetrics], round_number: int) -> None:
    """One round of the screenshot's engine and tier work, then a sampling interval's sleep."""
    count_engine_work(fakes, engines, gap=0.01 + 0.005 * (round_number % 6))
    count_tier_work(fakes, engines, round_number)
    await asyncio.sleep(SHORT_HISTORY.interval_seconds)


async def stream_quickly(fakes: FakeCluster, client: httpx.AsyncClient, count: int) -> None:
    """``count`` streamed requests that finish at once (so TTFT has samples); then streams stall again."""
    delays = [worker.chunk_delay for worker in fakes.workers]
    for worker in fakes.workers:
        worker.chunk_delay = 0.0
    for _ in range(count):
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert response.status_code == 200, response.text
    for worker, delay in zip(fakes.workers, delays, strict=True):
        worker.chunk_delay = delay


HISTORY = HistorySettings(interval_seconds=0.1, window_seconds=0.5, span_seconds=60.0)
SHORT_HISTORY = HistorySettings(interval_seconds=0.1, window_seconds=0.5, span_seconds=5.0)
"""For the screenshot: a span that a few seconds of traffic fill."""
CHARTS = ("request_rate", "ttft", "itl", "hit_rate", "shares")


def count_engine_work(fakes: FakeCluster, engines: dict[str, EngineMetrics], gap: float = 0.02) -> None:
    """The workers' engines count cache hits and a token gap of ``gap`` seconds, as their /metrics then say."""
    for worker in fakes.workers:
        engine = engines.get(worker.id)
        if engine is not None:
            engine.queries.labels("tiny").inc(100)
            engine.hits.labels("tiny").inc(60)
            engine.itl.labels("tiny").observe(gap)
            worker.metrics = engine.text()


def count_tier_work(fakes: FakeCluster, engines: dict[str, EngineMetrics], round_number: int) -> None:
    """For the screenshot: the workers' engines fill a host and a disk tier, offload into them, restore
    from them and evict, and pull prefixes from peers, in waves, as their /metrics then say."""
    wave = round_number % 8
    for index, worker in enumerate(fakes.workers):
        engine = engines.get(worker.id)
        if engine is None:
            continue
        engine.device_usage.labels("tiny").set(worker.load.kv_usage)
        for medium, fill, blocks in (("host", 0.02, 12), ("disk", 0.008, 4)):
            engine.tier_usage.labels("tiny", medium).set(min(1.0, fill * (round_number + 1) * (index + 1)))
            engine.stored.labels("tiny", medium).inc(blocks + wave)
            engine.restored.labels("tiny", medium).inc(blocks * wave // 4)
        engine.evicted.labels("tiny", "device").inc(16 + 2 * wave)
        engine.evicted.labels("tiny", "host").inc(4 if round_number > 20 else 0)
        engine.pulls.labels("tiny", "pulled").inc(wave // 2)
        engine.pulls.labels("tiny", "empty").inc(int(wave % 3 == 0))
        worker.metrics = engine.text()


def complete(point: dict[str, Any]) -> bool:
    """A point of model ``tiny`` with every figure the charts draw."""
    model = point["models"].get("tiny")
    figures = ("ttft_p50_ms", "itl_p50_ms", "hit_rate")
    return (
        model is not None
        and model["request_rate"] > 0
        and model["shares"] != {}
        and all(model[figure] is not None for figure in figures)
    )


async def test_history_charts_draw_the_sampled_points_after_traffic(tmp_path: Path) -> None:
    engines = {"w0": EngineMetrics(), "w1": EngineMetrics()}
    workers = [FakeWorker(worker_id, metrics=engine.text()) for worker_id, engine in engines.items()]
    fakes = FakeCluster([*workers, FakeWorker("w2", is_up=False)])
    settings = AppSettings(registry=FAST_REGISTRY, history=HISTORY)
    async with running_gateway(fakes, settings=settings) as (app, client), serving(app) as url:
        served: list[dict[str, Any]] = []
        for _ in range(100):  # at most ~10 s: three complete points usually take half a second
            await stream_quickly(fakes, client, 4)
            count_engine_work(fakes, engines)
            await asyncio.sleep(HISTORY.interval_seconds)
            served = (await client.get("/dashboard/data")).json()["history"]["points"]
            if sum(complete(point) for point in served) >= 3:
                break
        assert sum(complete(point) for point in served) >= 3, served
        rendered = await render(url, tmp_path)
    charts = {chart: rendered.charts.get(("tiny", chart)) for chart in CHARTS}
    assert all(chart is not None and chart.num_points > 0 for chart in charts.values()), charts
    rate = rendered.charts["tiny", "request_rate"].lines["requests / s"]
    assert rate[0] >= sum(point["models"]["tiny"]["request_rate"] > 0 for point in served)
    assert "L" in rate[1], "the request rate is drawn as a line between its points"
    for chart in ("ttft", "itl"):
        assert sorted(rendered.charts["tiny", chart].lines) == ["p50", "p99"]
        assert all(count >= 3 for count, _ in rendered.charts["tiny", chart].lines.values())
    assert rendered.charts["tiny", "hit_rate"].lines["hit rate"][0] >= 3
    # Every known worker has a share line; w2 is down, so its line lies at zero.
    assert sorted(rendered.charts["tiny", "shares"].lines) == ["w0", "w1", "w2"]
    assert {point["models"]["tiny"]["shares"].get("w2") for point in served if complete(point)} == {0.0}


TIER_CHARTS = ("tier_usage", "tier_hits", "tier_stored", "tier_evictions")


async def test_tier_charts_draw_a_real_workers_host_tier(tiny_llama: Path, tmp_path: Path) -> None:
    async with (
        orchestrator_over_worker(tiny_llama, tiered_worker) as (app, client),
        serving(app) as url,
    ):
        await cycle_prompts(client)
        await wait_for_point(client, restored_from_host)
        rendered = await render(url, tmp_path)
    charts = {chart: rendered.charts.get(("tiny", chart)) for chart in TIER_CHARTS}
    assert all(chart is not None and chart.num_points > 0 for chart in charts.values()), charts
    assert ("tiny", "pulls") not in rendered.charts, "a worker without peer pulls draws no pull chart"
    expected = {"tier_usage": ["device", "host"], "tier_hits": ["host"], "tier_stored": ["host"]}
    expected["tier_evictions"] = ["device", "host"]
    assert {chart: sorted(rendered.charts["tiny", chart].lines) for chart in TIER_CHARTS} == expected
    # Each line of what the worker did rises above zero, as the points /dashboard/data served say.
    risen = [
        ("tier_usage", "host"),
        ("tier_hits", "host"),
        ("tier_stored", "host"),
        ("tier_evictions", "device"),
    ]
    assert all(rendered.charts["tiny", chart].peak_height(series) > 0 for chart, series in risen)
    # The host tier (64 blocks) holds all four prompts: it evicts none, and its line lies at zero.
    assert rendered.charts["tiny", "tier_evictions"].peak_height("host") == 0


async def test_dashboard_says_when_its_data_does_not_come(tmp_path: Path) -> None:
    async def page() -> HTMLResponse:
        return HTMLResponse(DASHBOARD_HTML)

    async def unavailable() -> JSONResponse:
        return JSONResponse({"detail": "restarting"}, status_code=503)

    app = FastAPI()
    app.add_api_route("/dashboard", page)
    app.add_api_route("/dashboard/data", unavailable)
    async with serving(app) as url:
        dom, _ = await chromium(f"{url}/dashboard", tmp_path / "profile", "--dump-dom")
    assert (
        RenderedDashboard(dom).status == "orchestrator unreachable (HTTP status 503); retrying every second"
    )
