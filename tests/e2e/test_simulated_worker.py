"""``herd worker`` with ``engine.backend: simulated``: several workers in one process, each with its
own engine, ports and KV events, answering with the real tokenizer's tokens, deterministically."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.procs import running, wait_until
from support.tiny_models import make_tiny_model
from support.worker_server import worker_argv

from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER
from herd.cli.up import free_port_block

pytestmark = pytest.mark.e2e

TOKEN = "fleet-token"
SIMULATED = {"backend": "simulated", "simulation": {"costModel": {"stepMs": 2.0, "tokenMs": 0.05}}}
PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. Berlin is"
NUM_WORKERS = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def fleet_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fleet") / "fleet.log"


@pytest.fixture(scope="module")
def fleet(tiny: Path, fleet_log: Path) -> Iterator[list[int]]:
    """The public ports of ``NUM_WORKERS`` simulated workers in one ``herd worker`` process."""
    ports = free_port_block(2 * NUM_WORKERS)
    argv = worker_argv(tiny, port=ports[0], internal_port=ports[NUM_WORKERS], token=TOKEN)
    argv += ["--engine-json", json.dumps(SIMULATED), "--replicas", str(NUM_WORKERS), "--log-level", "INFO"]
    log = fleet_log
    with running(argv, log=log) as process:
        public = ports[:NUM_WORKERS]

        def are_ready() -> bool:
            assert process.poll() is None, f"the fleet exited early; see {log}"
            return all(_get(f"http://127.0.0.1:{port}/ready") == 200 for port in public)

        wait_until(are_ready, timeout=60, interval=0.2, what="the simulated fleet ready")
        yield public


def _get(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


def _complete(port: int) -> dict[str, object]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
    response.raise_for_status()
    result: dict[str, object] = response.json()
    return result


def _cached_blocks(internal_port: int) -> list[int]:
    url = f"http://127.0.0.1:{internal_port}{INTERNAL_PATHS.kv_snapshot}"
    response = httpx.get(url, headers={TOKEN_HEADER: TOKEN}, timeout=5)
    response.raise_for_status()
    hashes: list[int] = response.json()["block_hashes"]
    return hashes


def test_each_worker_of_a_fleet_has_its_own_engine_and_kv_cache(fleet: list[int]) -> None:
    first, second, third = fleet
    internal = [port + NUM_WORKERS for port in fleet]
    answers = [_complete(first), _complete(first), _complete(second)]
    texts = {str(answer["choices"][0]["text"]) for answer in answers}  # type: ignore[index]
    cached = [answer["usage"]["prompt_tokens_details"]["cached_tokens"] for answer in answers]  # type: ignore[index]
    assert len(texts) == 1, "the same prompt continues alike on every simulated worker"
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0
    assert _cached_blocks(internal[0]) == _cached_blocks(internal[1])
    assert _cached_blocks(internal[0]) and _cached_blocks(internal[2]) == []
    assert _get(f"http://127.0.0.1:{third}/metrics") == 200


def test_each_ready_worker_freezes_the_startup_heap_and_times_collections(
    fleet: list[int], fleet_log: Path
) -> None:
    frozen = [
        entry["frozen_objects"]
        for line in fleet_log.read_text().splitlines()
        if line.startswith("{") and (entry := json.loads(line)).get("msg") == "startup heap frozen"
    ]
    assert len(frozen) == NUM_WORKERS and min(frozen) > 10_000, frozen  # imports, tokenizer, apps
    _complete(fleet[0])
    text = httpx.get(f"http://127.0.0.1:{fleet[0]}/metrics", timeout=5).text
    assert 'herd_gc_pause_seconds_count{generation="0"}' in text


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--engine-json", '{"backend": "vllm"}'], "not `herd worker`"),
        (["--replicas", "2"], "--replicas 2 needs engine.backend simulated"),
    ],
    ids=["vllm-backend", "replicas-of-real-engines"],
)
def test_herd_worker_refuses_what_it_cannot_serve(tiny: Path, flags: list[str], expected: str) -> None:
    argv = [sys.executable, "-m", "herd.cli.main", "worker", "--model", str(tiny), "--internal-token", "t"]
    done = subprocess.run([*argv, *flags], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert expected in done.stderr
