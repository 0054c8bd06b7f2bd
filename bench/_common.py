"""Shared by the benchmarks: servers as subprocesses on free loopback ports (herd workers,
orchestrators), stopped by pid and bounded in time; one load run through herd's load generator
(``herd.cli.loadgen``, the client behind ``herd bench``); the results written with the command and
the machine's description."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from herd.cli.loadgen import BenchConfig, run_benchmark
from herd.cli.up import free_port_block

__all__ = [
    "BYTES_PER_TOKEN",
    "DEMO_MODEL",
    "HOST",
    "REPO",
    "HerdWorkers",
    "Launch",
    "command_line",
    "demo_manifest",
    "free_port",
    "herd_worker_argv",
    "herd_workers",
    "machine_info",
    "metric_sums",
    "orchestrator_argv",
    "run_load",
    "serving",
    "summary_row",
    "thread_env",
    "write_json",
    "write_report",
    "write_results",
]

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # one free_port and one stop-by-pid for tests and benchmarks
from support.procs import free_port, running, wait_until  # noqa: E402

DEMO_MODEL = REPO / ".cache" / "models" / "smollm2-135m-instruct"
HOST = "127.0.0.1"
# SmolLM2-135M, fp32: K and V x 30 layers x 3 KV heads x head_dim 64 x 4 bytes.
BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4


def demo_manifest(
    name: str,
    engine: dict[str, Any],
    *,
    replicas: int | None = None,
    routing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ModelDeployment of the demo model served as ``name``, routed by ``routing`` (by default
    least_request: the admission and resumption benchmarks' fleet); ``replicas`` workers when given."""
    spec: dict[str, Any] = {
        "model": {"source": f"file://{DEMO_MODEL}", "servedName": name},
        "engine": engine,
        "routing": routing or {"strategy": "least_request"},
    }
    if replicas is not None:
        spec["workers"] = {"replicas": replicas}
    return {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": spec,
    }


def thread_env(num_threads: int) -> dict[str, str]:
    """Caps a server's torch/OpenMP threads; on an oversubscribed 2-core machine one thread per
    process avoids OpenMP spin-waiting against other processes (measured ~9x faster under load)."""
    return {"OMP_NUM_THREADS": str(num_threads), "MKL_NUM_THREADS": str(num_threads)}


def herd_worker_argv(
    model: Path, *, name: str, port: int, internal_port: int, token: str, engine: dict[str, Any]
) -> list[str]:
    """``herd worker`` on loopback with the manifest's engine block (camelCase)."""
    return [
        sys.executable,
        "-m",
        "herd.cli.main",
        "worker",
        "--model",
        str(model),
        "--served-name",
        name,
        "--host",
        HOST,
        "--port",
        str(port),
        "--internal-port",
        str(internal_port),
        f"--internal-token={token}",  # one word: a token_urlsafe token may start with '-'
        "--engine-json",
        json.dumps(engine),
        "--log-level",
        "WARNING",
    ]


class Launch(Protocol):
    """Starts ``argv`` with output to ``log`` and stops it on exit (``support.procs.running``;
    ``support.vllm_env.vllm_server`` for a server with child processes)."""

    def __call__(
        self, argv: Sequence[str], *, log: Path, env: dict[str, str] | None = None
    ) -> AbstractContextManager[subprocess.Popen[bytes]]: ...


@contextlib.contextmanager
def serving(
    argv: Sequence[str],
    *,
    ready_url: str,
    log: Path,
    env: dict[str, str],
    timeout: float = 300.0,
    launch: Launch | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """A server subprocess (output to ``log``) once ``ready_url`` answers 200; stopped on exit, by
    ``launch`` (default: by its pid, SIGKILL after 20 s)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = launch(argv, log=log, env=env) if launch else running(argv, log=log, env=env, grace=20.0)
    with started as process:

        def is_ready() -> bool:
            assert process.poll() is None, f"server exited with code {process.returncode}; see {log}"
            return httpx.get(ready_url, timeout=2.0).status_code == httpx.codes.OK

        wait_until(is_ready, timeout=timeout, interval=0.5, what=f"{ready_url} answering 200 (see {log})")
        yield process


@dataclass(frozen=True)
class HerdWorkers:
    """The workers of one ``herd worker`` process: the process and each worker's (public, internal) URL."""

    process: subprocess.Popen[bytes]
    urls: list[tuple[str, str]]

    @property
    def endpoints(self) -> list[str]:
        """Each worker as ``URL,INTERNAL_URL``, as ``orchestrator_argv`` takes them."""
        return [f"{public},{internal}" for public, internal in self.urls]


@contextlib.contextmanager
def herd_workers(
    model: Path,
    *,
    name: str,
    token: str,
    engine: dict[str, Any],
    log: Path,
    replicas: int = 1,
    threads: int = 1,
    extra: Sequence[str] = (),
    timeout: float = 300.0,
    ports: Sequence[int] | None = None,
) -> Iterator[HerdWorkers]:
    """One ``herd worker`` process serving ``replicas`` workers (more than one: simulated ones) on
    consecutive loopback ports (``ports``: the public ones, then the internal ones; default a free
    block), ``threads`` torch threads, ``extra`` flags; once the last worker answers ``/ready``;
    stopped by pid on exit."""
    ports = ports or free_port_block(2 * replicas)
    argv = herd_worker_argv(
        model, name=name, port=ports[0], internal_port=ports[replicas], token=token, engine=engine
    )
    if replicas > 1:
        argv += ["--replicas", str(replicas)]
    urls = [(f"http://{HOST}:{ports[n]}", f"http://{HOST}:{ports[replicas + n]}") for n in range(replicas)]
    with serving(
        [*argv, *extra], ready_url=f"{urls[-1][0]}/ready", log=log, env=thread_env(threads), timeout=timeout
    ) as process:
        yield HerdWorkers(process, urls)


def run_load(
    config: BenchConfig, *, transport: Callable[[], httpx.AsyncBaseTransport] | None = None
) -> dict[str, Any]:
    """One load run through herd's load generator; the ``herd bench`` JSON report. ``transport``
    builds the client's transport inside the run's event loop (default: httpx's own)."""

    async def run() -> dict[str, Any]:
        return await run_benchmark(config, transport=transport() if transport else None)

    return asyncio.run(run())


def metric_sums(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Totals of the named samples (summed over labels) on a ``/metrics`` page; raises
    ``httpx.HTTPStatusError`` where the server has no such page."""
    text = httpx.get(f"{url}/metrics", timeout=10).raise_for_status().text
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def summary_row(report: dict[str, Any]) -> dict[str, Any]:
    """The figures the benchmark pages quote, from a full report."""
    keys = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
    return {
        "num_completed": report["num_completed"],
        "num_errors": report["num_errors"],
        "errors": report["errors"],
        "duration_s": report["duration_s"],
        "output_token_throughput": report["output_token_throughput"],
        "total_output_tokens": report["total_output_tokens"],
        "total_input_tokens": report["total_input_tokens"],
        "prefix_cache_hit_rate": report["prefix_cache_hit_rate"],
        "worker_share": report["worker_share"],
        **{key: report[key] for key in keys},
    }


def machine_info() -> dict[str, Any]:
    """Where and when: CPU count, load averages (the machine is shared), versions, commit."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "load_average": [round(value, 2) for value in os.getloadavg()],
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "commit": commit,
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def orchestrator_argv(
    manifest: Path, endpoints: Sequence[str], *, token: str, port: int, extra: Sequence[str] = ()
) -> list[str]:
    """``herd orchestrator`` on loopback over the static ``endpoints`` (``URL,INTERNAL_URL``), quiet
    unless ``extra`` says (later flags win)."""
    argv = [sys.executable, "-m", "herd.cli.main", "orchestrator", "--manifest", str(manifest)]
    argv += [arg for endpoint in endpoints for arg in ("--worker", endpoint)]
    argv += [f"--internal-token={token}", "--host", HOST, "--port", str(port), "--log-level", "WARNING"]
    return [*argv, *extra]


def command_line() -> str:
    """This run's command as typed: the interpreter's name, the script and its arguments."""
    return " ".join([Path(sys.executable).name, *sys.argv])


def write_results(path: Path, results: dict[str, Any], *, command: str, shown: Any = None) -> None:
    """``results`` after the command that made them and the machine, as JSON at ``path``; ``shown``
    printed (default: the whole document)."""
    document = {"command": command, "machine": machine_info(), **results}
    write_json(path, document)
    print(json.dumps(document if shown is None else shown, indent=2))


def write_report(
    args: Any, engine: dict[str, Any], runs: list[dict[str, Any]], summary: dict[str, Any], **extra: Any
) -> None:
    """The run's JSON at ``args.out`` (its command, the machine, the settings, ``extra``, every run and
    the summary); the summary printed."""
    settings = {
        key: str(value) if isinstance(value, Path) else value
        for key, value in vars(args).items()
        if key != "out"
    } | {"engine": engine}
    results = {"settings": settings, **extra, "runs": runs, "summary": summary}
    write_results(args.out, results, command=command_line(), shown=summary)
