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
from herd.cli.loadgen.runner import first_model
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
        (
            ["--input-len", "99999999999"],
            "herd bench: --input-len: a length must be at most 1048576 (past any model's context window), "
            "got '99999999999'",
        ),
        (
            ["--request-rate", "1e-9", "--num-requests", "5"],
            "herd bench: --request-rate 1e-09: 5 requests would take about 5.79e+04 days to send, past the "
            "week a paced run may last: raise --request-rate, lower --num-requests or end the run with "
            "--duration",
        ),
        (["--request-rate", "inf"], "herd bench: --request-rate: Input should be a finite number"),
        (["--duration", "nan"], "herd bench: --duration: Input should be a finite number"),
    ],
    ids=[
        "length",
        "concurrency",
        "extra-body",
        "absurd-length",
        "tiny-rate",
        "infinite-rate",
        "nan-duration",
    ],
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


async def test_a_low_rate_run_ends_at_its_duration() -> None:
    started = time.monotonic()
    # The first gap is drawn at about 11 days: only the deadline can end the wait.
    run = _run(FakeOpenAI(), concurrency=None, request_rate=1e-6, num_requests=None, duration_s=0.3)
    report = await asyncio.wait_for(run, 10)
    assert report["num_completed"] == 1
    assert time.monotonic() - started < 5.0


def _streaming(chunk: str) -> httpx.MockTransport:
    """A server whose every other answer carries ``chunk`` before a well-formed end."""
    answers = 0

    def answer(request: httpx.Request) -> httpx.Response:
        nonlocal answers
        answers += 1
        end = json.dumps({"choices": [{"delta": {"content": "w"}, "finish_reason": "stop"}]})
        lines = [chunk, end] if answers % 2 else [end]
        body = "".join(f"data: {line}\n\n" for line in [*lines, "[DONE]"])
        return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(answer)


@pytest.mark.parametrize(
    ("chunk", "reason"),
    [
        ("[1, 2]", "not a JSON object"),
        ("5", "not a JSON object"),
        ('"text"', "not a JSON object"),
        ("null", "not a JSON object"),
        ("{not json", "Invalid JSON: key must be a string at line 1 column 2"),
        ('{"choices": 5}', "choices: Input should be a valid array"),
        ('{"choices": [1]}', "choices.0: not a JSON object"),
        ('{"choices": [{"delta": "x"}]}', "choices.0.delta: not a JSON object"),
        ('{"choices": [{"delta": {"content": 5}}]}',
         "choices.0.delta.content: Input should be a valid string"),
        ('{"choices": [{"text": ["a"]}]}', "choices.0.text: Input should be a valid string"),
        ('{"choices": [{"finish_reason": 3}]}', "choices.0.finish_reason: Input should be a valid string"),
        ('{"usage": 5}', "usage: not a JSON object"),
        ('{"usage": {"prompt_tokens": "many"}}',
         "usage.prompt_tokens: Input should be a valid integer, unable to parse string as an integer"),
        ('{"usage": {"completion_tokens": -1}}',
         "usage.completion_tokens: Input should be greater than or equal to 0"),
        ('{"usage": {"prompt_tokens_details": 7}}', "usage.prompt_tokens_details: not a JSON object"),
    ],
    ids=["list", "number", "string", "null", "not-json", "choices-number", "choice-number", "delta-string",
         "content-number", "text-list", "finish-number", "usage-number", "tokens-string", "tokens-negative",
         "details-number"],
)  # fmt: skip
async def test_a_malformed_chunk_fails_its_request_not_the_run(chunk: str, reason: str) -> None:
    report = await run_benchmark(_config(model="m", concurrency=1), transport=_streaming(chunk))
    assert (report["num_completed"], report["num_errors"]) == (3, 3)
    assert report["errors"] == {f"malformed stream chunk: {reason}": 3}


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("[1]", "not a JSON object"),
        ('{"data": "abc"}', "data: Input should be a valid array"),
        ('{"data": [5]}', "data.0: not a JSON object"),
        ('{"data": [{"id": 5}]}', "data.0.id: Input should be a valid string"),
        ('{"data": []}', "data: List should have at least 1 item"),
    ],
    ids=["list", "data-string", "card-number", "id-number", "no-models"],
)
async def test_a_malformed_model_list_names_the_fix(body: str, reason: str) -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body.encode()))
    async with httpx.AsyncClient(base_url="http://fake", transport=transport) as client:
        with pytest.raises(RuntimeError) as caught:
            await first_model(client)
    assert str(caught.value).startswith(f"could not list models at http://fake/v1/models ({reason}")
    assert str(caught.value).endswith("; pass --model")
