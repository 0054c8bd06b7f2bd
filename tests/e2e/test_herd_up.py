"""``herd up`` end to end: two real tiny-model workers behind the gateway, driven by the openai SDK."""

from __future__ import annotations

import os
import queue
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from support.herd_up import Up, herd_up_of
from support.procs import wait_until

from herd.api.protocol import REQUEST_ID_HEADER, WORKER_HEADER
from herd.cli.supervise import BackoffPolicy

pytestmark = pytest.mark.e2e

MODEL = "tiny"
# long enough that no machine decodes it between a stream's first token and the kill
LONG = 1900


def write_manifest(folder: Path, model: Path, *, replicas: int = 2, strategy: str = "kv_cache_aware") -> Path:
    path = folder / "tiny.yaml"
    path.write_text(
        f"""apiVersion: herd.dev/v1alpha1
kind: ModelDeployment
metadata: {{name: tiny}}
spec:
  model: {{source: "file://{model}", servedName: {MODEL}}}
  engine: {{dtype: float32, device: cpu, maxModelLen: 2048, maxBatchSize: 8, kvCache: {{blockSize: 16, memoryGiB: 0.05}}}}
  workers: {{replicas: {replicas}}}
  routing: {{strategy: {strategy}}}
"""
    )
    return path


@pytest.fixture(scope="module")
def herd_up(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Up]:
    """One ``herd up`` for the module (workers take a while to load); the kill tests run last."""
    tmp_path = tmp_path_factory.mktemp("herd-up")
    with herd_up_of(write_manifest(tmp_path, tiny_llama), tmp_path) as up:
        yield up
    # `running` stopped herd up with SIGTERM: it must have stopped every process by pid first,
    # restarting none of them.
    assert "herd is up" in up.log.read_text()
    pids = [
        int(str(entry["pid"])) for kind in ("worker", "orchestrator") for entry in up.started(kind).values()
    ]
    assert len(pids) == 3 and not [pid for pid in pids if is_alive(pid)]
    # The tests' kills are SIGKILLs; an exit at shutdown (SIGTERM, code 0) must not be taken for a crash.
    assert {entry.get("signal") for entry in up.entries("process exited; restarting it")} <= {"SIGKILL"}


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stream_finish(client: openai.OpenAI, prompt: str, max_tokens: int) -> str | None:
    """Stream a chat completion to its end; the last finish_reason (random tiny weights: the text is noise)."""
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    reasons = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
    return reasons[-1] if reasons else None


def test_openai_sdk_streams_through_the_gateway(herd_up: Up) -> None:
    client = herd_up.client()
    assert [model.id for model in client.models.list()] == [MODEL]
    assert stream_finish(client, "Hello there", 8) == "length"
    response = httpx.post(
        f"{herd_up.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "abc", "max_tokens": 4},
        timeout=30,
    )
    assert response.status_code == 200 and response.headers[WORKER_HEADER].startswith("tiny-workers-")
    assert len(herd_up.worker_pids()) == 2


@pytest.mark.parametrize(
    ("given", "is_kept"),
    [("trace-7", True), ("", False), ("x" * 129, False)],
    ids=["valid", "empty", "too-long"],
)
def test_the_clients_request_id_reaches_the_worker_and_comes_back(
    herd_up: Up, given: str, is_kept: bool
) -> None:
    for stream in (False, True):
        response = httpx.post(
            f"{herd_up.base_url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "stream": stream,
            },
            headers={REQUEST_ID_HEADER: given},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        echoed = response.headers[REQUEST_ID_HEADER]
        assert (echoed == given) is is_kept and echoed  # an invalid id is replaced by the worker's own
        assert f'"chatcmpl-{echoed}"' in response.text  # the worker named its answer after it


def test_gateway_block_hashes_match_the_workers(herd_up: Up) -> None:
    """The index holds the hashes workers publish; a predicted hit means the gateway computed the same ones."""
    prompt = " ".join(f"word{number}" for number in range(60))
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    indexed_before = indexed_blocks(herd_up)
    first = httpx.post(f"{herd_up.base_url}/v1/chat/completions", json=body, timeout=60)
    assert first.status_code == 200
    chosen = first.headers[WORKER_HEADER]
    # This prompt's blocks, not an earlier test's, whatever the order and speed of the tests.
    wait_until(
        lambda: indexed_blocks(herd_up)[chosen] > indexed_before.get(chosen, 0),
        timeout=60,
        what="the worker's KV events reaching the index",
    )
    hits_before = predicted_hit_blocks(herd_up)
    second = httpx.post(f"{herd_up.base_url}/v1/chat/completions", json=body, timeout=60)
    assert second.headers[WORKER_HEADER] == chosen
    assert predicted_hit_blocks(herd_up) - hits_before >= 1


def indexed_blocks(up: Up) -> dict[str, int]:
    rows = httpx.get(f"{up.base_url}/dashboard/data").json()["workers"]
    return {row["id"]: int(row["kv_blocks_indexed"]) for row in rows}


def predicted_hit_blocks(up: Up) -> float:
    metrics = httpx.get(f"{up.base_url}/metrics").text
    return next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("herd_router_predicted_cache_hit_blocks_sum")
    )


def test_killing_a_worker_loses_no_request_and_breaks_no_stream(herd_up: Up) -> None:
    client = herd_up.client()
    decoding: queue.Queue[str] = queue.Queue()  # the worker of each stream, once a token has come

    def in_flight_outcome(number: int) -> str:
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"long story {number}"}],
                max_tokens=LONG,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    decoding.put(raw.headers[WORKER_HEADER])
        except openai.APIError:
            return "error-event"
        return "finished"

    with ThreadPoolExecutor(max_workers=4) as pool:
        long_streams = [pool.submit(in_flight_outcome, number) for number in range(4)]
        # Kill a worker that is decoding a stream, whatever the machine's speed: not merely routed to
        # (a request the worker never answered may be retried elsewhere), and not yet finished.
        victim = decoding.get(timeout=120)
        os.kill(herd_up.worker_pids()[victim], signal.SIGKILL)
        after_kill = [stream_finish(client, f"short {number}", 4) for number in range(6)]
        outcomes = [future.result(timeout=600) for future in long_streams]
    assert after_kill == ["length"] * 6
    assert outcomes == ["finished"] * 4  # the killed worker's streams went on from another worker


def restarts_of(up: Up, name: str) -> list[dict[str, object]]:
    return [entry for entry in up.entries("process exited; restarting it") if entry["process_name"] == name]


def kill_and_wait_for_restart(up: Up, kind: str, name: str) -> dict[str, object]:
    """kill -9 the process, then wait until herd up has logged its restart and started a new one."""
    before, old_pid = len(restarts_of(up, name)), int(str(up.started(kind)[name]["pid"]))
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: len(restarts_of(up, name)) > before, timeout=30, what=f"the restart of {name} logged")
    wait_until(
        lambda: int(str(up.started(kind)[name]["pid"])) != old_pid, timeout=60, what=f"{name} started again"
    )
    return restarts_of(up, name)[-1]


def test_supervision_restarts_a_killed_worker_and_orchestrator(herd_up: Up) -> None:
    victim, started = next(iter(herd_up.workers().items()))
    restart = kill_and_wait_for_restart(herd_up, "worker", victim)
    assert restart["signal"] == "SIGKILL" and int(str(restart["attempt"])) >= 1
    assert float(str(restart["delay_s"])) == BackoffPolicy().delay_s(int(str(restart["attempt"])))
    assert herd_up.workers()[victim]["url"] == started["url"]  # same port: the orchestrator finds it again

    def is_admitted_again() -> bool:
        rows = httpx.get(f"{herd_up.base_url}/dashboard/data", timeout=5).json()["workers"]
        return any(row["id"] == victim and row["healthy"] for row in rows)

    wait_until(is_admitted_again, timeout=120, what=f"{victim} serving again behind the gateway")
    assert httpx.get(f"{started['url']}/ready", timeout=5).status_code == 200

    restart = kill_and_wait_for_restart(herd_up, "orchestrator", "orchestrator")
    assert restart["signal"] == "SIGKILL"
    wait_until(
        lambda: stream_finish(herd_up.client(), "back again", 4) == "length",
        timeout=120,
        what="the restarted orchestrator serving",
    )
