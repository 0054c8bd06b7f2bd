"""Issue 14: where kv_cache_aware's time goes against round robin's on ``herd up`` with 2 workers.

Each run starts a fresh ``herd up`` (2 workers, KV pools of ``--kv-gib``) with one strategy and sends
the issue's load through ``herd bench``'s client: 8 tenants with a ~500-token system prompt
(``--prefix-len`` words), ``--input-len`` words of user turn, 16-token answers, 8 in flight. Rounds
alternate the order of the strategies. Besides the client's report, each run records:

* the TTFT split, by the means of three histograms over the run: the client's TTFT, the gateway's
  (``herd_router_time_to_first_token_seconds``, from the moment the request is parsed, tokenized and
  about to be routed) and the workers' own (``vllm:time_to_first_token_seconds``, from arrival in
  the engine). Client minus gateway is parsing and tokenizing (and the client's own overhead),
  gateway minus worker the proxy hop, the worker's own the engine queue and the prefill;
* per-worker in flight (the gateway's count), running and waiting (the engine's last load report),
  sampled every ``--sample-ms`` from ``/dashboard/data``: the mean of max/mean in flight over the
  samples with any in flight, and the share of samples where a worker had requests waiting.

``--prepare-busy 0,4`` starts no server: it times the gateway's prepare step (parse, render, tokenize,
hash) on the workload's bodies inline, on a plain thread and on ``PromptThreads`` (niced 10 below its
caller), while that many processes spin at normal priority, as CPU-bound workers on the same host do.

    .venv/bin/python bench/kv_aware_diagnosis.py --backend simulated --rounds 3 \\
        --out bench/results/kv_aware_diagnosis_simulated.json
    .venv/bin/python bench/kv_aware_diagnosis.py --backend herd --rounds 3 \\
        --out bench/results/kv_aware_diagnosis_herd.json
    .venv/bin/python bench/kv_aware_diagnosis.py --prepare-busy 0,2,4 \\
        --out bench/results/kv_aware_diagnosis_prepare.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from _common import (
    DEMO_MODEL,
    HOST,
    REPO,
    free_port,
    machine_info,
    metric_sums,
    run_load,
    running,
    thread_env,
    wait_until,
    write_json,
)

from herd.api.kv_hash import block_hashes
from herd.api.metrics import HERD_ROUTER_TTFT_SECONDS, TIME_TO_FIRST_TOKEN_SECONDS
from herd.api.openai import ChatCompletionRequest
from herd.api.prompt import PromptRenderer, PromptThreads
from herd.cli.loadgen import BenchConfig

__all__ = ["main"]

SERVED_NAME = "smollm2"
BLOCK_SIZE = 16
# The calibrated cost model of examples/smollm2-simulated.yaml.
SIMULATED_ENGINE = {
    "backend": "simulated",
    "simulation": {"costModel": {"stepMs": 39.2, "seqMs": 23.1, "tokenMs": 2.08}},
}
HERD_ENGINE = {"dtype": "float32"}
THREADS = thread_env(1)
"""One torch thread per real worker: with torch's default (one per core), the two workers' OpenMP
threads spin against each other and the host's other processes (36 s per engine step seen here)."""


def manifest(backend: str, strategy: str, kv_gib: float) -> dict[str, Any]:
    """The issue's deployment: the demo model on 2 workers with small KV pools, one strategy."""
    engine = {
        **(SIMULATED_ENGINE if backend == "simulated" else HERD_ENGINE),
        "device": "cpu",
        "maxModelLen": 2048,
        "maxBatchSize": 32,
        "maxBatchTokens": 1024,
        "kvCache": {"blockSize": BLOCK_SIZE, "memoryGiB": kv_gib, "prefixCaching": True},
    }
    return {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": SERVED_NAME},
        "spec": {
            "model": {"source": "file://.cache/models/smollm2-135m-instruct", "servedName": SERVED_NAME},
            "engine": engine,
            "workers": {
                "replicas": 2,
                "resources": {"accelerator": {"vendor": "none"}},
                "env": THREADS if backend == "herd" else {},
            },
            "routing": {"strategy": strategy},
        },
    }


@contextmanager
def herd_up(spec: dict[str, Any], workdir: Path) -> Iterator[str]:
    """``herd up`` of ``spec`` on a free loopback port, once both workers are healthy; its URL."""
    path = workdir / "manifest.json"  # YAML is a superset of JSON
    path.write_text(json.dumps(spec))
    port = free_port()
    url = f"http://{HOST}:{port}"
    argv = [sys.executable, "-m", "herd.cli.main", "up", str(path), "--port", str(port)]
    argv += ["--log-dir", str(workdir / "logs")]
    with running(argv, log=workdir / "up.log", cwd=REPO, grace=30.0) as process:

        def is_ready() -> bool:
            assert process.poll() is None, f"herd up exited ({process.returncode}); see {workdir}/up.log"
            try:
                workers = httpx.get(f"{url}/dashboard/data", timeout=2.0).json()["workers"]
            except httpx.HTTPError:
                return False
            return len(workers) == 2 and all(worker["healthy"] for worker in workers)

        wait_until(is_ready, timeout=300.0, interval=1.0, what=f"herd up at {url} with 2 healthy workers")
        yield url


class Sampler:
    """Per-worker in flight, running and waiting from ``/dashboard/data``, on a thread, until stopped."""

    def __init__(self, url: str, interval_s: float) -> None:
        self.samples: list[list[tuple[int, int, int]]] = []
        self._url, self._interval_s = url, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.wait(self._interval_s):
                workers = client.get(f"{self._url}/dashboard/data").json()["workers"]
                self.samples.append([(w["in_flight"], w["running"], w["waiting"]) for w in workers])

    def summary(self) -> dict[str, float]:
        busy = [sample for sample in self.samples if sum(w[0] for w in sample)]
        ratios = [max(w[0] for w in s) / statistics.fmean(w[0] for w in s) for s in busy]
        return {
            "num_samples": len(self.samples),
            "in_flight_max_over_mean": round(statistics.fmean(ratios), 3) if ratios else 0.0,
            "in_flight_mean_abs_gap": round(statistics.fmean(abs(s[0][0] - s[1][0]) for s in busy), 3)
            if busy
            else 0.0,
            "waiting_share": round(sum(any(w[2] for w in s) for s in self.samples) / len(self.samples), 3)
            if self.samples
            else 0.0,
        }


def ttft_means(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the gateway's TTFT histogram and of the workers' own, summed over workers."""
    workers = httpx.get(f"{url}/dashboard/data", timeout=5.0).json()["workers"]
    engine = [_histogram(worker["url"], TIME_TO_FIRST_TOKEN_SECONDS) for worker in workers]
    return {
        "gateway": _histogram(url, HERD_ROUTER_TTFT_SECONDS),
        "worker": (sum(total for total, _ in engine), sum(count for _, count in engine)),
    }


def _histogram(url: str, name: str) -> tuple[float, float]:
    sums = metric_sums(url, (f"{name}_sum", f"{name}_count"))
    return sums[f"{name}_sum"], sums[f"{name}_count"]


def split_ms(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """The mean TTFT of the run's requests at the gateway and in the engines, in ms."""
    means = {}
    for key in before:
        total, count = (after[key][i] - before[key][i] for i in (0, 1))
        means[f"{key}_ttft_mean_ms"] = round(1000 * total / count, 1) if count else 0.0
    return means


def one_run(args: argparse.Namespace, strategy: str, seed: int) -> dict[str, Any]:
    spec = manifest(args.backend, strategy, args.kv_gib)
    with tempfile.TemporaryDirectory(prefix="kv-diag-") as folder, herd_up(spec, Path(folder)) as url:
        config = BenchConfig(
            url=url,
            workload="shared-prefix",
            num_tenants=args.num_tenants,
            prefix_len=args.prefix_len,
            input_len=args.input_len,
            output_len=args.output_len,
            concurrency=args.concurrency,
            num_requests=args.num_requests,
            seed=seed,
        )
        before = ttft_means(url)
        with Sampler(url, args.sample_ms / 1000) as sampler:
            report = run_load(config)
        after = ttft_means(url)
    return {"strategy": strategy, "seed": seed, **row(report), **split_ms(before, after), **sampler.summary()}


def row(report: dict[str, Any]) -> dict[str, Any]:
    ttft = report["ttft_ms"]
    return {
        "num_completed": report["num_completed"],
        "num_errors": report["num_errors"],
        "hit_rate": report["prefix_cache_hit_rate"],
        "ttft_p50_ms": ttft["p50"],
        "ttft_p99_ms": ttft["p99"],
        "client_ttft_mean_ms": ttft["mean"],
        "itl_p50_ms": report["itl_ms"]["p50"],
        "output_tok_s": report["output_token_throughput"],
        "worker_share": report["worker_share"],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["simulated", "herd"], default="simulated")
    parser.add_argument("--strategies", default="kv_cache_aware,round_robin")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-gib", type=float, default=0.3, help="each worker's KV pool (the issue's 0.3)")
    parser.add_argument("--num-tenants", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=500, help="system prompt words (~540 tokens)")
    parser.add_argument("--input-len", default="16:32", help="user turn words")
    parser.add_argument("--output-len", default="16")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="round r draws its requests with seed + r")
    parser.add_argument("--sample-ms", type=float, default=100.0)
    parser.add_argument(
        "--prepare-busy",
        default=None,
        help="instead: time the gateway's prepare step with N,M,... busy processes (no servers)",
    )
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def serving_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    strategies = [name.strip() for name in args.strategies.split(",")]
    runs = []
    for number in range(args.rounds):
        order = strategies if number % 2 == 0 else strategies[::-1]
        for strategy in order:
            runs.append({"round": number, **one_run(args, strategy, seed=args.seed + number)})
            print(json.dumps(runs[-1]), flush=True)
    return runs


def prepare_bodies(args: argparse.Namespace) -> list[bytes]:
    """Chat bodies of the run's workload, as the gateway receives them."""
    config = BenchConfig(
        url="http://unused",
        workload="shared-prefix",
        num_tenants=args.num_tenants,
        prefix_len=args.prefix_len,
        input_len=args.input_len,
        output_len=args.output_len,
        concurrency=1,
        num_requests=1,
    )
    workload = config.build_workload()
    specs = [workload.next_request() for _ in range(40)]
    return [
        json.dumps({"model": SERVED_NAME, "messages": s.messages, "max_tokens": 16}).encode() for s in specs
    ]


async def prepare_latency_ms(
    bodies: list[bytes], run: Callable[[bytes], Awaitable[object]]
) -> dict[str, float]:
    """p50, p90 and max of ``run`` over the bodies, one at a time, 50 ms apart (a request's own wait)."""
    latencies = []
    for body in bodies:
        started = time.perf_counter()
        await run(body)
        latencies.append(1000 * (time.perf_counter() - started))
        await asyncio.sleep(0.05)
    latencies.sort()
    return {
        "p50": round(statistics.median(latencies), 1),
        "p90": round(latencies[int(0.9 * len(latencies))], 1),
        "max": round(latencies[-1], 1),
    }


async def prepare_paths(bodies: list[bytes]) -> dict[str, dict[str, float]]:
    """The gateway's prepare step (parse, render, tokenize, hash) inline, on a plain thread and on
    ``PromptThreads`` (niced 10 below the caller)."""
    renderer = PromptRenderer.from_pretrained(DEMO_MODEL)

    def prepare(body: bytes) -> list[int]:
        ids = renderer.chat_request_ids(ChatCompletionRequest.model_validate_json(body))
        return block_hashes(ids, BLOCK_SIZE, model_id=SERVED_NAME)

    niced, plain = PromptThreads("diag-prepare", 2), ThreadPoolExecutor(2)
    loop = asyncio.get_running_loop()

    async def inline(body: bytes) -> object:
        return prepare(body)

    try:
        return {
            "inline": await prepare_latency_ms(bodies, inline),
            "thread": await prepare_latency_ms(bodies, lambda b: loop.run_in_executor(plain, prepare, b)),
            "niced_thread": await prepare_latency_ms(bodies, lambda b: niced.run(prepare, b)),
        }
    finally:
        niced.close()
        plain.shutdown()


def prepare_under_contention(args: argparse.Namespace, num_busy: int) -> dict[str, Any]:
    """``prepare_paths`` while ``num_busy`` processes spin at normal priority (as CPU-bound workers do)."""
    spin = [sys.executable, "-c", "while True: pass"]
    with tempfile.TemporaryDirectory(prefix="kv-diag-busy-") as folder, contextlib.ExitStack() as stack:
        for number in range(num_busy):
            stack.enter_context(running(spin, log=Path(folder) / f"busy-{number}.log", grace=2.0))
        return {"num_busy": num_busy, **asyncio.run(prepare_paths(prepare_bodies(args)))}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = []
    if args.prepare_busy is not None:
        for num_busy in (int(n) for n in args.prepare_busy.split(",")):
            runs.append(prepare_under_contention(args, num_busy))
            print(json.dumps(runs[-1]), flush=True)
    else:
        runs = serving_runs(args)
    if args.out is not None:
        command = ["python", "bench/kv_aware_diagnosis.py", *(argv if argv is not None else sys.argv[1:])]
        write_json(
            args.out,
            {
                "benchmark": "kv_aware_diagnosis",
                "command": " ".join(command),
                "machine": machine_info(),
                "runs": runs,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
