"""Tracing and the access log across herd's gateway and a real in-process worker: the spans of one
request form one trace whose parent links cross the HTTP hop through ``traceparent`` (the worker
parents its spans on the header, not on whatever span is current), and every request writes one
access-log line without its prompt."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.disagg import TOKEN, HostDispatch, start_worker
from support.upstream_fakes import HttpxUpstream

from herd.api.crd import RoundRobinRouting
from herd.orchestrator.access_log import ACCESS_LOGGER, enable_access_log
from herd.orchestrator.app import AppSettings, build_app
from herd.orchestrator.discovery import ModelConfig, StaticSource
from herd.orchestrator.registry import RegistrySettings

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """Every span of this process, kept in memory (added to the SDK provider if one is set)."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(tiny_llama: Path, exporter: InMemorySpanExporter) -> AsyncIterator[httpx.AsyncClient]:
    dispatch = HostDispatch()
    http = httpx.AsyncClient(transport=dispatch, timeout=60)
    worker = await start_worker(tiny_llama, "w0", "unified", dispatch, http)
    model = ModelConfig("tiny", RoundRobinRouting(strategy="round_robin"), block_size=16, max_model_len=512)
    settings = AppSettings(internal_token=TOKEN, registry=RegistrySettings(poll_interval=0.05))
    app = build_app(
        StaticSource([model], [worker.endpoint]),
        settings=settings,
        http=http,
        upstream=HttpxUpstream(http, token=TOKEN),
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as client:
            for _ in range(100):
                if (await client.get("/ready")).status_code == 200 and app.state.registry.views("tiny"):
                    break
                await asyncio.sleep(0.05)
            yield client
    await worker.engine.stop()
    await http.aclose()


def chat(stream: bool) -> dict[str, object]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "a secret prompt"}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def by_name(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    named = {span.name: span for span in spans}
    assert len(named) == len(spans), [span.name for span in spans]
    return named


def parent_of(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_one_request_is_one_trace_from_the_client_through_the_worker(
    gateway: httpx.AsyncClient, exporter: InMemorySpanExporter, stream: bool
) -> None:
    exporter.clear()
    response = await gateway.post(
        "/v1/chat/completions", json=chat(stream), headers={"traceparent": TRACEPARENT}
    )
    assert response.status_code == 200, response.text
    spans = [
        span for span in exporter.get_finished_spans() if span.name.startswith("herd.")
    ]  # FastAPI has its own
    assert {f"{span.context.trace_id:032x}" for span in spans if span.context} == {TRACE_ID}
    named = by_name(spans)
    assert set(named) == {
        "herd.gateway.request",
        "herd.gateway.admission",
        "herd.gateway.route",
        "herd.gateway.upstream",
        "herd.worker.request",
        "herd.worker.prefill",
        "herd.worker.decode",
    }
    request = named["herd.gateway.request"]
    assert parent_of(request) == int(CLIENT_SPAN, 16)
    assert request.kind == trace.SpanKind.SERVER and request.attributes is not None
    assert (
        request.attributes["herd.model"] == "tiny" and request.attributes["http.response.status_code"] == 200
    )
    assert request.attributes["herd.completion_tokens"] == 4
    for child in ("herd.gateway.admission", "herd.gateway.route", "herd.gateway.upstream"):
        assert parent_of(named[child]) == request.context.span_id, child
    assert named["herd.gateway.route"].attributes == {
        "herd.worker": "w0",
        "herd.strategy": "round_robin",
        "herd.cached_blocks": 0,
        "herd.slo_missed": False,
    }
    upstream = named["herd.gateway.upstream"]
    worker = named["herd.worker.request"]
    assert parent_of(worker) == upstream.context.span_id  # across the HTTP hop, by traceparent
    assert worker.kind == trace.SpanKind.SERVER
    for child in ("herd.worker.prefill", "herd.worker.decode"):
        assert parent_of(named[child]) == worker.context.span_id
    prefill, decode = named["herd.worker.prefill"], named["herd.worker.decode"]
    assert prefill.end_time is not None and decode.start_time is not None
    assert prefill.end_time <= decode.start_time
    assert decode.attributes is not None and decode.attributes["herd.output_tokens"] == 4


async def test_every_request_writes_one_access_line_without_its_prompt(
    gateway: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    enable_access_log()
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        ok = await gateway.post("/v1/chat/completions", json=chat(True), headers={"X-Request-Id": "r-42"})
        await ok.aread()
        bad = await gateway.post("/v1/chat/completions", json={**chat(False), "max_tokens": -1})
    assert (ok.status_code, bad.status_code) == (200, 400)
    records = [record for record in caplog.records if record.name == ACCESS_LOGGER]
    assert len(records) == 2
    fields = [{key: getattr(record, key, None) for key in FIELDS} for record in records]
    assert fields[0] == {
        "request_id": "r-42",
        "tenant": "anonymous",
        "model": "tiny",
        "route": "/v1/chat/completions",
        "stream": True,
        "worker": "w0",
        "status": 200,
        "prompt_tokens": fields[0]["prompt_tokens"],
        "completion_tokens": 4,
        "ttft_ms": fields[0]["ttft_ms"],
        "duration_ms": fields[0]["duration_ms"],
        "resumes": 0,
    }
    assert fields[0]["prompt_tokens"] > 0 and 0 < fields[0]["ttft_ms"] <= fields[0]["duration_ms"]
    assert (fields[1]["status"], fields[1]["model"], fields[1]["worker"]) == (400, None, None)
    assert all("secret" not in json.dumps(vars(record), default=str) for record in records)


FIELDS = (
    "request_id", "tenant", "model", "route", "stream", "worker", "status", "prompt_tokens",
    "completion_tokens", "ttft_ms", "duration_ms", "resumes",
)  # fmt: skip
