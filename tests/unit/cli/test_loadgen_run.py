"""``herd bench`` against a fake OpenAI server: request shapes, load modes, errors, and the CLI."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.fake_openai import FakeOpenAI, serving

from herd.cli.loadgen import BenchConfig, run_benchmark
from herd.cli.main import main


def _config(**fields: Any) -> BenchConfig:
    defaults: dict[str, Any] = {
        "url": "http://fake/v1",
        "concurrency": 2,
        "num_requests": 6,
        "output_len": "3",
    }
    return BenchConfig(**(defaults | fields))


async def _run(server: FakeOpenAI, **fields: Any) -> dict[str, Any]:
    return await run_benchmark(_config(**fields), transport=httpx.ASGITransport(app=server.app()))


@pytest.mark.parametrize(
    ("fields", "path", "expected_keys"),
    [
        (
            {},
            "/v1/chat/completions",
            {"model", "messages", "max_tokens", "stream", "stream_options", "ignore_eos"},
        ),
        (
            {"api": "completions"},
            "/v1/completions",
            {"model", "prompt", "max_tokens", "stream", "stream_options", "ignore_eos"},
        ),
        (
            {"ignore_eos": False, "include_usage": False},
            "/v1/chat/completions",
            {"model", "messages", "max_tokens", "stream"},
        ),
        (
            {"extra_body": {"cache_salt": "t1"}},
            "/v1/chat/completions",
            {"model", "messages", "max_tokens", "stream", "stream_options", "ignore_eos", "cache_salt"},
        ),
    ],
    ids=["chat", "completions", "plain-openai", "extra-body"],
)
async def test_request_shapes(fields: dict[str, Any], path: str, expected_keys: set[str]) -> None:
    server = FakeOpenAI()
    report = await _run(server, **fields)
    assert report["num_completed"] == 6
    assert report["model"] == "fake-model"
    for request in server.requests:
        assert request["path"] == path
        assert set(request["body"]) == expected_keys
        assert request["body"]["stream"] is True
        assert request["body"]["max_tokens"] == 3


async def test_a_strict_server_accepts_only_the_plain_openai_shape() -> None:
    strict = FakeOpenAI(reject_unknown=True)
    rejected = await _run(strict)
    assert rejected["num_errors"] == 6
    assert next(iter(rejected["errors"])).startswith("HTTP 422: unknown fields ['ignore_eos']")
    accepted = await _run(FakeOpenAI(reject_unknown=True), ignore_eos=False)
    assert accepted["num_errors"] == 0


async def test_usage_gives_token_counts_cache_hits_and_worker_shares() -> None:
    report = await _run(FakeOpenAI(), input_len="40", num_requests=8)
    assert report["total_output_tokens"] == 24
    assert report["total_input_tokens"] == 8 * 40
    assert report["prefix_cache_hit_rate"] == 0.25
    assert report["worker_share"] == {"worker-a": 0.5, "worker-b": 0.5}


@pytest.mark.parametrize(
    ("fail_mode", "num_errors", "message"),
    [
        ("http", 3, "HTTP 503: no worker available"),
        ("event", 9, "stream error: worker died"),
        ("truncate", 9, "the stream closed before [DONE]"),
    ],
    ids=["http-error", "error-event", "truncated-stream"],
)
async def test_failures_are_counted_by_message(fail_mode: str, num_errors: int, message: str) -> None:
    report = await _run(FakeOpenAI(fail_mode=fail_mode), num_requests=9)
    assert report["num_errors"] == num_errors
    assert report["num_completed"] == 9 - num_errors
    assert next(iter(report["errors"])).startswith(message)


async def test_a_complete_answer_without_done_counts_as_completed() -> None:
    report = await _run(FakeOpenAI(fail_mode="no-done"), num_requests=4)
    assert report["num_errors"] == 0
    assert report["num_completed"] == 4


async def test_hit_rate_is_unknown_when_the_server_reports_no_cache_details() -> None:
    report = await _run(FakeOpenAI(fail_mode="no-cache-details"), num_requests=4)
    assert report["num_completed"] == 4
    assert report["prefix_cache_hit_rate"] is None


async def test_multi_turn_sends_the_session_header_and_a_growing_conversation() -> None:
    server = FakeOpenAI()
    report = await _run(server, workload="multi-turn", num_turns=3, concurrency=1, num_requests=6)
    assert report["num_completed"] == 6
    sessions = [request["headers"]["x-session-id"] for request in server.requests]
    assert len(set(sessions)) == 2
    assert [len(request["body"]["messages"]) for request in server.requests] == [1, 3, 5, 1, 3, 5]
    assert server.requests[1]["body"]["messages"][1] == {"role": "assistant", "content": "w0 w1 w2 "}


async def test_concurrency_bounds_requests_in_flight() -> None:
    server = FakeOpenAI(token_delay_s=0.01)
    in_flight: list[int] = []

    all_in = asyncio.Event()

    class Counting(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.ASGITransport(app=server.app())
            self.open = 0

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            self.open += 1
            in_flight.append(self.open)
            if self.open == 3:
                all_in.set()
            # The first requests wait for the third, so a stalled loop cannot let one finish first;
            # with a concurrency below 3 the third never comes: one bounded wait, then the count fails.
            if request.url.path.endswith("/completions"):  # not the model lookup before the run
                try:
                    await asyncio.wait_for(all_in.wait(), 10)
                except TimeoutError:
                    all_in.set()
            try:
                return await self.inner.handle_async_request(request)
            finally:
                self.open -= 1

    report = await run_benchmark(_config(concurrency=3, num_requests=12), transport=Counting())
    assert report["num_completed"] == 12
    assert max(in_flight) == 3


async def test_request_rate_and_duration_modes_stop_on_time() -> None:
    started = time.monotonic()
    by_rate = await _run(FakeOpenAI(), concurrency=None, request_rate=200.0, num_requests=20)
    assert by_rate["num_completed"] == 20
    assert time.monotonic() - started < 5.0  # 20 arrivals at 200/s take about 0.1 s
    by_time = await _run(FakeOpenAI(token_delay_s=0.02), num_requests=None, duration_s=0.3)
    # A request of 3 tokens takes at least 2 x 0.02 s, however fast the machine: each of the 2
    # loops can start at most 0.3 // 0.04 + 1 requests before the deadline. A slow machine only
    # completes fewer, but each loop starts one at once.
    assert 1 <= by_time["num_completed"] <= 2 * (0.3 // 0.04 + 1)


def test_cli_against_a_streaming_loopback_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = FakeOpenAI(first_token_delay_s=0.05, token_delay_s=0.02)
    out = tmp_path / "report.json"
    with serving(server.app()) as url:
        code = main(
            ["bench", "--url", url, "--workload", "shared-prefix", "--num-tenants", "2", "--prefix-len", "30",
             "--input-len", "10", "--output-len", "4", "--concurrency", "2", "--num-requests", "6",
             "--json-out", str(out)]
        )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["num_completed"] == 6
    assert report["ttft_ms"]["p50"] >= 45.0
    assert 15.0 <= report["itl_ms"]["p50"] <= 200.0
    assert report["e2e_ms"]["p50"] >= report["ttft_ms"]["p50"] + 3 * 15.0
    assert report["config"]["workload"] == "shared-prefix"
    assert "api_key" not in report["config"]
    captured = capsys.readouterr()
    assert "TTFT" in captured.out
    assert "worker-a" in captured.out
    assert "6 done, 0 errors" in captured.err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--input-len", "9:1"], "herd bench: --input-len: a length range needs 0 < LOW <= HIGH, got '9:1'"),
        (["--concurrency", "0"], "herd bench: --concurrency: Input should be greater than or equal to 1"),
        (["--extra-body", "[1]"], "herd bench: --extra-body must be a JSON object, got list"),
    ],
    ids=["length", "concurrency", "extra-body"],
)
def test_cli_names_the_option_to_fix(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--url", "http://127.0.0.1:9", "--api-key", "secret", *options]) == 2
    err = capsys.readouterr().err
    assert err.strip() == message


async def test_rate_mode_respects_a_concurrency_cap() -> None:
    server = FakeOpenAI(token_delay_s=0.02)
    report = await _run(server, concurrency=1, request_rate=1000.0, num_requests=5)
    assert report["num_completed"] == 5
    assert report["e2e_ms"]["p99"] < report["duration_s"] * 1000 / 3


async def test_an_unreachable_server_names_the_fix() -> None:
    with pytest.raises(RuntimeError, match="pass --model"):
        await run_benchmark(_config(url="http://127.0.0.1:9", timeout_s=2.0))
