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

_handed_out: set[int] = set()
"""Ports already given to a caller in this process: the kernel may offer a closed one again at once."""


def free_port() -> int:
    """A loopback port free now and never handed out before in this test process.

    Callers often take two ports before either is bound (a worker's public and internal ports), and
    the kernel can offer the port it just freed again; such a pair would make one server fail to bind.
    """
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no fresh loopback port after 100 tries: is the ephemeral port range exhausted?")


def wait_until(
    check: Callable[[], bool], *, timeout: float, interval: float = 0.05, what: str = "condition"
) -> None:
    """Poll ``check`` until it holds; bounded in time, raises naming ``what`` otherwise.

    Exceptions from ``check`` count as "not yet" (a server not listening yet), except an
    ``AssertionError``: a check asserts what must never happen (a process exited), so that fails at
    once with its own message. ``check`` gets one last call at the deadline, so a machine that
    stalled past it while the condition came true does not fail.
    """
    deadline = time.monotonic() + timeout
    while True:
        is_last = time.monotonic() >= deadline
        try:
            if check():
                return
        except AssertionError:
            raise
        except Exception:  # not ready yet; the deadline bounds the wait
            pass
        if is_last:
            raise TimeoutError(f"{what} did not hold within {timeout:.1f}s")
        time.sleep(interval)


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
    argv: Sequence[str],
    *,
    log: Path,
    env: dict[str, str] | None = None,
    grace: float = 10.0,
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` (in ``cwd``, else here) with output to ``log``; always stopped by its own pid on
    exit (SIGKILL after ``grace`` seconds)."""
    with log.open("wb") as sink:
        process = subprocess.Popen(
            list(argv), stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd
        )
        try:
            yield process
        finally:
            stop_process(process, grace=grace)


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

        wait_until(is_up, timeout=30, what=f"redis-server (pid {process.pid}) answering on port {port}")
        yield f"redis://127.0.0.1:{port}/0"


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` now (Linux: read from ``/proc``)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # the command name in parentheses may hold spaces: the fields after it are fixed
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                children.append(int(stat.parent.name))
    return children


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, ended but not yet reaped, runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
