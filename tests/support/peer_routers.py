"""The peer routers herd is compared with (issue 14), each in its own virtual environment.

``sglang-router`` (SGLang's router), ``smg`` (the SGLang model gateway) and ``vllm-router`` (vLLM's
router) are Rust routers in PyPI wheels; two of them install a console script of the same name, so
each gets a virtual environment of its own under ``$HERD_VENVS`` (``~/.cache/herd/venvs``), built once
by ``make peer-venvs`` (``python -m support.peer_routers``) and reused. ``peer_router`` starts one on
loopback with a policy over given worker URLs, waits until it has every worker, and stops it by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from support.procs import free_port, running, wait_until

__all__ = [
    "PEERS",
    "VENVS",
    "PeerRouter",
    "RunningRouter",
    "build_venv",
    "peer_router",
    "skip_without_peers",
]

VENVS = Path(os.environ.get("HERD_VENVS", Path.home() / ".cache/herd/venvs"))


@dataclass(frozen=True)
class PeerRouter:
    """One router: its pinned distribution, the module that launches it and the policies compared."""

    distribution: str
    version: str
    module: str
    policies: tuple[str, ...]
    workers_path: str
    """The router's own route listing its workers, read to know it has them all."""

    @property
    def venv(self) -> Path:
        return VENVS / f"{self.distribution}-{self.version}"

    @property
    def python(self) -> Path:
        return self.venv / "bin/python"

    @property
    def is_built(self) -> bool:
        """The marker is written last, so an interrupted build counts as none."""
        return (self.venv / ".complete").is_file()

    def argv(self, policy: str, worker_urls: Sequence[str], *, port: int, metrics_port: int) -> list[str]:
        """The router on ``127.0.0.1:port``, its Prometheus listener on loopback too (by default
        they bind port 29000, on every interface for two of them)."""
        if policy not in self.policies:
            raise ValueError(f"{self.distribution} is compared with policies {self.policies}, not {policy!r}")
        return [
            str(self.python),
            "-m",
            self.module,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *worker_urls,
            "--policy",
            policy,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
        ]


PEERS = {
    peer.distribution: peer
    for peer in (
        PeerRouter(
            "sglang-router",
            "0.3.2",
            "sglang_router.launch_router",
            ("cache_aware", "round_robin"),
            "/workers",
        ),
        PeerRouter("smg", "1.13.0", "smg.launch_router", ("cache_aware", "prefix_hash"), "/workers"),
        PeerRouter(
            "vllm-router",
            "0.1.17",
            "vllm_router.launch_router",
            ("cache_aware", "consistent_hash"),
            "/list_workers",
        ),
    )
}

skip_without_peers = pytest.mark.skipif(
    not all(peer.is_built for peer in PEERS.values()),
    reason=f"the peer routers' environments are not built under {VENVS}: run `make peer-venvs`",
)


def build_venv(peer: PeerRouter) -> dict[str, object]:
    """Install ``peer`` (pinned) into its own environment unless it is there; what it took."""
    if peer.is_built:
        return {"msg": "peer router ready", "router": peer.distribution, "venv": str(peer.venv)}
    started = time.monotonic()
    shutil.rmtree(peer.venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(peer.venv)], check=True)
    pip = [str(peer.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, f"{peer.distribution}=={peer.version}"], check=True)
    subprocess.run([str(peer.python), "-c", f"import {peer.module}"], check=True)
    (peer.venv / ".complete").touch()
    size = sum(path.stat().st_size for path in peer.venv.rglob("*") if path.is_file())
    return {
        "msg": "peer router built",
        "router": f"{peer.distribution}=={peer.version}",
        "seconds": round(time.monotonic() - started, 1),
        "mib": round(size / 2**20),
        "venv": str(peer.venv),
    }


@dataclass(frozen=True)
class RunningRouter:
    url: str
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def peer_router(
    peer: PeerRouter, policy: str, worker_urls: Sequence[str], *, log: Path, timeout: float = 60.0
) -> Iterator[RunningRouter]:
    """``peer`` with ``policy`` over ``worker_urls`` on a free loopback port, once it lists every
    worker; stopped by its pid."""
    port = free_port()
    argv = peer.argv(policy, worker_urls, port=port, metrics_port=free_port())
    with running(argv, log=log) as process:
        url = f"http://127.0.0.1:{port}"

        def has_every_worker() -> bool:
            assert process.poll() is None, f"{peer.distribution} exited early; see {log}"
            listing = httpx.get(f"{url}{peer.workers_path}", timeout=2).text
            return all(worker in listing for worker in worker_urls)

        what = f"{peer.distribution} (pid {process.pid}) routing to {len(worker_urls)} workers"
        wait_until(has_every_worker, timeout=timeout, interval=0.2, what=what)
        yield RunningRouter(url, process)


if __name__ == "__main__":
    for each in PEERS.values():
        print(json.dumps(build_venv(each)), flush=True)
