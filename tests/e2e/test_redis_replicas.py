"""Two ``herd orchestrator`` processes sharing a real redis-server in front of two real tiny workers."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.procs import free_port, running, wait_until

from herd.api.protocol import WORKER_HEADER

pytestmark = pytest.mark.e2e

MODEL = "tiny"
TOKEN = "replica-test-token"
ENGINE = {
    "dtype": "float32",
    "device": "cpu",
    "maxModelLen": 512,
    "maxBatchSize": 8,
    "kvCache": {"blockSize": 16, "memoryGiB": 0.05},
}
PROMPT = " ".join(f"word{number}" for number in range(60))


def is_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> bool:
    assert process.poll() is None, f"pid {process.pid} exited; see {log}"
    return httpx.get(f"{url}/ready", timeout=1).status_code == 200


@contextlib.contextmanager
def workers(model: Path, logs: Path, count: int) -> Iterator[list[str]]:
    """``count`` real workers; yields ``URL,INTERNAL_URL`` for each."""
    with contextlib.ExitStack() as stack:
        specs, processes = [], []
        for number in range(count):
            port, internal = free_port(), free_port()
            argv = [
                sys.executable,
                "-m",
                "herd.cli.main",
                "worker",
                "--model",
                str(model),
                "--served-name",
                MODEL,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--internal-port",
                str(internal),
                "--internal-token",
                TOKEN,
                "--role",
                "unified",
                "--engine-json",
                json.dumps(ENGINE),
            ]
            log = logs / f"worker{number}.log"
            processes.append((stack.enter_context(running(argv, log=log, env={"OMP_NUM_THREADS": "1"})), log))
            specs.append(f"http://127.0.0.1:{port},http://127.0.0.1:{internal}")
        for spec, (process, log) in zip(specs, processes, strict=True):
            wait_until(
                lambda spec=spec, process=process, log=log: is_ready(spec.split(",")[0], process, log),
                timeout=180,
                what=f"worker {spec}",
            )
        yield specs


@contextlib.contextmanager
def orchestrator(manifest: Path, worker_specs: list[str], redis_url: str, log: Path) -> Iterator[str]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "herd.cli.main",
        "orchestrator",
        "--port",
        str(port),
        "--manifest",
        str(manifest),
        "--redis",
        redis_url,
        "--redis-timeout",  # a live Redis on a loaded runner may be slower than the 0.5 s default
        "5",
        "--internal-token",
        TOKEN,
    ]
    for spec in worker_specs:
        argv += ["--worker", spec]
    with running(argv, log=log) as process:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: is_ready(url, process, log), timeout=180, what=f"orchestrator on {port}")
        yield url


def test_replicas_agree_on_sessions_and_kv_index(tmp_path: Path, tiny_llama: Path, redis_url: str) -> None:
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(
        f"apiVersion: herd.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {{name: tiny}}\n"
        f"spec: {{model: {{source: 'file://{tiny_llama}', servedName: {MODEL}}}, routing: {{strategy: sticky_session}}}}\n"
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    with (
        workers(tiny_llama, tmp_path, 2) as specs,
        orchestrator(manifest, specs, redis_url, tmp_path / "orch-a.log") as first,
        orchestrator(manifest, specs, redis_url, tmp_path / "orch-b.log") as second,
    ):
        assert httpx.post(f"{second}/v1/chat/completions", json=body, timeout=60).status_code == 200
        chosen: dict[str, set[str]] = {}
        for session in ("s1", "s2", "s3", "s4"):
            for url in (first, second, second, first):
                response = httpx.post(
                    f"{url}/v1/chat/completions", json=body, headers={"X-Session-ID": session}, timeout=60
                )
                assert response.status_code == 200
                chosen.setdefault(session, set()).add(response.headers[WORKER_HEADER])
        assert all(len(workers_seen) == 1 for workers_seen in chosen.values())

        def index_of(url: str) -> list[tuple[str, int, object]]:
            rows = httpx.get(f"{url}/dashboard/data").json()["workers"]
            return sorted((row["id"], row["kv_blocks_indexed"], row["kv_position"]) for row in rows)

        wait_until(
            lambda: index_of(first) == index_of(second) and any(blocks for _, blocks, _ in index_of(first)),
            timeout=60,
            what="both replicas holding the same non-empty KV index",
        )
