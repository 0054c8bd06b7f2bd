"""Real ``herd worker`` and ``herd orchestrator`` processes on loopback, for fault, fuzz and soak tests.

A worker listens on ports chosen by the caller, so a test can SIGKILL it and start another one where
the orchestrator expects it. The orchestrator names its static workers ``worker-0``, ``worker-1``, ...
in the order given. Every process is stopped by its own pid (``support.procs.running``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER
from support.procs import free_port, running, wait_until
from support.worker_server import worker_argv

__all__ = [
    "ENVELOPE_KEYS",
    "MODEL",
    "TOKEN",
    "LiveGateway",
    "WorkerPorts",
    "chat_body",
    "error_envelope",
    "live_orchestrator",
    "live_worker",
    "rss_kib",
    "write_manifest",
]

TOKEN = "live-cluster-token"
MODEL = "tiny"
"""The served name ``worker_argv`` gives every worker."""
ENVELOPE_KEYS = {"message", "type", "param", "code"}


@dataclass(frozen=True)
class WorkerPorts:
    """Where one worker listens: its public and internal ports on 127.0.0.1."""

    port: int
    internal_port: int
    role: str = "unified"

    @classmethod
    def fresh(cls, role: str = "unified") -> WorkerPorts:
        return cls(free_port(), free_port(), role)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def internal_url(self) -> str:
        return f"http://127.0.0.1:{self.internal_port}"

    @property
    def spec(self) -> str:
        """``herd orchestrator --worker`` syntax."""
        return f"{self.url},{self.internal_url},{self.role}"

    def load(self) -> dict[str, Any]:
        """The worker's load report (free and total KV blocks among it) from its internal port."""
        response = httpx.get(
            self.internal_url + INTERNAL_PATHS.load, headers={TOKEN_HEADER: TOKEN}, timeout=10
        )
        response.raise_for_status()
        report: dict[str, Any] = response.json()
        return report

    def num_free_blocks(self) -> int:
        return int(self.load()["num_free_blocks"])


def _is_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> bool:
    assert process.poll() is None, f"pid {process.pid} exited with {process.returncode}; see {log}"
    return httpx.get(f"{url}/ready", timeout=2).status_code == httpx.codes.OK


@contextlib.contextmanager
def live_worker(
    model: Path, ports: WorkerPorts, *, log: Path, **flags: str
) -> Iterator[subprocess.Popen[bytes]]:
    """A ``herd worker`` on ``ports`` once it is ready; ``flags`` add ``--name value`` (they win)."""
    argv = worker_argv(
        model, port=ports.port, internal_port=ports.internal_port, token=TOKEN, role=ports.role, **flags
    )
    with running(argv, log=log) as process:
        ready = lambda: _is_ready(ports.url, process, log)  # noqa: E731
        wait_until(ready, timeout=120, interval=0.2, what=f"herd worker (pid {process.pid}) ready")
        yield process


def write_manifest(folder: Path, model: Path, *, engine: dict[str, Any], routing: str, **spec: Any) -> Path:
    """A ModelDeployment for ``model`` served as ``tiny``; ``spec`` adds top-level spec fields."""
    document = {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": MODEL},
        "spec": {
            "model": {"source": f"file://{model}", "servedName": MODEL},
            "engine": {"device": "cpu", "dtype": "float32", **engine},
            "routing": {"strategy": routing},
            **spec,
        },
    }
    path = folder / f"manifest-{routing}.yaml"
    path.write_text(json.dumps(document))  # JSON is YAML
    return path


@dataclass(frozen=True)
class LiveGateway:
    url: str
    process: subprocess.Popen[bytes]

    def workers(self) -> dict[str, dict[str, Any]]:
        """The dashboard's row per worker id (health, in-flight, KV blocks)."""
        rows = httpx.get(f"{self.url}/dashboard/data", timeout=10).json()["workers"]
        return {row["id"]: row for row in rows}

    def wait_all_healthy(self, count: int, *, timeout: float = 60) -> None:
        def all_healthy() -> bool:
            rows = self.workers()
            return len(rows) == count and all(row["healthy"] for row in rows.values())

        wait_until(all_healthy, timeout=timeout, interval=0.1, what=f"{count} workers admitted")


@contextlib.contextmanager
def live_orchestrator(
    manifest: Path, workers: Sequence[WorkerPorts], *, log: Path, args: Sequence[str] = ()
) -> Iterator[LiveGateway]:
    """``herd orchestrator`` over static ``workers`` once it is ready (every model has a worker)."""
    port = free_port()
    argv = [sys.executable, "-m", "herd.cli.main", "orchestrator", "--port", str(port),
            "--manifest", str(manifest), "--internal-token", TOKEN, "--log-level", "WARNING", *args]  # fmt: skip
    for worker in workers:
        argv += ["--worker", worker.spec]
    with running(argv, log=log) as process:
        url = f"http://127.0.0.1:{port}"
        ready = lambda: _is_ready(url, process, log)  # noqa: E731
        wait_until(ready, timeout=120, interval=0.2, what=f"herd orchestrator (pid {process.pid}) ready")
        yield LiveGateway(url, process)


def chat_body(content: str = "Tell me a story about a cat", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def error_envelope(response: httpx.Response) -> dict[str, Any]:
    """The ``error`` object of an OpenAI error envelope; fails naming what the body was instead."""
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, f"{response.status_code}: {response.text[:500]}"
    error: dict[str, Any] = body["error"]
    assert set(error) == ENVELOPE_KEYS, f"{response.status_code}: {response.text[:500]}"
    assert isinstance(error["message"], str) and error["message"], response.text[:500]
    return error


def rss_kib(pid: int) -> int:
    """A process's resident set size (``VmRSS`` in ``/proc/<pid>/status``), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line: is pid {pid} a live process?")
