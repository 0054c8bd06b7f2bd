"""``herd up FILE.yaml``: run a ModelDeployment on this machine, no Kubernetes needed.

Each pool's workers start as ``herd worker`` processes on free loopback ports with a fresh random
internal token; once every worker answers ``/ready``, a ``herd orchestrator`` process serves them.
herd up then supervises both (``herd.cli.supervise``): a process that dies is restarted with backoff,
on the same ports. Ctrl-C or SIGTERM stops everything, each process by its own pid, and restarts nothing.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import signal
import socket
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
from herd.cli.supervise import BackoffPolicy, Child, ChildSpec, Supervisor
from herd.orchestrator.discovery import WorkerEndpoint

__all__ = ["LocalWorker", "UpError", "plan_workers", "register"]

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


def _worker_spec(worker: LocalWorker, log_dir: Path) -> ChildSpec:
    endpoint = worker.endpoint
    log_path = log_dir / f"{endpoint.id}.log"
    return ChildSpec(endpoint.id, "worker", endpoint.url, worker.argv, worker.env, log_path)


def _orchestrator_spec(manifest: Path, workers: list[LocalWorker], token: str, port: int) -> ChildSpec:
    """``herd orchestrator`` over the planned workers, named as herd up names them; logs to herd up's."""
    argv = [sys.executable, "-m", "herd.cli.main", "orchestrator", "--manifest", str(manifest)]
    argv += ["--host", HOST, "--port", str(port)]
    for worker in workers:
        end = worker.endpoint
        argv += ["--worker", f"{end.model}={end.url},{end.internal_url},{end.role},{end.id}"]
    return ChildSpec("orchestrator", "orchestrator", f"http://{HOST}:{port}", tuple(argv), {TOKEN_ENV: token})


def _wait_ready(children: Sequence[Child], timeout: float) -> None:
    """Until every child answers ``/ready``; raises ``UpError`` naming one that exits or stays unready.

    A child that exits before it was ever ready is not restarted: it cannot load (a bad model folder,
    a port taken), so restarting would only loop.
    """
    deadline = time.monotonic() + timeout
    pending = list(children)
    while pending:
        pending = [child for child in pending if not _is_ready(child)]
        if pending and time.monotonic() > deadline:
            raise UpError(f"{_label(pending[0])} was not ready after {timeout:.0f}s{_see_log(pending[0])}")
        time.sleep(0.2)


def _is_ready(child: Child) -> bool:
    if (code := child.exit_code()) is not None:
        raise UpError(f"{_label(child)} exited with code {code}{_see_log(child)}")
    try:
        return httpx.get(f"{child.spec.url}/ready", timeout=1.0).status_code == httpx.codes.OK
    except httpx.HTTPError:
        return False


def _label(child: Child) -> str:
    """``worker tiny-workers-0``, ``orchestrator``."""
    spec = child.spec
    return spec.name if spec.name == spec.kind else f"{spec.kind} {spec.name}"


def _see_log(child: Child) -> str:
    return "" if child.spec.log_path is None else f"; see its log: {child.spec.log_path}"


def _print_endpoint(port: int, names: Sequence[str]) -> None:
    base = f"http://{HOST}:{port}"
    print(f"\nherd is up: serving {', '.join(names)} at {base}/v1 (dashboard: {base}/dashboard)", flush=True)
    body = f'{{"model": "{names[0]}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
    print(
        f"try: curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'\n", flush=True
    )


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _start(args: argparse.Namespace, supervisor: Supervisor, log_dir: Path) -> list[str]:
    """Start the workers, then the orchestrator once they are ready; the served model names."""
    token = secrets.token_urlsafe(24)
    deployments = load_manifest(args.file)
    workers = [worker for deployment in deployments for worker in plan_workers(deployment, token)]
    _wait_ready([supervisor.start(_worker_spec(worker, log_dir)) for worker in workers], args.ready_timeout)
    orchestrator = supervisor.start(_orchestrator_spec(args.file.resolve(), workers, token, args.port))
    _wait_ready([orchestrator], args.ready_timeout)
    return [deployment.served_name for deployment in deployments]


def run(args: argparse.Namespace) -> int:
    configure_logging("herd-up", args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per readiness poll otherwise
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="herd-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(BackoffPolicy())
    try:
        _print_endpoint(args.port, _start(args, supervisor, log_dir))
        supervisor.run_forever()
    except (ManifestError, UpError) as error:
        print(f"herd up: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        supervisor.stop_all()
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("up", help="run a ModelDeployment locally (workers + orchestrator)")
    parser.add_argument("file", type=Path, help="ModelDeployment YAML, the file kubectl apply takes")
    parser.add_argument("--port", type=int, default=8000, help="the OpenAI API port on 127.0.0.1")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every worker")
    parser.add_argument("--log-dir", type=Path, default=None, help="worker logs (default: a new temp folder)")
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(func=run)
