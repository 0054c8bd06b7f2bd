"""`herd up` of a manifest as a real process, for end-to-end tests; stopped by its pid."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from support.procs import free_port, running, wait_until

REPO = Path(__file__).resolve().parents[2]
DEMO_SOURCE = "file://.cache/models/smollm2-135m-instruct"
EMBEDDING_SOURCE = "file://.cache/models/all-minilm-l6-v2"

__all__ = ["Up", "herd_up_of", "shipped_example"]


@dataclass(frozen=True)
class Up:
    base_url: str
    log: Path

    def entries(self, msg: str) -> list[dict[str, object]]:
        """herd up's own JSON log lines with this message, oldest first."""
        lines = self.log.read_text().splitlines()
        entries = [json.loads(line) for line in lines if line.startswith('{"ts"')]
        return [entry for entry in entries if entry.get("msg") == msg and entry.get("component") == "herd-up"]

    def started(self, kind: str) -> dict[str, dict[str, object]]:
        """The latest start of each process of this kind (``worker``, ``orchestrator``), by name."""
        return {
            str(entry["process_name"]): entry
            for entry in self.entries("started process")
            if entry["kind"] == kind
        }

    def workers(self) -> dict[str, dict[str, object]]:
        return self.started("worker")

    def worker_pids(self) -> dict[str, int]:
        return {name: int(str(entry["pid"])) for name, entry in self.workers().items()}

    def worker(self, role: str) -> dict[str, object]:
        return next(entry for name, entry in self.workers().items() if f"-{role}-" in name)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@contextlib.contextmanager
def herd_up_of(manifest: Path, folder: Path, env: dict[str, str] | None = None) -> Iterator[Up]:
    """``herd up MANIFEST`` until it serves (``env`` added to its environment); stopped by its pid on exit."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "herd.cli.main",
        "up",
        str(manifest),
        "--port",
        str(port),
        "--log-dir",
        str(folder / "logs"),
        "--ready-timeout",
        "300",
    ]
    log = folder / "up.log"
    with running(argv, log=log, env={"OMP_NUM_THREADS": "1", **(env or {})}) as process:

        def ready() -> bool:
            assert process.poll() is None, f"herd up exited: {log.read_text()[-2000:]}"
            return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200

        wait_until(ready, timeout=330, what="herd up serving")
        yield Up(f"http://127.0.0.1:{port}", log)


def shipped_example(name: str, folder: Path, model: Path, embedding_model: Path | None = None) -> Path:
    """``examples/NAME`` with its repo-relative model paths made absolute (tests run from anywhere):
    the demo model's, and the embedding model's when ``embedding_model`` is given."""
    shipped = (REPO / "examples" / name).read_text()
    assert DEMO_SOURCE in shipped, f"examples/{name} no longer points at the demo model"
    if embedding_model is not None:
        assert EMBEDDING_SOURCE in shipped, f"examples/{name} no longer points at the embedding model"
        shipped = shipped.replace(EMBEDDING_SOURCE, f"file://{embedding_model}")
    manifest = folder / name
    manifest.write_text(shipped.replace(DEMO_SOURCE, f"file://{model}"))
    return manifest
