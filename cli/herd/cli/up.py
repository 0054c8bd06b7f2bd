"""``herd up FILE.yaml``: run a ModelDeployment on this machine, no Kubernetes needed.

Each pool's workers start as ``herd worker`` processes on free loopback ports with a fresh random
internal token; once every worker answers ``/ready`` the orchestrator serves them in this process.
Ctrl-C or SIGTERM stops everything, each worker by its own pid.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx

from herd.api.crd import POOL_ROLES, ModelDeployment, PoolName
from herd.api.logs import configure_logging
from herd.api.manifest import ManifestError, load_manifest
from herd.api.protocol import TOKEN_ENV
from herd.cli.orchestrator import local_model_path
from herd.orchestrator.app import AppSettings, build_app
from herd.orchestrator.discovery import ModelConfig, StaticSource, WorkerEndpoint
from herd.orchestrator.server import run_server

__all__ = ["LocalWorker", "UpError", "plan_workers", "register"]

log = logging.getLogger("herd.up")

HOST = "127.0.0.1"


class UpError(RuntimeError):
    """Why ``herd up`` cannot go on, with what to do about it."""


@dataclass(frozen=True, slots=True)
class LocalWorker:
    """One worker process to start: where it listens and the command that starts it."""

    endpoint: WorkerEndpoint
    port: int
    argv: tuple[str, ...]
    env: dict[str, str]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _model_folder(deployment: ModelDeployment) -> Path:
    path = local_model_path(deployment.spec.model.source)
    if path is None:
        raise UpError(
            f"{deployment.metadata.name}: model.source {deployment.spec.model.source!r} is not local; "
            "herd up needs a local model: use file://PATH (e.g. `herd model prepare smollm2`)"
        )
    if not (path / "config.json").exists():
        raise UpError(
            f"{deployment.metadata.name}: {path} holds no model (no config.json); check model.source"
        )
    return path


def plan_workers(deployment: ModelDeployment, token: str) -> list[LocalWorker]:
    """Every worker process of every pool of the deployment, each on its own free ports."""
    folder = _model_folder(deployment)
    workers = []
    for pool_name, pool in deployment.spec.pools().items():
        for number in range(pool.replicas):
            port, internal_port = _free_port(), _free_port()
            endpoint = WorkerEndpoint(
                f"{deployment.metadata.name}-{pool_name}-{number}",
                deployment.served_name,
                f"http://{HOST}:{port}",
                f"http://{HOST}:{internal_port}",
                POOL_ROLES[pool_name],
            )
            argv = _worker_argv(deployment, pool_name, folder, endpoint, (port, internal_port))
            workers.append(LocalWorker(endpoint, port, argv, {**pool.env, TOKEN_ENV: token}))
    return workers


def _worker_argv(
    deployment: ModelDeployment,
    pool: PoolName,
    folder: Path,
    endpoint: WorkerEndpoint,
    ports: tuple[int, int],
) -> tuple[str, ...]:
    flags = {
        "--model": str(folder),
        "--served-name": endpoint.model,
        "--host": HOST,
        "--port": str(ports[0]),
        "--internal-port": str(ports[1]),
        "--role": endpoint.role,
        "--engine-json": deployment.spec.engine_for(pool).model_dump_json(by_alias=True),
    }
    return (
        sys.executable,
        "-m",
        "herd.cli.main",
        "worker",
        *(part for item in flags.items() for part in item),
    )


class _Processes:
    """The worker processes started so far, each with its log file; stopped by pid."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.running: list[tuple[LocalWorker, subprocess.Popen[bytes], Path]] = []

    def start(self, worker: LocalWorker) -> None:
        log_path = self.log_dir / f"{worker.endpoint.id}.log"
        with log_path.open("wb") as sink:
            process = subprocess.Popen(
                worker.argv, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **worker.env}
            )
        self.running.append((worker, process, log_path))
        log.info(
            "started worker",
            extra={
                "worker": worker.endpoint.id,
                "pid": process.pid,
                "url": worker.endpoint.url,
                "log": str(log_path),
            },
        )

    def wait_ready(self, timeout: float) -> None:
        """Until every worker answers ``/ready``; raises ``UpError`` naming the log of one that fails."""
        deadline = time.monotonic() + timeout
        pending = list(self.running)
        while pending:
            pending = [entry for entry in pending if not self._is_ready(*entry)]
            if pending and time.monotonic() > deadline:
                worker, _, log_path = pending[0]
                raise UpError(
                    f"worker {worker.endpoint.id} was not ready after {timeout:.0f}s; see {log_path}"
                )
            time.sleep(0.2)

    @staticmethod
    def _is_ready(worker: LocalWorker, process: subprocess.Popen[bytes], log_path: Path) -> bool:
        if (code := process.poll()) is not None:
            raise UpError(f"worker {worker.endpoint.id} exited with code {code}; see its log: {log_path}")
        try:
            return httpx.get(f"{worker.endpoint.url}/ready", timeout=1.0).status_code == httpx.codes.OK
        except httpx.HTTPError:
            return False

    def stop_all(self, grace: float = 10.0) -> None:
        for _, process, _ in self.running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for worker, process, _ in self.running:
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                log.warning("worker did not stop in time; killing it", extra={"worker": worker.endpoint.id})
                process.kill()
                process.wait(timeout=grace)


def _print_endpoint(port: int, names: Sequence[str]) -> None:
    base = f"http://{HOST}:{port}"
    print(f"\nherd is up: serving {', '.join(names)} at {base}/v1 (dashboard: {base}/dashboard)", flush=True)
    body = f'{{"model": "{names[0]}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
    print(
        f"try: curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'\n", flush=True
    )


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _serve(deployments: list[ModelDeployment], workers: list[LocalWorker], token: str, port: int) -> None:
    models = [
        ModelConfig.from_deployment(d, model_path=local_model_path(d.spec.model.source)) for d in deployments
    ]
    source = StaticSource(models, [worker.endpoint for worker in workers])
    app = build_app(source, settings=AppSettings(internal_token=token))
    names = [model.served_name for model in models]
    run_server(app, host=HOST, port=port, on_started=lambda: _print_endpoint(port, names))


def run(args: argparse.Namespace) -> int:
    configure_logging("herd-up", args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    token = secrets.token_urlsafe(24)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="herd-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    processes = _Processes(log_dir)
    try:
        deployments = load_manifest(args.file)
        workers = [worker for deployment in deployments for worker in plan_workers(deployment, token)]
        for worker in workers:
            processes.start(worker)
        processes.wait_ready(args.ready_timeout)
        _serve(deployments, workers, token, args.port)
    except (ManifestError, UpError) as error:
        print(f"herd up: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        processes.stop_all()
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("up", help="run a ModelDeployment locally (workers + orchestrator)")
    parser.add_argument("file", type=Path, help="ModelDeployment YAML, the file kubectl apply takes")
    parser.add_argument("--port", type=int, default=8000, help="the OpenAI API port on 127.0.0.1")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every worker")
    parser.add_argument("--log-dir", type=Path, default=None, help="worker logs (default: a new temp folder)")
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(func=run)
