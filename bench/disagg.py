"""Issue 5: disaggregated prefill/decode (1 prefill + 1 decode) against 2 unified workers.

Equal worker count: each setup is one ``herd up`` of SmolLM2-135M-Instruct (fp32, CPU) with two
worker processes and the orchestrator, the same engine block, one torch thread per process. The
workload is mixed and identical for both, sent by herd's load generator (``herd.cli.loadgen``, what
``herd bench`` runs) as two concurrent streams in one event loop:

- decode traffic: ``--num-short`` short chat requests (``--short-input`` words) kept
  ``--short-concurrency`` in flight, each generating ``--short-output`` tokens;
- long prompts: ``--long-input`` words (>= 1024 tokens), Poisson arrivals at ``--long-rate`` per
  second, each generating ``--long-output`` tokens; they arrive while the short requests decode.

With 2 unified workers a long prompt's prefill runs in the same engine steps as the decodes of the
requests sharing its worker (chunks of ``maxBatchTokens`` tokens), stalling them: that is what ITL
p99 shows. With disaggregation the prefill worker computes it and the decode worker only imports
the blocks and computes the prompt's partial last block. The short prompts are below
``prefillThresholdTokens`` and prefill on the decode worker in both setups.

Reported per setup and per stream: TTFT, ITL and E2E (p50/p99); for the disaggregated setup the
transfer overhead per long request from the decode worker's metrics (bytes, blocks, seconds) and the
orchestrator's per-phase timings. The setups run one after the other, each started fresh, warmed up
(two short and one long request), measured, then stopped by pid.

    .venv/bin/python bench/disagg.py                          # writes bench/results/disagg.json
    .venv/bin/python bench/disagg.py --num-short 6 --num-long 2 --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from _common import (
    DEMO_MODEL,
    HOST,
    REPO,
    free_port,
    machine_info,
    serving,
    summary_row,
    thread_env,
    write_json,
)
from prometheus_client.parser import text_string_to_metric_families

from herd.cli.loadgen import BenchConfig, run_benchmark

__all__ = ["main"]

SERVED_NAME = "smollm2"
ITL_TARGET = 1.5
TTFT_LIMIT = 1.3


def manifest(args: argparse.Namespace, *, disaggregated: bool) -> str:
    pools = (
        "serving: {mode: disaggregated, prefillThresholdTokens: 256}\n  prefill: {replicas: 1}\n"
        "  decode: {replicas: 1}"
        if disaggregated
        else "workers: {replicas: 2}"
    )
    return f"""apiVersion: herd.dev/v1alpha1
kind: ModelDeployment
metadata: {{name: bench-{"disagg" if disaggregated else "unified"}}}
spec:
  model: {{source: "file://{args.model}", servedName: {SERVED_NAME}}}
  engine:
    dtype: float32
    device: cpu
    maxModelLen: 2048
    maxBatchTokens: {args.max_batch_tokens}
    kvCache: {{blockSize: 16, memoryGiB: 1}}
  {pools}
  routing: {{strategy: {args.strategy}}}
"""


def stream_configs(url: str, args: argparse.Namespace, *, warmup: bool) -> list[BenchConfig]:
    """The two request streams: short requests decoding, long prompts arriving among them."""
    common = {"url": url, "model": SERVED_NAME, "timeout_s": 600.0}
    seed = args.seed + 1000 if warmup else args.seed  # warm-up prompts must not be measured prompts
    short = BenchConfig(
        **common,
        input_len=args.short_input,
        output_len=str(args.short_output),
        concurrency=args.short_concurrency,
        num_requests=2 if warmup else args.num_short,
        seed=seed,
    )
    long = BenchConfig(
        **common,
        input_len=str(args.long_input),
        output_len=str(args.long_output),
        request_rate=args.long_rate,
        concurrency=2,
        num_requests=1 if warmup else args.num_long,
        seed=seed + 1,
    )
    return [short, long]


async def run_streams(configs: list[BenchConfig]) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(run_benchmark(config) for config in configs)))


def decode_url(gateway: str) -> str:
    """The decode worker's public URL, from the orchestrator's dashboard data."""
    rows = httpx.get(f"{gateway}/dashboard/data", timeout=10).json()["workers"]
    return str(next(row["url"] for row in rows if row["role"] == "decode"))


def metric_sums(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Totals of the named samples (summed over labels) on a ``/metrics`` page."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def transfer_overhead(gateway: str) -> dict[str, Any]:
    """Per pulled request on the decode worker, and the orchestrator's per-phase means."""
    sums = metric_sums(
        decode_url(gateway),
        (
            "herd_kv_transfer_seconds_sum",
            "herd_kv_transfer_seconds_count",
            "herd_kv_transfer_bytes_total",
            "herd_kv_transfer_blocks_total",
        ),
    )
    pulls = sums["herd_kv_transfer_seconds_count"] or 1.0
    phases = _phase_means(httpx.get(f"{gateway}/metrics", timeout=10).text)
    return {
        "num_pulls": int(sums["herd_kv_transfer_seconds_count"]),
        "seconds_per_request": round(sums["herd_kv_transfer_seconds_sum"] / pulls, 4),
        "megabytes_per_request": round(sums["herd_kv_transfer_bytes_total"] / pulls / 2**20, 2),
        "blocks_per_request": round(sums["herd_kv_transfer_blocks_total"] / pulls, 1),
        "phase_mean_seconds": phases,
    }


def _phase_means(text: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            phase = sample.labels.get("phase")
            if phase and sample.name == "herd_router_phase_seconds_sum":
                sums[phase] = sums.get(phase, 0.0) + sample.value
            elif phase and sample.name == "herd_router_phase_seconds_count":
                counts[phase] = counts.get(phase, 0.0) + sample.value
    return {phase: round(sums[phase] / counts[phase], 4) for phase in sums if counts.get(phase)}


def measure(args: argparse.Namespace, *, disaggregated: bool, log_dir: Path) -> dict[str, Any]:
    name = "disaggregated" if disaggregated else "unified"
    path = log_dir / f"{name}.yaml"
    path.write_text(manifest(args, disaggregated=disaggregated))
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "herd.cli.main",
        "up",
        str(path),
        "--port",
        str(port),
        "--log-dir",
        str(log_dir / name),
        "--log-level",
        "WARNING",
        "--ready-timeout",
        "600",
    ]
    up_log = log_dir / f"{name}-up.log"
    gateway = f"http://{HOST}:{port}"
    with serving(argv, ready_url=f"{gateway}/ready", log=up_log, env=thread_env(args.threads), timeout=900):
        asyncio.run(run_streams(stream_configs(gateway, args, warmup=True)))
        short, long = asyncio.run(run_streams(stream_configs(gateway, args, warmup=False)))
        result = {"setup": name, "short": summary_row(short), "long": summary_row(long)}
        if disaggregated:
            result["transfer"] = transfer_overhead(gateway)
    print(json.dumps(result, indent=2), flush=True)
    return result


def compare(unified: dict[str, Any], disagg: dict[str, Any]) -> dict[str, Any]:
    """The acceptance ratios: ITL p99 of the decoding (short) requests, TTFT p50 of every stream."""
    itl = unified["short"]["itl_ms"]["p99"] / disagg["short"]["itl_ms"]["p99"]
    ttft = {
        stream: disagg[stream]["ttft_ms"]["p50"] / unified[stream]["ttft_ms"]["p50"]
        for stream in ("short", "long")
    }
    return {
        "itl_p99_unified_over_disagg": round(itl, 2),
        "itl_target_met": itl >= ITL_TARGET,
        "ttft_p50_disagg_over_unified": {stream: round(value, 2) for stream, value in ttft.items()},
        "ttft_limit_met": all(value <= TTFT_LIMIT for value in ttft.values()),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--strategy", default="least_request")
    parser.add_argument("--max-batch-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--short-input", default="32:96")
    parser.add_argument("--short-output", type=int, default=64)
    parser.add_argument("--short-concurrency", type=int, default=4)
    parser.add_argument("--num-short", type=int, default=16)
    parser.add_argument("--long-input", type=int, default=1100)
    parser.add_argument("--long-output", type=int, default=16)
    parser.add_argument("--long-rate", type=float, default=0.15, help="long prompts per second")
    parser.add_argument("--num-long", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "disagg.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="herd-bench-disagg-") as folder:
        unified = measure(args, disaggregated=False, log_dir=Path(folder))
        disagg = measure(args, disaggregated=True, log_dir=Path(folder))
    command = " ".join(
        shlex.quote(part) for part in [".venv/bin/python", "bench/disagg.py", *(argv or sys.argv[1:])]
    )
    report = {
        "benchmark": "disaggregated prefill/decode (1+1) vs unified (2), mixed workload",
        "command": command,
        "machine": machine_info(),
        "settings": {key: str(value) for key, value in vars(args).items() if key != "out"},
        "unified": unified,
        "disaggregated": disagg,
        "comparison": compare(unified, disagg),
    }
    write_json(args.out, report)
    print(json.dumps(report["comparison"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
