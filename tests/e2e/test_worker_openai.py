"""``herd worker`` as a real process on loopback, driven by the unmodified ``openai`` SDK and raw HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.procs import free_port, running, wait_until
from support.worker_server import WorkerProcess, metric_value, worker_argv, worker_process

from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TOKEN = "e2e-token"
HELLO = [{"role": "user", "content": "What is the capital of France?"}]
# long enough that no machine decodes it between the first token and the hang-up
LONG = 1900


@pytest.fixture(scope="module")
def worker(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    with worker_process(
        tiny_llama, log=log, token=TOKEN, max_body_bytes="100000", max_model_len="2048", kv_memory_gib="0.2"
    ) as process:
        yield process


@pytest.fixture(scope="module")
def client(worker: WorkerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_list_names_the_model(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == ["tiny"]


def test_chat_and_completions(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    completion = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 4


def test_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        max_completion_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_n_choices(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, n=2)
    assert [choice.index for choice in chat.choices] == [0, 1]


def test_logprobs(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == 3
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    completion = client.completions.create(
        model="tiny", prompt="hello", max_tokens=3, logprobs=2, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].logprobs is not None
    assert len(completion.choices[0].logprobs.tokens or []) == 3


def test_stop_strings(client: openai.OpenAI) -> None:
    def greedy(**fields: Any) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model="tiny",
            messages=HELLO,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
            **fields,
        )

    text = greedy().choices[0].message.content or ""
    stop = text[len(text) // 2 :][:2]
    stopped = greedy(stop=[stop]).choices[0]
    assert stopped.message.content == text[: text.index(stop)]
    assert stopped.finish_reason == "stop"


def test_a_seed_reproduces_sampling(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        chat = client.chat.completions.create(
            model="tiny",
            messages=HELLO,
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return chat.choices[0].message.content or ""

    assert sample(7) == sample(7)


def test_an_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=HELLO, max_tokens=1)


def test_request_ids_are_echoed(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=HELLO, max_tokens=1, extra_headers={"X-Request-Id": "req-42"}
    )
    assert raw.headers["x-request-id"] == "req-42"
    assert raw.parse().id == "chatcmpl-req-42"


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b'{"model": "tiny", "messages": [', None),
        (json.dumps({"model": "tiny", "messages": HELLO, "max_tokens": "ten"}).encode(), "max_tokens"),
        (json.dumps({"model": "tiny", "messages": HELLO, "max_tokens": -5}).encode(), "max_tokens"),
        (json.dumps({"model": "tiny", "messages": HELLO, "temperature": 9}).encode(), "temperature"),
        (json.dumps({"model": "tiny", "messages": []}).encode(), "messages"),
        (json.dumps({"model": "tiny", "messages": HELLO * 2000}).encode(), None),
    ],
    ids=[
        "malformed-json",
        "wrong-type",
        "negative-max-tokens",
        "temperature-out-of-range",
        "empty-messages",
        "too-large",
    ],
)
def test_bad_input_is_refused_and_the_worker_keeps_serving(
    worker: WorkerProcess, client: openai.OpenAI, content: bytes, param: str | None
) -> None:
    response = httpx.post(
        f"{worker.url}/v1/chat/completions", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == (413 if len(content) > 100_000 else 400), response.text
    assert response.json()["error"]["param"] == param
    assert client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1).choices


def test_the_internal_port(worker: WorkerProcess) -> None:
    internal = worker.internal_url
    assert httpx.get(f"{internal}{INTERNAL_PATHS.info}").status_code == 401
    info = httpx.get(f"{internal}{INTERNAL_PATHS.info}", headers={TOKEN_HEADER: TOKEN}).json()
    assert info["model"] == "tiny"
    assert info["max_model_len"] == 2048


@pytest.mark.parametrize("is_stream", [True, False], ids=["streaming", "whole-response"])
def test_a_client_disconnect_aborts_the_sequence(worker: WorkerProcess, is_stream: bool) -> None:
    wait_until(lambda: _metric(worker, "vllm:num_requests_running") == 0, timeout=10, what="an idle worker")
    generated_before = _metric(worker, "vllm:generation_tokens_total")
    body = {"model": "tiny", "messages": HELLO, "max_tokens": LONG, "ignore_eos": True, "stream": is_stream}
    with _raw_post(worker, "/v1/chat/completions", body):
        # hang up only once decoding is under way, whatever the machine's speed
        wait_until(
            lambda: _metric(worker, "vllm:generation_tokens_total") > generated_before,
            timeout=30,
            interval=0.01,
            what="the first generated token",
        )
    # the connection is closed: the worker must drop the sequence long before its LONG tokens
    wait_until(
        lambda: _metric(worker, "vllm:num_requests_running") == 0, timeout=10, what="no running request"
    )
    assert _metric(worker, "vllm:generation_tokens_total") - generated_before < LONG


@contextlib.contextmanager
def _raw_post(worker: WorkerProcess, path: str, body: dict[str, Any]) -> Iterator[None]:
    """POST ``body`` on a plain socket, read nothing, and close the socket on leaving."""
    host, port = worker.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + payload)
        yield


def _metric(worker: WorkerProcess, name: str) -> float:
    return metric_value(httpx.get(f"{worker.url}/metrics").text, name)


def test_sigterm_drains_in_flight_work_then_exits(tiny_llama: Path, tmp_path: Path) -> None:
    events: list[str] = []
    first_event = threading.Event()
    log = tmp_path / "worker.log"
    # LONG tokens: the stream must still be running when SIGTERM lands, however fast the machine
    with worker_process(
        tiny_llama, log=log, token=TOKEN, max_model_len="2048", drain_timeout="300"
    ) as worker:
        url = worker.url
        body = {"model": "tiny", "messages": HELLO, "max_tokens": LONG, "ignore_eos": True, "stream": True}

        def consume() -> None:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        events.append(line)
                        first_event.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert first_event.wait(timeout=60)
        os.kill(worker.process.pid, signal.SIGTERM)
        wait_until(
            lambda: httpx.get(f"{url}/ready").status_code == 503, timeout=30, what="/ready turning 503"
        )
        refused = httpx.post(
            f"{url}/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 1}
        )
        reader.join(timeout=300)
        assert worker.process.wait(timeout=30) == 0
    assert refused.status_code == 503
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2]


def test_a_model_that_fails_to_load_exits_nonzero(tiny_llama: Path, tmp_path: Path) -> None:
    broken = tmp_path / "no-weights"
    broken.mkdir()
    for item in tiny_llama.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors"):
            shutil.copy(item, broken / item.name)
    log = tmp_path / "worker.log"
    argv = worker_argv(broken, port=free_port(), internal_port=free_port(), token=TOKEN)
    with running(argv, log=log) as process:
        assert process.wait(timeout=120) == 1
    assert "failed to load" in log.read_text()
