"""``herd bench --workload trace``: the replay sends exactly the trace's requests, paced by its timestamps."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.fake_openai import FakeOpenAI, serving

from herd.cli.loadgen import BenchConfig, run_benchmark
from herd.cli.loadgen.traces import TRACE_SPEC, TraceRequest, dump_trace, generate, trace_workload
from herd.cli.loadgen.workloads import Message, RequestSpec, TraceWorkload
from herd.cli.main import main

SESSION_HEADER = "x-session-id"


@pytest.fixture
def trace(tmp_path: Path) -> tuple[Path, list[TraceRequest]]:
    spec = {"kind": "multi-turn", "num_sessions": 3, "num_turns": 3, "user_len": "4:8", "output_len": "2:4"}
    requests = generate(TRACE_SPEC.validate_python(spec), seed=1)
    path = tmp_path / "chat.jsonl"
    dump_trace(requests, path)
    return path, requests


def _sent(server: FakeOpenAI) -> list[tuple[str, str, int]]:
    return [
        (r["headers"][SESSION_HEADER], repr(r["body"]["messages"]), r["body"]["max_tokens"])
        for r in server.requests
    ]


def _expected(requests: list[TraceRequest]) -> list[tuple[str, str, int]]:
    return [(r.session_id, repr([m.model_dump() for m in r.messages]), r.output_length) for r in requests]


async def _replay(path: Path, **fields: Any) -> tuple[FakeOpenAI, dict[str, Any]]:
    server = FakeOpenAI()
    config = BenchConfig(url="http://fake/v1", workload="trace", trace=path, **fields)
    report = await run_benchmark(config, transport=httpx.ASGITransport(app=server.app()))
    return server, report


async def test_one_at_a_time_the_replay_sends_the_trace_in_order(
    trace: tuple[Path, list[TraceRequest]],
) -> None:
    path, requests = trace
    server, report = await _replay(path, concurrency=1, num_requests=len(requests))
    assert report["num_completed"] == len(requests) == 9
    assert _sent(server) == _expected(requests)


@pytest.mark.parametrize(
    "load",
    [{"concurrency": 4}, {"request_rate": 1000.0}, {"request_rate": 1000.0, "concurrency": 2}],
    ids=["closed-loop", "rate", "rate-capped"],
)
async def test_every_load_mode_sends_exactly_the_trace(
    trace: tuple[Path, list[TraceRequest]], load: dict[str, Any]
) -> None:
    path, requests = trace
    server, report = await _replay(path, num_requests=len(requests), **load)
    assert report["num_completed"] == len(requests)
    assert Counter(_sent(server)) == Counter(_expected(requests))


@pytest.mark.parametrize(
    ("timestamps", "rate", "gaps"),
    [
        ([0, 100, 100, 400], 7.5, [0.1, 0.0, 0.3, 0.3]),
        ([0, 100, 100, 400], 15.0, [0.05, 0.0, 0.15, 0.15]),
        ([0, 1000], 1.0, [1.0, 1.0]),
        ([5, 5, 5], 4.0, [0.25, 0.25]),
    ],
    ids=["the-traces-own-rate", "twice-as-fast", "two-requests", "all-at-once"],
)
def test_a_rate_keeps_the_traces_gaps_scaled_to_it(
    timestamps: list[int], rate: float, gaps: list[float]
) -> None:
    specs = [RequestSpec(messages=[{"role": "user", "content": "hi"}], max_tokens=1) for _ in timestamps]
    workload = TraceWorkload(specs, timestamps)
    assert [workload.arrival_gap_s(random.Random(0), rate) for _ in gaps] == pytest.approx(gaps)


def _specs(*sessions: str) -> list[RequestSpec]:
    """A request per session name: a lower-case name's requests extend one conversation, an upper-case
    name's are a tenant's independent questions."""
    history: dict[str, list[Message]] = {}
    specs = []
    for number, session in enumerate(sessions):
        turn: Message = {"role": "user", "content": str(number)}
        messages = [*history.get(session, []), turn] if session.islower() else [turn]
        history[session] = messages
        specs.append(RequestSpec(messages=messages, max_tokens=1, session_id=session))
    return specs


@pytest.mark.parametrize(
    ("sessions", "steps", "expected"),
    [
        (["a", "a", "b"], ["next", "next", "done 0", "next"], [0, 2, 1]),
        (["a", "b", "a", "b"], ["next", "next", "done 1", "next", "done 0", "next"], [0, 1, 3, 2]),
        (["a", "a"], ["next", "next"], [0, 1]),
        (["a", "a", "b"], ["next", "done 0", "next", "next"], [0, 1, 2]),
        (["T", "T", "T"], ["next", "next", "next"], [0, 1, 2]),
    ],
    ids=[
        "a-turn-waits-for-its-answer",
        "sessions-take-turns",
        "none-ready-sends-the-first",
        "answered-in-order",
        "a-tenants-questions-never-wait",
    ],
)
def test_a_request_that_extends_another_waits_for_its_answer(
    sessions: list[str], steps: list[str], expected: list[int]
) -> None:
    specs = _specs(*sessions)
    workload = TraceWorkload(specs, list(range(len(specs))))
    sent = []
    for step in steps:
        if step == "next":
            sent.append(specs.index(workload.next_request()))
        else:
            workload.complete(specs[int(step.split()[1])], "answer")
    assert sent == expected


async def test_a_closed_loop_keeps_each_sessions_turns_in_order(
    trace: tuple[Path, list[TraceRequest]],
) -> None:
    path, requests = trace
    server, _ = await _replay(path, concurrency=4, num_requests=len(requests))
    sent, expected = _sent(server), _expected(requests)
    for session in {r.session_id for r in requests}:
        assert [s for s in sent if s[0] == session] == [e for e in expected if e[0] == session]


def test_each_request_carries_its_session_header() -> None:
    [request] = generate(
        TRACE_SPEC.validate_python({"kind": "shared-prefix", "num_groups": 1, "prompts_per_group": 1}), 0
    )
    [spec] = trace_workload([request], "X-Tenant").specs
    assert spec.headers == {"X-Tenant": "group-0"}
    assert spec.session_id == "group-0"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--num-requests", "10"], "--num-requests 10 is more than the 9 requests of"),
        (["--workload", "synthetic"], "--workload trace replays --trace FILE.jsonl: give both or neither"),
    ],
    ids=["beyond-the-trace", "trace-without-the-workload"],
)
def test_the_cli_refuses_a_replay_it_cannot_do(
    trace: tuple[Path, list[TraceRequest]],
    options: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, _ = trace
    args = ["bench", "--url", "http://127.0.0.1:9", "--workload", "trace", "--trace", str(path), *options]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_a_malformed_trace_fails_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0}\n')
    assert main(["bench", "--url", "http://127.0.0.1:9", "--workload", "trace", "--trace", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"herd bench: {path} line 1: session_id: Field required")


def test_the_cli_replays_the_whole_trace_over_http(
    trace: tuple[Path, list[TraceRequest]], tmp_path: Path
) -> None:
    path, requests = trace
    server = FakeOpenAI()
    out = tmp_path / "report.json"
    with serving(server.app()) as url:
        args = ["bench", "--url", url, "--workload", "trace", "--trace", str(path), "--concurrency", "1"]
        assert main([*args, "--json-out", str(out), "--quiet"]) == 0
    report = json.loads(out.read_text())
    assert report["num_completed"] == len(requests)
    assert report["config"]["trace"] == str(path)
    assert _sent(server) == _expected(requests)
