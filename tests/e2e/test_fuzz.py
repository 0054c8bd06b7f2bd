"""Schemathesis against the OpenAPI schemas of a real worker and a real orchestrator (issue 12, item 7).

Each server is read from its own ``GET /openapi.json``; every operation gets generated requests, valid
ones and invalid ones (schemathesis's positive and negative modes), sent over loopback to the running
process. Every answer must be below 500, and every error must be the OpenAI envelope
``{"error": {"message", "type", "param", "code"}}``. Afterwards the server must still serve a normal
request, the worker must be healthy and its free KV blocks back to their starting count. The number
of requests actually sent is counted and asserted.

``HERD_FUZZ_REQUESTS`` sets the requests per server (``make fuzz`` raises it); ``HERD_FUZZ_SEED``
picks another deterministic run. A failure lists each problem with a curl command that reproduces it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import hypothesis
import pytest
import requests
import schemathesis

# Imported at collection, not lazily inside the fuzz run: pytest rewrites this plugin's modules as it
# imports them, and CPython 3.11.7's ast.parse failed there once with "AST constructor recursion depth
# mismatch" (a SystemError of the interpreter, not of herd).
import schemathesis.specs.openapi.schemas
from hypothesis import HealthCheck, Phase
from schemathesis import Case, GenerationMode
from schemathesis.schemas import APIOperation
from support.live_cluster import (
    ENVELOPE_KEYS,
    LiveGateway,
    WorkerPorts,
    chat_body,
    live_orchestrator,
    live_worker,
    write_manifest,
)
from support.procs import wait_until

NUM_REQUESTS = int(os.environ.get("HERD_FUZZ_REQUESTS", "600"))
"""Generated requests per server; two servers make ``make test``'s 1,200 (about 40 a second here)."""
SEED = int(os.environ.get("HERD_FUZZ_SEED", "0"))
MAX_MODEL_LEN = 64
"""Short enough that any request the worker accepts costs a few milliseconds of the tiny model."""
MAX_PROBLEMS_SHOWN = 20

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300 + NUM_REQUESTS // 5)]


@dataclass
class Fuzzer:
    """Sends generated cases to one server and records what breaks the rules; never raises for them."""

    base_url: str
    session: requests.Session = field(default_factory=requests.Session)
    num_sent: Counter[str] = field(default_factory=Counter)
    problems: Counter[str] = field(default_factory=Counter)
    """Problem (with a reproducing curl command for its first case) -> times seen."""
    _first_case: dict[str, str] = field(default_factory=dict)

    def send(self, case: Case) -> None:
        response = case.call(base_url=self.base_url, session=self.session, timeout=60)
        self.num_sent[f"{case.operation.label} {case.meta.generation.mode.value if case.meta else ''}"] += 1
        problem = judge(response.status_code, response.content)
        if problem is not None:
            key = f"{case.operation.label}: {problem}"
            self._first_case.setdefault(key, case.as_curl_command(base_url=self.base_url)[:2000])
            self.problems[key] += 1

    def fuzz(self, operation: APIOperation, mode: GenerationMode, num_examples: int) -> None:
        settings = hypothesis.settings(
            max_examples=num_examples,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )

        @hypothesis.seed(SEED)
        @settings
        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        def run(case: Case) -> None:
            self.send(case)

        run()

    def report(self) -> str:
        lines = [f"{count}x {key}\n    {self._first_case[key]}" for key, count in self.problems.most_common()]
        return "\n".join(lines[:MAX_PROBLEMS_SHOWN]) + f"\n({len(lines)} distinct problems)"


def judge(status: int, content: bytes) -> str | None:
    """What is wrong with an answer, or ``None``: no 5xx, and every error in the OpenAI envelope."""
    if status >= 500:
        return f"status {status}: {content[:300]!r}"
    if status < 400:
        return None
    try:
        body = json.loads(content)
    except ValueError:
        return f"status {status} with a body that is not JSON: {content[:300]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(body) != {"error"} or set(error) != ENVELOPE_KEYS:
        return f"status {status} outside the OpenAI envelope: {content[:300]!r}"
    if not isinstance(error["message"], str) or not error["message"]:
        return f"status {status} with no message: {content[:300]!r}"
    return None


def has_inputs(operation: APIOperation) -> bool:
    containers = (operation.body, operation.query, operation.headers, operation.path_parameters)
    return any(len(container) for container in containers)


def fuzz_server(base_url: str, num_requests: int) -> Fuzzer:
    """Split ``num_requests`` over the operations that take inputs, half valid and half invalid;
    operations without inputs are called once."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    with_inputs = [operation for operation in operations if has_inputs(operation)]
    posts = [operation.label for operation in operations if operation.method.upper() == "POST"]
    assert posts and all(has_inputs(op) for op in operations if op.label in posts), (
        f"every POST operation of {base_url}/openapi.json must document its JSON body; posts: {posts}"
    )
    fuzzer = Fuzzer(base_url)
    per_run = -(-num_requests // (2 * len(with_inputs)))  # ceiling: the total reaches num_requests
    for operation in operations:
        if not has_inputs(operation):
            fuzzer.fuzz(operation, GenerationMode.POSITIVE, 1)
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzzer.fuzz(operation, mode, per_run)
    return fuzzer


@dataclass(frozen=True)
class Servers:
    worker: WorkerPorts
    gateway: LiveGateway


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Servers]:
    tmp_path = tmp_path_factory.mktemp("fuzz")
    worker = WorkerPorts.fresh()
    engine = {"maxModelLen": MAX_MODEL_LEN, "kvCache": {"memoryGiB": 0.05}}
    # kv_cache_aware: the gateway tokenizes every prompt, so the fuzz reaches its tokenizer too.
    manifest = write_manifest(tmp_path, tiny_llama, engine=engine, routing="kv_cache_aware")
    with (
        live_worker(tiny_llama, worker, log=tmp_path / "worker.log", max_model_len=str(MAX_MODEL_LEN)),
        live_orchestrator(manifest, [worker], log=tmp_path / "orchestrator.log") as gateway,
    ):
        gateway.wait_all_healthy(1)
        yield Servers(worker, gateway)


def assert_still_serves(base_url: str) -> None:
    answer = httpx.post(f"{base_url}/v1/chat/completions", json=chat_body(), timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["role"] == "assistant"


def assert_worker_whole(worker: WorkerPorts, free_at_start: int) -> None:
    assert httpx.get(f"{worker.url}/health", timeout=10).status_code == 200
    wait_until(
        lambda: worker.num_free_blocks() == free_at_start, timeout=30, what="every KV block free again"
    )


def check_fuzzed(fuzzer: Fuzzer, num_requests: int) -> None:
    num_sent = sum(fuzzer.num_sent.values())
    print(f"{fuzzer.base_url}: {num_sent} requests sent, per operation and mode: {dict(fuzzer.num_sent)}")
    assert not fuzzer.problems, fuzzer.report()
    assert num_sent >= num_requests, dict(fuzzer.num_sent)


def test_fuzzing_the_worker_finds_no_5xx_and_no_bare_error(servers: Servers) -> None:
    free_at_start = servers.worker.num_free_blocks()
    fuzzer = fuzz_server(servers.worker.url, NUM_REQUESTS)
    check_fuzzed(fuzzer, NUM_REQUESTS)
    assert_still_serves(servers.worker.url)
    assert_worker_whole(servers.worker, free_at_start)


def test_fuzzing_the_gateway_finds_no_5xx_and_no_bare_error(servers: Servers) -> None:
    free_at_start = servers.worker.num_free_blocks()
    fuzzer = fuzz_server(servers.gateway.url, NUM_REQUESTS)
    check_fuzzed(fuzzer, NUM_REQUESTS)
    assert_still_serves(servers.gateway.url)
    assert httpx.get(f"{servers.gateway.url}/ready", timeout=10).status_code == 200
    assert_worker_whole(servers.worker, free_at_start)
