"""The worker's public and internal apps in process (httpx.ASGITransport), on the real engine."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support.asgi_stream import StreamingASGITransport
from support.worker_server import engine_config, sse_data

from herd.api.prompt import PromptRenderer
from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER, KVSnapshot, WorkerStatus
from herd.worker.async_engine import AsyncEngine
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.model_runner import TorchRunner, torch_engine
from herd.worker.outputs import RequestOutput
from herd.worker.sampling_params import SamplingParams
from herd.worker.server import PublicOptions, build_internal_app, build_public_app

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

TOKEN = "secret-token"
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "What is the capital of France?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: Path) -> AsyncIterator[AsyncEngine]:
    config = engine_config(tiny_llama)
    front = AsyncEngine(lambda: torch_engine(config))
    front.start()
    await front.wait_loaded()
    yield front
    await front.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(engine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = build_public_app(engine, PublicOptions("tiny", max_body_bytes=20_000))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        yield client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def internal(engine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = build_internal_app(engine, TOKEN)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://worker", headers={TOKEN_HEADER: TOKEN}
    ) as client:
        yield client


def chat_body(**fields: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": HELLO,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }


async def greedy_text(client: httpx.AsyncClient, max_tokens: int = 6) -> str:
    response = await client.post(CHAT, json=chat_body(max_tokens=max_tokens))
    text: str = response.json()["choices"][0]["message"]["content"]
    return text


async def test_chat_reports_usage_and_echoes_the_request_id(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=chat_body(), headers={"X-Request-Id": "abc-123"})
    assert response.status_code == 200, response.text
    body = response.json()
    prompt = (await client.post("/tokenize", json={"messages": HELLO})).json()
    assert response.headers["x-request-id"] == "abc-123"
    assert body["id"] == "chatcmpl-abc-123"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == prompt["count"]
    assert body["usage"]["completion_tokens"] == 6
    assert body["usage"]["total_tokens"] == prompt["count"] + 6


async def test_chat_equals_a_completion_of_the_same_tokens(client: httpx.AsyncClient) -> None:
    tokens = (await client.post("/tokenize", json={"messages": HELLO})).json()["tokens"]
    body = {"model": "tiny", "prompt": tokens, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    completion = await client.post("/v1/completions", json=body)
    assert completion.json()["choices"][0]["text"] == await greedy_text(client)


async def test_streamed_chat_matches_the_whole_response(client: httpx.AsyncClient) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True})
    response = await client.post(CHAT, json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_data(response.text)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(event["choices"][0]["delta"].get("content", "") for event in events[1:-2])
    assert content == await greedy_text(client)
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 6


async def test_n_prompts_times_n_choices(client: httpx.AsyncClient) -> None:
    body = {
        "model": "tiny",
        "prompt": ["hello world", "the quick brown fox"],
        "n": 2,
        "max_tokens": 3,
        "ignore_eos": True,
    }
    response = (await client.post("/v1/completions", json=body)).json()
    assert [choice["index"] for choice in response["choices"]] == [0, 1, 2, 3]
    counts = [
        len((await client.post("/tokenize", json={"prompt": p})).json()["tokens"]) for p in body["prompt"]
    ]
    assert response["usage"]["prompt_tokens"] == sum(counts)
    assert response["usage"]["completion_tokens"] == 12


async def test_a_shared_prefix_is_served_from_the_cache(client: httpx.AsyncClient) -> None:
    story = "Tell me a story about a cat who lived in a library. " * 8
    first = await client.post(
        CHAT, json=chat_body(messages=[{"role": "user", "content": story}], max_tokens=1)
    )
    again = await client.post(
        CHAT, json=chat_body(messages=[{"role": "user", "content": story}], max_tokens=1)
    )
    num_prompt = first.json()["usage"]["prompt_tokens"]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= num_prompt - 16


async def test_a_stop_string_ends_the_text_before_it(client: httpx.AsyncClient) -> None:
    text = await greedy_text(client, max_tokens=12)
    stop = text[len(text) // 2 :][:2]
    response = (await client.post(CHAT, json=chat_body(max_tokens=12, stop=[stop]))).json()
    assert response["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert response["choices"][0]["finish_reason"] == "stop"


async def test_logprobs_in_both_shapes(client: httpx.AsyncClient) -> None:
    chat = (await client.post(CHAT, json=chat_body(max_tokens=3, logprobs=True, top_logprobs=2))).json()
    entries = chat["choices"][0]["logprobs"]["content"]
    assert len(entries) == 3
    assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 for entry in entries)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "logprobs": 2, "ignore_eos": True}
    legacy = (await client.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(legacy["top_logprobs"]) == 3
    assert legacy["text_offset"][0] == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": HELLO, "max_tokens": "many"}, "max_tokens"),
        ({"messages": HELLO, "max_tokens": -1}, "max_tokens"),
        ({"messages": HELLO, "temperature": 3}, "temperature"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"messages": HELLO, "logprobs": False, "top_logprobs": 2}, None),
        ({"messages": HELLO, "max_tokens": 1000}, "max_tokens"),
        ({"messages": HELLO, "max_completion_tokens": 1000}, "max_completion_tokens"),
        ({"messages": HELLO, "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
        ({"messages": [{"role": "user", "content": "fox " * 300}]}, "messages"),
    ],
    ids=[
        "wrong-type",
        "negative-max-tokens",
        "temperature-out-of-range",
        "empty-messages",
        "bad-role",
        "top-logprobs-without-logprobs",
        "max-tokens-over-context",
        "max-completion-tokens-over-context",
        "min-over-max",
        "prompt-over-context",
    ],
)
async def test_bad_requests_get_400_naming_the_field(
    client: httpx.AsyncClient, body: dict[str, Any], param: str | None
) -> None:
    response = await client.post(CHAT, json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert (await client.post(CHAT, json=chat_body(max_tokens=1))).status_code == 200


async def test_the_prompt_limit_is_named(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json={"model": "tiny", "prompt": "fox " * 300})
    assert response.status_code == 400
    assert "maxModelLen is 256" in response.json()["error"]["message"]


async def test_malformed_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(
        CHAT, content=b'{"model": "tiny", "messages": [', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


async def test_an_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=chat_body(model="gpt-5"))
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"


async def test_a_large_body_is_413(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=chat_body(messages=[{"role": "user", "content": "x" * 30_000}]))
    assert response.status_code == 413
    assert "20000 bytes" in response.json()["error"]["message"]


async def test_unknown_fields_and_text_parts_are_accepted(client: httpx.AsyncClient) -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital"},
                {"type": "text", "text": " of France?"},
            ],
        }
    ]
    response = await client.post(CHAT, json=chat_body(messages=messages, frobnicate=True, cache_salt="s"))
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == await greedy_text(client)


async def test_models_tokenize_detokenize(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 256
    tokens = (await client.post("/tokenize", json={"prompt": "hello world"})).json()
    assert tokens["max_model_len"] == 256
    text = (await client.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
    assert text["prompt"] == "hello world"


async def test_metrics_use_the_vllm_names(client: httpx.AsyncClient) -> None:
    await client.post(CHAT, json=chat_body(max_tokens=2))
    text = (await client.get("/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:cache_config_info",
        "vllm:request_success_total",
        "herd_engine_step_seconds",
        "herd_kv_events_total",
        "herd_gc_pause_seconds_count",
    ):
        assert f"\n{name}" in text, name
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny"}' in text


async def test_the_internal_port_needs_the_token(engine: AsyncEngine) -> None:
    app = build_internal_app(engine, TOKEN)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        missing = await client.get(INTERNAL_PATHS.load)
        wrong = await client.get(INTERNAL_PATHS.load, headers={TOKEN_HEADER: "nope"})
    assert missing.status_code == wrong.status_code == 401
    assert TOKEN_HEADER in missing.json()["error"]["message"]


async def test_internal_info_and_load(internal: httpx.AsyncClient) -> None:
    info = (await internal.get(INTERNAL_PATHS.info)).json()
    assert info["model"] == "tiny"
    assert info["block_size"] == 16
    load = (await internal.get(INTERNAL_PATHS.load)).json()
    assert load["num_total_blocks"] > 0
    assert load["is_draining"] is False


async def test_kv_events_agree_with_the_snapshot(
    client: httpx.AsyncClient, internal: httpx.AsyncClient
) -> None:
    await client.post(
        CHAT, json=chat_body(messages=[{"role": "user", "content": "Kubernetes runs pods on nodes. " * 4}])
    )
    batch = (await internal.get(INTERNAL_PATHS.kv_events, params={"after": -1})).json()
    held: set[int] = set()
    for event in batch["events"]:
        if event["kind"] == "stored":
            held.update(event["block_hashes"])
        elif event["kind"] == "removed":
            held.difference_update(event["block_hashes"])
        else:
            held.clear()
    snapshot = (await internal.get(INTERNAL_PATHS.kv_snapshot)).json()
    assert held and held == set(snapshot["block_hashes"])
    assert snapshot["seq"] == batch["events"][-1]["seq"]
    assert batch["epoch"] == snapshot["epoch"]


async def test_kv_events_long_poll_returns_nothing_new(internal: httpx.AsyncClient) -> None:
    snapshot = (await internal.get(INTERNAL_PATHS.kv_snapshot)).json()
    batch = (
        await internal.get(INTERNAL_PATHS.kv_events, params={"after": snapshot["seq"], "wait": 0.2})
    ).json()
    assert batch["events"] == []
    too_long = await internal.get(INTERNAL_PATHS.kv_events, params={"wait": 60})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "query.wait"


async def test_the_status_stream_resumes_after_a_position_and_carries_new_events(
    engine: AsyncEngine, client: httpx.AsyncClient
) -> None:
    """The stream the orchestrator follows: from its position it sends only newer events (no
    snapshot), with the load; a request's blocks arrive on it as events, in order."""
    transport = StreamingASGITransport(build_internal_app(engine, TOKEN))
    async with httpx.AsyncClient(
        transport=transport, base_url="http://worker", headers={TOKEN_HEADER: TOKEN}
    ) as internal:
        snapshot = KVSnapshot.model_validate_json((await internal.get(INTERNAL_PATHS.kv_snapshot)).content)
        query = {"epoch": snapshot.epoch, "after": snapshot.seq, "interval": 0.01, "heartbeat": 0.05}
        statuses: list[WorkerStatus] = []
        async with internal.stream("GET", INTERNAL_PATHS.status, params=query) as response:
            lines = response.aiter_lines()
            statuses.append(WorkerStatus.model_validate_json(await anext(lines)))
            prompt = [{"role": "user", "content": "Llamas carry packs over the mountain passes. " * 4}]
            await client.post(CHAT, json=chat_body(messages=prompt))
            async for line in lines:
                statuses.append(status := WorkerStatus.model_validate_json(line))
                if status.events:
                    break
    first, last = statuses[0], statuses[-1]
    assert first.is_ready and first.snapshot is None and first.epoch == snapshot.epoch
    assert first.load.num_total_blocks > 0
    assert not any(status.snapshot for status in statuses)
    assert last.events[0].seq == snapshot.seq + 1 and last.events[0].kind == "stored"


class HeldEngine(LLMEngine):
    """The real engine, but a step runs only when the test grants one.

    A held step is a short no-op, so the engine thread still runs commands (adds, aborts) between
    held steps, and a running request cannot finish however fast the machine is.
    """

    def __init__(self, config: EngineConfig) -> None:
        renderer = PromptRenderer.from_pretrained(config.model_path)
        super().__init__(config, TorchRunner(config, renderer.eos_token_ids), renderer)
        self.grants = threading.Semaphore(0)

    def step(self) -> list[RequestOutput]:
        if not self.grants.acquire(timeout=0.01):
            return []
        return super().step()


async def test_a_full_queue_is_429_with_retry_after(tiny_llama: Path) -> None:
    held = HeldEngine(engine_config(tiny_llama, maxBatchSize=1, maxQueueLen=1))
    busy = AsyncEngine(lambda: held)
    busy.start()
    await busy.wait_loaded()
    app = build_public_app(busy, PublicOptions("tiny"))

    async def generate_long(request_id: str) -> None:
        # Straight into the engine: one request runs, the other fills the queue of one.
        prompt = busy.renderer.encode("Once upon a time there was a cat")
        async for _ in busy.generate(request_id, prompt, SamplingParams(max_tokens=190, ignore_eos=True)):
            pass

    async def until(is_true: Callable[[], bool], what: str) -> None:
        for _ in range(1500):
            if is_true():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{what} did not happen within 30 s")

    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://worker"
        ) as client:
            # One at a time: both adds in one batch of commands would find the first still queued.
            long = [asyncio.create_task(generate_long("long-0"))]
            await until(lambda: busy.load_report().num_waiting == 1, "long-0 queued")
            held.grants.release()  # one step: long-0 is scheduled, and no further step lets it finish
            await until(lambda: busy.load_report().num_running == 1, "long-0 running")
            long.append(asyncio.create_task(generate_long("long-1")))
            await until(lambda: busy.load_report().num_waiting == 1, "long-1 queued")
            # held steps would never serve it: a queued (not refused) request fails here, not at the timeout
            refused = await asyncio.wait_for(client.post(CHAT, json=chat_body(max_tokens=1)), 30)
            for task in long:
                task.cancel()
            await asyncio.gather(*long, return_exceptions=True)
    finally:
        await busy.stop()
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize(
    ("given", "is_kept"),
    [("abc-123", True), ("x" * 129, False), ("bad\nid", False), ("", False)],
    ids=["kept", "too-long", "control-character", "empty"],
)
async def test_request_ids_are_echoed_on_errors_too(
    client: httpx.AsyncClient, given: str, is_kept: bool
) -> None:
    response = await client.post(CHAT, json=chat_body(model="other"), headers={"X-Request-Id": given})
    assert response.status_code == 404
    echoed = response.headers["x-request-id"]
    assert (echoed == given) is is_kept
    assert echoed
