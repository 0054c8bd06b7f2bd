"""Ports, processes and local servers for tests. Everything binds 127.0.0.1 and is stopped by pid."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(
    check: Callable[[], bool], *, timeout: float, interval: float = 0.05, what: str = "condition"
) -> None:
    """Poll ``check`` until it holds; bounded in time, raises naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(interval)
    raise TimeoutError(f"{what} did not hold within {timeout:.1f}s")


def stop_process(process: subprocess.Popen[bytes], *, grace: float = 10.0) -> None:
    """SIGTERM by pid, then SIGKILL after ``grace`` seconds."""
    if process.poll() is not None:
        return
    os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=grace)


@contextlib.contextmanager
def running(
    argv: Sequence[str], *, log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` with output to ``log``; always stopped by its own pid on exit."""
    with log.open("wb") as sink:
        process = subprocess.Popen(
            list(argv), stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        try:
            yield process
        finally:
            stop_process(process)


def redis_argv(port: int, workdir: Path) -> list[str]:
    """A loopback ``redis-server`` on ``port`` without persistence, working in ``workdir``."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "redis-server is not installed: run `make test` (it installs Debian's redis-server)"
        )
    return [
        binary,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A throwaway ``redis-server`` on a free loopback port, without persistence; yields its URL."""
    port = free_port()
    with running(redis_argv(port, workdir), log=workdir / "redis.log") as process:

        def is_up() -> bool:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")

        wait_until(is_up, timeout=10, what=f"redis-server (pid {process.pid}) answering on port {port}")
        yield f"redis://127.0.0.1:{port}/0"
