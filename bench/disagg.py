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
``prefillThresholdTokens``: the orchestrator sends them to the prefill worker while its queued
prefill work, theirs included, stays within that threshold (conditional disaggregation), otherwise
they prefill on the decode worker.

Reported per setup and per stream: TTFT, ITL and E2E (p50/p99) and the load average at the end of
the setup's run; for the disaggregated setup the transfer overhead from the decode worker's metrics
(bytes, blocks, seconds): averaged over every pull of the run (long and remotely prefilled short
prompts alike), and for exactly one long request sent alone after the run (``probe``), with the
orchestrator's per-phase timings. The setups run one after the other (unified first unless
``--order disaggregated-first``, to check that the order does not decide the result), each started
fresh, warmed up (two short and one long request), measured, then stopped by pid.

    .venv/bin/python bench/disagg.py                          # writes bench/results/disagg.json
    .venv/bin/python bench/disagg.py --num-short 6 --num-long 2 --out /tmp/smoke.json
    .venv/bin/python bench/disagg.py --transfer-stages   # bench/results/disagg_transfer_stages.json
    .venv/bin/python bench/disagg.py --only-disaggregated --num-short 6 --num-long 2   # its TTFT alone

``--transfer-stages`` times the stages of one long prompt's transfer without a model or a server:
the prefill side's gather of the leased blocks and frame encoding, the decode side's frame decoding
and copy into its pool, on tensors of the benchmark's KV geometry.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch
from _common import (
    DEMO_MODEL,
    HOST,
    REPO,
    free_port,
    machine_info,
    metric_sums,
    serving,
    summary_row,
    thread_env,
    write_json,
)
from prometheus_client.parser import text_string_to_metric_families

from herd.cli.loadgen import BenchConfig, run_benchmark
from herd.worker.kv_transfer import KVLayout, decode_frame, encode_frame

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


_TRANSFER_SAMPLES = (
    "herd_kv_transfer_seconds_sum",
    "herd_kv_transfer_seconds_count",
    "herd_kv_transfer_bytes_total",
    "herd_kv_transfer_blocks_total",
)


def transfer_overhead(gateway: str) -> dict[str, Any]:
    """Per pulled request on the decode worker, and the orchestrator's per-phase means."""
    sums = metric_sums(decode_url(gateway), _TRANSFER_SAMPLES)
    phases = _phase_means(httpx.get(f"{gateway}/metrics", timeout=10).text)
    return {**_per_pull(sums), "phase_mean_seconds": phases}


def _per_pull(sums: dict[str, float]) -> dict[str, Any]:
    pulls = sums["herd_kv_transfer_seconds_count"] or 1.0
    return {
        "num_pulls": int(sums["herd_kv_transfer_seconds_count"]),
        "seconds_per_request": round(sums["herd_kv_transfer_seconds_sum"] / pulls, 4),
        "megabytes_per_request": round(sums["herd_kv_transfer_bytes_total"] / pulls / 2**20, 2),
        "blocks_per_request": round(sums["herd_kv_transfer_blocks_total"] / pulls, 1),
    }


def probe_long_transfer(gateway: str, args: argparse.Namespace) -> dict[str, Any]:
    """The transfer of one long request sent alone after the run (a prompt not seen before)."""
    url = decode_url(gateway)
    before = metric_sums(url, _TRANSFER_SAMPLES)
    config = stream_configs(gateway, args, warmup=True)[1].model_copy(update={"seed": args.seed + 2000})
    report = asyncio.run(run_benchmark(config))
    after = metric_sums(url, _TRANSFER_SAMPLES)
    delta = _per_pull({name: after[name] - before[name] for name in _TRANSFER_SAMPLES})
    return {**delta, "ttft_ms": report["ttft_ms"]["p50"] if report["ttft_ms"] else None}


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
        result["load_average_after_run"] = [round(value, 2) for value in os.getloadavg()]
        if disaggregated:
            result["transfer"] = transfer_overhead(gateway)
            result["transfer"]["probe"] = probe_long_transfer(gateway, args)
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


def transfer_stages(num_blocks: int = 69, repeats: int = 5) -> dict[str, Any]:
    """Median milliseconds per stage of moving ``num_blocks`` blocks (SmolLM2-135M, fp32, 1 GiB pool)."""
    torch.set_num_threads(1)
    layout = KVLayout("smollm2", "float32", 16, 30, 3, 64)
    pool = torch.randn(30, 2, 1400, 16, 3, 64)
    source_ids, target_ids = list(range(100, 100 + num_blocks)), list(range(600, 600 + num_blocks))
    hashes = list(range(num_blocks))
    kv = pool[:, :, source_ids].cpu()
    frame = encode_frame(layout, hashes, kv)
    received = decode_frame(frame)[2]

    def import_blocks() -> None:
        pool[:, :, target_ids] = received

    stages = {
        "gather_leased_blocks": lambda: pool[:, :, source_ids].cpu(),
        "encode_frame": lambda: encode_frame(layout, hashes, kv),
        "decode_frame": lambda: decode_frame(frame),
        "copy_into_pool": import_blocks,
    }
    timings = {name: _median_ms(stage, repeats) for name, stage in stages.items()}
    return {
        "num_blocks": num_blocks,
        "megabytes": round(kv.nbytes / 2**20, 2),
        "frame_overhead_bytes": len(frame) - kv.nbytes,
        "median_ms": timings,
        "load_average": [round(value, 2) for value in os.getloadavg()],
    }


def _median_ms(stage: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        stage()
        samples.append(time.perf_counter() - started)
    return round(statistics.median(samples) * 1000, 1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--strategy", default="least_request")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=256,
        help="engine.maxBatchTokens of both setups: the prefill chunk per step (on one CPU thread a "
        "1,024-token chunk is a 4.5 s step, 256 about 1.1 s)",
    )
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
    parser.add_argument(
        "--order",
        choices=("unified-first", "disaggregated-first"),
        default="unified-first",
        help="which setup runs first",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "disagg.json")
    parser.add_argument(
        "--transfer-stages", action="store_true", help="time the transfer's stages only (no servers)"
    )
    parser.add_argument(
        "--only-disaggregated",
        action="store_true",
        help="run the disaggregated setup alone (its TTFT and transfer, to compare two versions of it)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.transfer_stages:
        stages = {
            "benchmark": "KV transfer stages, 69 blocks",
            "machine": machine_info(),
            **transfer_stages(),
        }
        write_json(REPO / "bench" / "results" / "disagg_transfer_stages.json", stages)
        print(json.dumps(stages, indent=2))
        return 0
    with tempfile.TemporaryDirectory(prefix="herd-bench-disagg-") as folder:
        order = (True, False) if args.order == "disaggregated-first" else (False, True)
        if args.only_disaggregated:
            order = (True,)
        results = {flag: measure(args, disaggregated=flag, log_dir=Path(folder)) for flag in order}
    command = " ".join(
        shlex.quote(part) for part in [".venv/bin/python", "bench/disagg.py", *(argv or sys.argv[1:])]
    )
    report = {
        "benchmark": "disaggregated prefill/decode (1+1) vs unified (2), mixed workload",
        "command": command,
        "machine": machine_info(),
        "settings": {key: str(value) for key, value in vars(args).items() if key != "out"},
        "disaggregated": results[True],
    }
    if False in results:
        report |= {"unified": results[False], "comparison": compare(results[False], results[True])}
    write_json(args.out, report)
    print(json.dumps(report.get("comparison", report["disaggregated"]), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
