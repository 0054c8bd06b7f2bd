"""The Batch API through the openai SDK: files, batches, output and error files, cancel, restarts."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.gateway_fakes import FAST_REGISTRY, MODEL, FakeCluster, FakeWorker, running_gateway, wait_for

from herd.orchestrator.admission.tenants import ANONYMOUS, BATCH_PRIORITY, Tenant
from herd.orchestrator.app import AppSettings
from herd.orchestrator.auth import ApiKeys
from herd.orchestrator.batch import lines as batch_lines
from herd.orchestrator.batch import routes as batch_routes
from herd.orchestrator.batch import runner as batch_runner
from herd.orchestrator.batch.lines import BatchLine, InputError, done_ids, parse_input
from herd.orchestrator.batch.runner import cancelling
from herd.orchestrator.batch.store import BatchRecord, BatchStatus, BatchStore, FileRecord, RequestCounts

ENDPOINT = "/v1/chat/completions"


def request_line(custom_id: str, **body: Any) -> dict[str, Any]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": custom_id}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": ENDPOINT, "body": chat}


def jsonl(items: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in items)


def sdk(client: httpx.AsyncClient, key: str = "k") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        api_key=key, base_url="http://orchestrator/v1", http_client=client, max_retries=0
    )


def settings(root: Path) -> AppSettings:
    return AppSettings(registry=FAST_REGISTRY, batch_dir=root)


KEYS = ApiKeys.of_tenants([("k", Tenant(name="team")), ("k2", Tenant(name="other"))])


async def finished(api: openai.AsyncOpenAI, batch_id: str, within: float = 30.0) -> Any:
    for _ in range(int(within / 0.05)):
        batch = await api.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        await asyncio.sleep(0.05)
    raise AssertionError(f"batch {batch_id} did not finish within {within}s")


@pytest.mark.parametrize(
    ("content", "line", "code"),
    [
        (b"", 0, "empty_file"),
        (b"not json\n", 1, "invalid_request"),
        (jsonl([request_line("a"), request_line("a")]), 2, "invalid_request"),
        (jsonl([{**request_line("a"), "url": "/v1/completions"}]), 1, "mismatched_url"),
        (jsonl([{**request_line("a"), "method": "GET"}]), 1, "invalid_request"),
        (jsonl([{**request_line("a"), "body": []}]), 1, "invalid_request"),
        (
            jsonl([request_line("a", x=json.loads("[" * 70 + "]" * 70))]),
            1,
            "invalid_request",
        ),  # past 64 levels
        (b'{"custom_id": "a", "body": ' + b"[" * 5000 + b"]" * 5000 + b"}\n", 1, "invalid_request"),
    ],
    ids=[
        "empty",
        "not-json",
        "same-id",
        "other-url",
        "not-post",
        "body-not-object",
        "too-deep",
        "past-python-s-recursion-limit",
    ],
)
def test_invalid_input_names_the_line(content: bytes, line: int, code: str) -> None:
    with pytest.raises(InputError) as raised:
        parse_input(content, ENDPOINT)
    assert (raised.value.line, raised.value.code) == (line, code)


def test_input_lines_are_sent_unstreamed() -> None:
    lines = parse_input(jsonl([request_line("a", stream=True)]), ENDPOINT)
    assert json.loads(lines[0].body)["stream"] is False


def test_a_line_cut_short_is_not_done() -> None:
    assert done_ids(b'{"custom_id":"a"}\n{"custom_id":"b"}\n{"custom_') == {"a", "b"}


async def test_a_batch_runs_through_the_sdk(tmp_path: Path) -> None:
    cluster = FakeCluster([FakeWorker("w0"), FakeWorker("w1")])
    cluster.workers[1].status = 400  # every line it gets fails: those go to the error file
    async with running_gateway(cluster, settings=settings(tmp_path), api_keys=KEYS) as (_, client):
        api = sdk(client)
        upload = await api.files.create(
            file=("in.jsonl", jsonl([request_line(f"r{i}") for i in range(6)])), purpose="batch"
        )
        assert (upload.purpose, upload.bytes, upload.filename) == (
            "batch",
            len(jsonl([request_line(f"r{i}") for i in range(6)])),
            "in.jsonl",
        )
        batch = await api.batches.create(
            input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h", metadata={"job": "t"}
        )
        assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "t"}
        done = await finished(api, batch.id)
        assert done.status == "completed" and done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed + done.request_counts.failed) == (
            6,
            6,
        )
        output = (await api.files.content(done.output_file_id)).content if done.output_file_id else b""
        errors = (await api.files.content(done.error_file_id)).content if done.error_file_id else b""
        listed = await api.batches.list()
        assert [item.id for item in listed.data] == [batch.id]
    good = [json.loads(line) for line in output.splitlines()]
    bad = [json.loads(line) for line in errors.splitlines()]
    assert len(good) == done.request_counts.completed and len(bad) == done.request_counts.failed
    assert {item["custom_id"] for item in good + bad} == {f"r{i}" for i in range(6)}
    assert all(
        item["response"]["status_code"] == 200 and item["response"]["body"]["worker"] == "w0" for item in good
    )
    assert all(item["response"]["status_code"] == 400 and item["error"]["code"] == "400" for item in bad)
    sent = [body for worker in cluster.workers for body in worker.bodies]
    assert all(body["priority"] == BATCH_PRIORITY and body["stream"] is False for body in sent)


async def test_a_bad_input_file_fails_the_batch(tmp_path: Path) -> None:
    async with running_gateway(
        FakeCluster([FakeWorker("w0")]), settings=settings(tmp_path), api_keys=KEYS
    ) as (_, client):
        api = sdk(client)
        upload = await api.files.create(file=("in.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")
        batch = await finished(
            api,
            (
                await api.batches.create(input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h")
            ).id,
        )
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data is not None
    assert batch.errors.data[0].line == 1 and "method" in (batch.errors.data[0].message or "")


async def test_a_batch_the_gateway_fails_on_ends_failed_not_stuck(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The client reads a generic message; the detail (which may name a server path) is logged."""

    def broken(content: bytes, endpoint: str) -> None:
        raise RuntimeError(f"a defect in reading {tmp_path}")

    monkeypatch.setattr(batch_runner, "parse_input", broken)
    async with running_gateway(
        FakeCluster([FakeWorker("w0")]), settings=settings(tmp_path), api_keys=KEYS
    ) as (_, client):
        api = sdk(client)
        upload = await api.files.create(file=("in.jsonl", jsonl([request_line("a")])), purpose="batch")
        created = await api.batches.create(
            input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h"
        )
        batch = await finished(api, created.id)
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data is not None
    assert batch.errors.data[0].code == "internal_error"
    message = batch.errors.data[0].message or ""
    assert "see the orchestrator log" in message and str(tmp_path) not in message
    assert f"a defect in reading {tmp_path}" in caplog.text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({"input_file_id": "file-nope"}, "file_id"),
    ],
    ids=["endpoint", "window", "unknown-file"],
)
async def test_create_refuses_what_it_cannot_run(tmp_path: Path, fields: dict[str, str], param: str) -> None:
    async with running_gateway(
        FakeCluster([FakeWorker("w0")]), settings=settings(tmp_path), api_keys=KEYS
    ) as (_, client):
        api = sdk(client)
        upload = await api.files.create(file=("in.jsonl", jsonl([request_line("a")])), purpose="batch")
        wanted = {"input_file_id": upload.id, "endpoint": ENDPOINT, "completion_window": "24h", **fields}
        with pytest.raises(openai.APIStatusError) as raised:
            await api.batches.create(**wanted)  # type: ignore[arg-type]
    assert raised.value.status_code in (400, 404) and raised.value.body["param"] == param  # type: ignore[index]


@pytest.mark.parametrize(
    ("content", "headers", "status"),
    [
        (b"x" * 2_000, {"content-type": "application/json"}, 413),
        (b"{}", {"content-type": "text/plain"}, 415),
    ],
    ids=["larger-than-the-body-limit", "not-json"],
)
async def test_create_reads_its_body_as_every_json_route_does(
    tmp_path: Path, content: bytes, headers: dict[str, str], status: int
) -> None:
    small = dataclasses.replace(settings(tmp_path), max_body_bytes=1_000)
    async with running_gateway(FakeCluster([FakeWorker("w0")]), settings=small, api_keys=KEYS) as (_, client):
        response = await client.post(
            "/v1/batches", content=content, headers={**headers, "authorization": "Bearer k"}
        )
    assert response.status_code == status and response.json()["error"]["code"] == status


async def test_a_tenant_sees_only_its_own_files_and_batches(tmp_path: Path) -> None:
    async with running_gateway(
        FakeCluster([FakeWorker("w0")]), settings=settings(tmp_path), api_keys=KEYS
    ) as (_, client):
        mine, theirs = sdk(client, "k"), sdk(client, "k2")
        upload = await mine.files.create(file=("in.jsonl", jsonl([request_line("a")])), purpose="batch")
        with pytest.raises(openai.NotFoundError):
            await theirs.files.retrieve(upload.id)
        with pytest.raises(openai.NotFoundError):
            await theirs.batches.create(input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h")
        assert [item.id async for item in mine.files.list()] == [upload.id]
        assert [item.id async for item in theirs.files.list()] == []


async def test_cancel_stops_the_batch(tmp_path: Path) -> None:
    cluster = FakeCluster([FakeWorker("w0", chunk_delay=0.05, num_chunks=20)])
    lines = [request_line(f"r{i}", stream=True) for i in range(40)]
    async with running_gateway(
        cluster, settings=settings(tmp_path), api_keys=KEYS, model_config={"max_in_flight_per_worker": 1}
    ) as (_, client):
        api = sdk(client)
        upload = await api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await api.batches.create(input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h")
        await wait_for(lambda: cluster.workers[0].num_requests >= 2)
        cancelling = await api.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = await finished(api, batch.id)
    assert done.status == "cancelled" and done.request_counts is not None
    assert done.request_counts.completed < 40 and cluster.workers[0].num_requests < 40


async def test_a_restarted_gateway_resumes_without_repeating_a_line(tmp_path: Path) -> None:
    cluster = FakeCluster([FakeWorker("w0")])
    lines = [request_line(f"r{i}") for i in range(30)]
    model_config = {"max_in_flight_per_worker": 2}
    async with running_gateway(
        cluster, settings=settings(tmp_path), api_keys=KEYS, model_config=model_config
    ) as (_, client):
        api = sdk(client)
        upload = await api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await api.batches.create(input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h")
        await wait_for(lambda: cluster.workers[0].num_requests >= 5)
    # the first gateway is gone mid-batch; a second one over the same folder carries on
    first_run = cluster.workers[0].num_requests
    async with running_gateway(
        cluster, settings=settings(tmp_path), api_keys=KEYS, model_config=model_config
    ) as (_, client):
        api = sdk(client)
        done = await finished(api, batch.id)
        assert done.output_file_id is not None
        output = (await api.files.content(done.output_file_id)).content
    ids = [json.loads(line)["custom_id"] for line in output.splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(30)) and len(ids) == len(set(ids))
    assert (
        done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 30
    )
    assert 5 <= first_run < 30 and cluster.workers[0].num_requests <= 30 + 2


async def test_lines_wait_for_a_worker_instead_of_failing(tmp_path: Path) -> None:
    """No worker ready while the batch runs (every line gets a 503): the lines are sent again until
    one is, and all of them are answered, none written as failed."""
    worker = FakeWorker("w0")
    lines = [request_line(f"r{i}") for i in range(6)]
    async with running_gateway(FakeCluster([worker]), settings=settings(tmp_path), api_keys=KEYS) as (
        app,
        client,
    ):
        worker.is_ready = False
        await wait_for(lambda: not app.state.registry.workers["w0"].is_healthy)
        api = sdk(client)
        upload = await api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await api.batches.create(input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h")
        await asyncio.sleep(1.5)  # every line tried and refused meanwhile
        assert worker.num_requests == 0
        worker.is_ready = True
        done = await finished(api, batch.id)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 0)


class SlowDisk:
    """``BatchStore.append`` taking ``seconds`` a call (a busy disk's fsync), counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
        self.calls = 0
        append = BatchStore.append

        def slow_append(store: BatchStore, record: FileRecord, line: bytes) -> FileRecord:
            self.calls += 1
            time.sleep(seconds)
            return append(store, record, line)

        monkeypatch.setattr(BatchStore, "append", slow_append)


async def loop_lag(until: asyncio.Event) -> float:
    """The longest the event loop came late to a 10 ms sleep until ``until`` is set."""
    worst = 0.0
    while not until.is_set():
        started = time.perf_counter()
        await asyncio.sleep(0.01)
        worst = max(worst, time.perf_counter() - started - 0.01)
    return worst


async def test_answers_are_written_off_the_event_loop_and_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a disk taking 0.5 s a write, the gateway's loop (which relays every interactive stream)
    is never held for it (0.3 s of lag allowed: a loaded machine delays the loop too), and the 12 answers that arrive at once take fewer writes than answers;
    every one of them is on disk and counted."""
    disk = SlowDisk(monkeypatch, 0.5)
    cluster = FakeCluster([FakeWorker("w0")])
    lines = [request_line(f"r{i}") for i in range(12)]
    root_settings = AppSettings(registry=FAST_REGISTRY, batch_dir=tmp_path, batch_concurrency=12)
    model_config = {"max_in_flight_per_worker": 12}
    async with running_gateway(cluster, settings=root_settings, api_keys=KEYS, model_config=model_config) as (
        _,
        client,
    ):
        api = sdk(client)
        upload = await api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await api.batches.create(input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h")
        stop = asyncio.Event()
        lag = asyncio.create_task(loop_lag(stop))
        done = await finished(api, batch.id)
        stop.set()
        worst = await lag
        assert done.output_file_id is not None
        output = (await api.files.content(done.output_file_id)).content
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed == 12
    assert sorted(json.loads(line)["custom_id"] for line in output.splitlines()) == sorted(
        f"r{i}" for i in range(12)
    )
    assert worst < 0.3, f"the event loop was held {worst:.3f} s by a batch write"
    assert 1 <= disk.calls < 12


def a_batch(status: BatchStatus = "in_progress") -> BatchRecord:
    """A stored batch's record of tenant ``team``, for the runner's and the store's own rules."""
    return BatchRecord(
        id="batch-1",
        endpoint=ENDPOINT,
        input_file_id="file-1",
        completion_window="24h",
        status=status,
        created_at=0,
        expires_at=1,
        tenant="team",
    )


@pytest.mark.parametrize(
    ("status", "becomes"),
    [
        ("in_progress", "cancelling"),
        ("validating", "cancelling"),
        ("cancelling", "cancelling"),
        ("completed", "completed"),
        ("cancelled", "cancelled"),
    ],
)
def test_cancelling_changes_only_a_running_batch(status: BatchStatus, becomes: BatchStatus) -> None:
    record = a_batch(status)
    changed = cancelling(record)
    assert changed.status == becomes
    assert (changed.cancelling_at is not None) == (status != becomes)


def test_an_update_waits_for_the_one_under_way(tmp_path: Path) -> None:
    """Two read-change-writes of one record at once (the runner's thread saving counts, the loop
    cancelling): the second reads what the first wrote, so neither change is lost."""
    store = BatchStore(tmp_path)
    record = a_batch()
    tenant = record.tenant
    store.save_batch(record)
    reading = threading.Event()

    def slow_counts(stored: BatchRecord) -> BatchRecord:
        reading.set()
        time.sleep(0.2)
        return stored.model_copy(update={"request_counts": RequestCounts(total=3, completed=2)})

    writer = threading.Thread(target=store.update_batch, args=("batch-1", tenant, slow_counts))
    writer.start()
    assert reading.wait(5.0)
    store.update_batch("batch-1", tenant, cancelling)
    writer.join(5.0)
    stored = store.batch("batch-1", tenant)
    assert stored.status == "cancelling" and stored.request_counts.completed == 2


def test_two_stores_saving_one_record_at_once_never_break_its_file(tmp_path: Path) -> None:
    """A gateway stopping (its last write in a thread) and its successor over the same folder may save
    one batch record at the same moment: each write has its own temporary file, so neither fails and
    the record is always one of them, whole."""
    record = a_batch()
    tenant = record.tenant
    stores = [BatchStore(tmp_path), BatchStore(tmp_path)]
    errors: list[BaseException] = []

    def save_often(store: BatchStore, completed: int) -> None:
        counted = record.model_copy(update={"request_counts": RequestCounts(total=9, completed=completed)})
        try:
            for _ in range(200):
                store.save_batch(counted)
        except OSError as error:
            errors.append(error)

    writers = [threading.Thread(target=save_often, args=(store, n)) for n, store in enumerate(stores, 1)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(30.0)
    assert errors == []
    assert stores[0].batch("batch-1", tenant).request_counts.completed in (1, 2)
    assert [path.name for path in (tmp_path / "batches").iterdir()] == ["batch-1.json"]


def stored_batch(root: Path, lines: list[dict[str, Any]], *, tenant: Any = "team") -> str:
    """A batch left ``in_progress`` by a previous gateway over ``root``; ``tenant`` as its record
    holds it (a whole tenant in records written before names alone were kept). Its id."""
    store = BatchStore(root)
    upload = store.add_file("team", "in.jsonl", "batch", jsonl(lines))
    now = int(time.time())
    record = BatchRecord(
        tenant="team",
        id="batch_left",
        endpoint=ENDPOINT,
        input_file_id=upload.id,
        completion_window="24h",
        status="in_progress",
        created_at=now,
        expires_at=now + 3600,
    )
    stored = {**record.model_dump(), "tenant": tenant}
    (root / "batches" / f"{record.id}.json").write_text(json.dumps(stored))
    return record.id


async def test_a_resumed_batch_has_its_tenant_s_rights_of_now(tmp_path: Path) -> None:
    """The gateway restarted with the tenant narrowed to another model: each line is refused as a
    direct request would be (403), none reaches a worker; an old record holding the whole tenant
    (with its old, wider rights) is read by the tenant's name."""
    batch_id = stored_batch(tmp_path, [request_line("a"), request_line("b")], tenant={"name": "team"})
    narrowed = ApiKeys.of_tenants([("k", Tenant(name="team", models=("other-model",)))])
    cluster = FakeCluster([FakeWorker("w0")])
    async with running_gateway(cluster, settings=settings(tmp_path), api_keys=narrowed) as (_, client):
        api = sdk(client)
        done = await finished(api, batch_id)
        assert done.error_file_id is not None
        errors = [
            json.loads(line) for line in (await api.files.content(done.error_file_id)).content.splitlines()
        ]
        direct = await client.post(
            ENDPOINT, json=request_line("c")["body"], headers={"authorization": "Bearer k"}
        )
    assert cluster.workers[0].num_requests == 0
    assert done.request_counts is not None and done.request_counts.failed == 2
    assert direct.status_code == 403
    assert {line["response"]["status_code"] for line in errors} == {403}
    assert {line["error"]["message"] for line in errors} == {direct.json()["error"]["message"]}


async def test_a_resumed_batch_of_a_removed_tenant_fails(tmp_path: Path) -> None:
    batch_id = stored_batch(tmp_path, [request_line("a")])
    others = ApiKeys.of_tenants([("k2", Tenant(name="other"))])
    cluster = FakeCluster([FakeWorker("w0")])
    async with running_gateway(cluster, settings=settings(tmp_path), api_keys=others):
        store = BatchStore(tmp_path)
        await wait_for(lambda: store.batch(batch_id, "team").is_finished)
    record = store.batch(batch_id, "team")
    assert cluster.workers[0].num_requests == 0 and record.status == "failed" and record.errors is not None
    assert record.errors["data"][0]["code"] == "tenant_removed"
    assert "'team'" in record.errors["data"][0]["message"]


async def test_two_batches_of_one_file_at_once_are_two(tmp_path: Path) -> None:
    worker = FakeWorker("w0")
    async with running_gateway(FakeCluster([worker]), settings=settings(tmp_path), api_keys=KEYS) as (
        app,
        client,
    ):
        worker.is_ready = False  # both stay unfinished, so neither can stand for the other
        await wait_for(lambda: not app.state.registry.workers["w0"].is_healthy)
        api = sdk(client)
        upload = await api.files.create(file=("in.jsonl", jsonl([request_line("a")])), purpose="batch")
        created = [
            await api.batches.create(input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h")
            for _ in range(2)
        ]
        listed = [item.id async for item in api.batches.list()]
        for batch in created:
            await api.batches.cancel(batch.id)
    assert created[0].id != created[1].id and sorted(listed) == sorted(batch.id for batch in created)


def test_a_batch_record_is_never_overwritten_by_a_new_one(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    store.add_batch(a_batch())
    with pytest.raises(FileExistsError):
        store.add_batch(a_batch("validating"))
    assert store.batch("batch-1", "team").status == "in_progress"


def test_parsing_stops_at_the_first_request_past_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rest of a file too long is not read (a bad line after the limit is not the error)."""
    monkeypatch.setattr(batch_lines, "MAX_LINES", 3)
    content = jsonl([request_line(f"r{i}") for i in range(4)]) + b"not json\n"
    with pytest.raises(InputError) as raised:
        parse_input(content, ENDPOINT)
    assert raised.value.line == 4 and "at most 3" in str(raised.value)


async def test_the_input_is_parsed_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parse = batch_runner.parse_input

    def slow_parse(content: bytes, endpoint: str) -> list[BatchLine]:
        time.sleep(0.6)  # a file of many lines
        return parse(content, endpoint)

    monkeypatch.setattr(batch_runner, "parse_input", slow_parse)
    async with running_gateway(
        FakeCluster([FakeWorker("w0")]), settings=settings(tmp_path), api_keys=KEYS
    ) as (_, client):
        api = sdk(client)
        upload = await api.files.create(file=("in.jsonl", jsonl([request_line("a")])), purpose="batch")
        stop = asyncio.Event()
        lag = asyncio.create_task(loop_lag(stop))
        batch = await api.batches.create(input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h")
        done = await finished(api, batch.id)
        stop.set()
        worst = await lag
    assert done.status == "completed"
    assert worst < 0.3, f"the event loop was held {worst:.3f} s parsing the input"


def multipart(file: bytes = b"{}\n", *, extra: bytes = b"") -> bytes:
    return (
        b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n' + extra + b"--B\r\n"
        b'Content-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n' + file + b"\r\n--B--\r\n"
    )


MULTIPART = {"content-type": "multipart/form-data; boundary=B", "authorization": "Bearer k"}


async def test_an_upload_declared_too_large_is_refused_before_it_is_read(tmp_path: Path) -> None:
    small = dataclasses.replace(settings(tmp_path), max_batch_file_bytes=1_000)
    declared = str(1_000 + batch_routes.MULTIPART_SLACK_BYTES + 1)

    async def body() -> AsyncIterator[bytes]:
        yield multipart()  # far less than declared: a refusal that read it would find it cut short

    async with running_gateway(FakeCluster([FakeWorker("w0")]), settings=small, api_keys=KEYS) as (_, client):
        response = await client.post(
            "/v1/files", content=body(), headers={**MULTIPART, "content-length": declared}
        )
    assert response.status_code == 413, response.text


async def test_a_chunked_upload_is_cut_off_at_the_limit(tmp_path: Path) -> None:
    small = dataclasses.replace(settings(tmp_path), max_batch_file_bytes=1_000)
    chunk = b"x" * 1024 * 1024
    num_sent = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal num_sent
        yield multipart(b"").removesuffix(b"\r\n--B--\r\n")
        for _ in range(64):
            num_sent += 1
            yield chunk

    async with running_gateway(FakeCluster([FakeWorker("w0")]), settings=small, api_keys=KEYS) as (_, client):
        response = await client.post("/v1/files", content=body(), headers=MULTIPART)
    assert response.status_code == 413 and num_sent <= 2


async def test_a_slow_upload_gets_408(tmp_path: Path) -> None:
    hasty = dataclasses.replace(settings(tmp_path), body_timeout=0.3)

    async def body() -> AsyncIterator[bytes]:
        yield multipart(b"").removesuffix(b"\r\n--B--\r\n")
        await asyncio.sleep(10)

    async with running_gateway(FakeCluster([FakeWorker("w0")]), settings=hasty, api_keys=KEYS) as (_, client):
        async with asyncio.timeout(5):
            response = await client.post("/v1/files", content=body(), headers=MULTIPART)
    assert response.status_code == 408


async def test_an_upload_takes_one_file(tmp_path: Path) -> None:
    second = b'--B\r\nContent-Disposition: form-data; name="other"; filename="b.jsonl"\r\n\r\n{}\r\n'
    async with running_gateway(
        FakeCluster([FakeWorker("w0")]), settings=settings(tmp_path), api_keys=KEYS
    ) as (_, client):
        response = await client.post("/v1/files", content=multipart(extra=second), headers=MULTIPART)
    assert response.status_code == 400


async def test_a_file_an_unfinished_batch_uses_is_not_deleted(tmp_path: Path) -> None:
    worker = FakeWorker("w0")
    async with running_gateway(FakeCluster([worker]), settings=settings(tmp_path), api_keys=KEYS) as (
        app,
        client,
    ):
        worker.is_ready = False
        await wait_for(lambda: not app.state.registry.workers["w0"].is_healthy)
        api = sdk(client)
        upload = await api.files.create(file=("in.jsonl", jsonl([request_line("a")])), purpose="batch")
        batch = await api.batches.create(input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h")
        with pytest.raises(openai.ConflictError) as refused:
            await api.files.delete(upload.id)
        await api.batches.cancel(batch.id)
        await finished(api, batch.id)
        deleted = await api.files.delete(upload.id)
    assert batch.id in refused.value.message and deleted.deleted


def test_a_damaged_record_is_skipped_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = BatchStore(tmp_path)
    store.save_batch(a_batch())
    (tmp_path / "batches" / "batch-2.json").write_text('{"id": "batch-2", "stat')
    assert [record.id for record in store.batches()] == ["batch-1"]
    assert [record.id for record in store.batches()] == ["batch-1"]
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "batch-2.json" in warnings[0]


@pytest.mark.parametrize("path", ["/v1/files", "/v1/batches"])
async def test_a_page_after_an_unknown_item_is_refused(tmp_path: Path, path: str) -> None:
    async with running_gateway(
        FakeCluster([FakeWorker("w0")]), settings=settings(tmp_path), api_keys=KEYS
    ) as (_, client):
        await sdk(client).files.create(file=("in.jsonl", jsonl([request_line("a")])), purpose="batch")
        response = await client.get(path, params={"after": "nope"}, headers={"authorization": "Bearer k"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "after"


async def test_metadata_keys_longer_than_64_characters_are_refused(tmp_path: Path) -> None:
    async with running_gateway(
        FakeCluster([FakeWorker("w0")]), settings=settings(tmp_path), api_keys=KEYS
    ) as (_, client):
        api = sdk(client)
        upload = await api.files.create(file=("in.jsonl", jsonl([request_line("a")])), purpose="batch")
        with pytest.raises(openai.BadRequestError):
            await api.batches.create(
                input_file_id=upload.id, endpoint=ENDPOINT, completion_window="24h", metadata={"k" * 65: "v"}
            )
        assert [item async for item in api.batches.list()] == []


def test_without_authentication_every_batch_runs_as_anonymous() -> None:
    assert ApiKeys([]).tenant_named("team") is ANONYMOUS
    assert KEYS.tenant_named("team") == Tenant(name="team") and KEYS.tenant_named("gone") is None
