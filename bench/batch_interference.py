"""Issue 21's batch benchmark: interactive TTFT p99 while a Batch API job keeps the fleet at 2x capacity.

``--replicas`` simulated workers (``herd worker --replicas N``, 2 by default, the cost-model engine on
the demo model's config and tokenizer, ``maxBatchSize`` 4 and ``maxQueueLen`` 4: 4 sequences run at
once on each, the gateway holds at most 8 on each) behind ``herd orchestrator --batch-dir``.
Interactive clients (``--users``, a closed loop: each streams a short chat, reads its first token,
reads to the end, sends the next) measure their time to first token. The setups differ in one thing:

* ``alone``: only the interactive clients.
* ``with-batch``: before they start, a batch of ``--batch-lines`` completions (``--batch-output``
  tokens each) is uploaded and created through ``/v1/files`` and ``/v1/batches``; the gateway runs
  ``--batch-concurrency`` lines at once (by default twice the sequences the fleet runs: 16 on 2
  workers), at the lowest priority; the interactive window starts once the fleet holds as many as
  the gateway lets it (``--batch-concurrency``, at most the part of each worker's 8 slots that
  background work may take, ``herd.orchestrator.routing.reserve``: 6 a worker by default), and the
  batch is cancelled after.
* ``with-batch-headroom``: ``with-batch`` with the gateway's idle headroom on
  (``--batch-idle-max-share``, ``herd.orchestrator.routing.headroom``): batch lines leave up to that
  share of the workers free of batch work while interactive requests are recent, and
  ``--idle-min-workers`` of them even without (``--batch-idle-min-workers``, 0 by default). ``alone``
  and ``with-batch`` run with it off (``--batch-idle-max-share 0``), as the gateway ran before it.

Each run has a fresh orchestrator and batch folder; the setups alternate over ``--rounds`` rounds
(forward, then reversed). The figure is the interactive TTFT p99 with the batch over the same round's
without (target <= 1.2), with and without headroom; each run also records the batch lines completed in
its window and the machine's load average.

    .venv/bin/python bench/batch_interference.py --rounds 3 --out bench/results/batch_interference.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from _common import (
    DEMO_MODEL,
    HOST,
    demo_manifest,
    free_port,
    herd_worker_argv,
    orchestrator_argv,
    serving,
    thread_env,
    write_report,
)

from herd.cli.up import free_port_block
from herd.orchestrator.routing.headroom import IdleHeadroom
from herd.orchestrator.routing.reserve import DEFAULT_RESERVE, background_limit

NAME = "sim"
TOKEN = "batch-interference"
MAX_BATCH_SIZE = 4
MAX_QUEUE_LEN = 4
ENGINE = {
    "backend": "simulated",
    "maxModelLen": 1024,
    "maxBatchSize": MAX_BATCH_SIZE,
    "maxQueueLen": MAX_QUEUE_LEN,
}
SETUPS = ("alone", "with-batch", "with-batch-headroom")
SETTLE_S = 5.0
BATCH_SETUPS = SETUPS[1:]


async def user(
    client: httpx.AsyncClient,
    number: int,
    args: argparse.Namespace,
    deadline: float,
    ttfts: list[tuple[float, float]],
) -> None:
    """One closed-loop user; ``ttfts`` gains (seconds before the window ends when sent, TTFT)."""
    turn = 0
    while time.monotonic() < deadline:
        body = {
            "model": NAME,
            "messages": [{"role": "user", "content": f"User {number}, question {turn}: name a colour."}],
            "max_tokens": args.output_len,
            "ignore_eos": True,
            "stream": True,
        }
        turn += 1
        started, first = time.monotonic(), None
        left = deadline - started
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                await asyncio.sleep(0.1)
                continue
            async for line in response.aiter_lines():
                if (
                    first is None
                    and line.startswith("data: {")
                    and '"content":""' not in line.replace(" ", "")
                ):
                    first = time.monotonic() - started
        if first is not None:
            ttfts.append((left, first))


async def start_batch(client: httpx.AsyncClient, args: argparse.Namespace) -> str:
    lines = [
        {
            "custom_id": f"line-{n}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": NAME,
                "prompt": f"Batch document {n}: summarize it.",
                "max_tokens": args.batch_output,
                "ignore_eos": True,
            },
        }
        for n in range(args.batch_lines)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = await client.post(
        "/v1/files", files={"file": ("batch.jsonl", content)}, data={"purpose": "batch"}
    )
    upload.raise_for_status()
    body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    batch = await client.post("/v1/batches", json=body)
    batch.raise_for_status()
    return str(batch.json()["id"])


async def busy_slots(client: httpx.AsyncClient) -> int:
    rows = (await client.get("/dashboard/data")).json()["workers"]
    return sum(int(row.get("in_flight", 0)) for row in rows)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1)


async def run(url: str, args: argparse.Namespace, setup: str) -> dict[str, Any]:
    ttfts: list[tuple[float, float]] = []
    async with httpx.AsyncClient(
        base_url=url, timeout=300.0, limits=httpx.Limits(max_connections=256)
    ) as client:
        batch_id = None
        batch_in_flight = 0
        if setup in BATCH_SETUPS:
            batch_id = await start_batch(client, args)
            cap = MAX_BATCH_SIZE + MAX_QUEUE_LEN  # the gateway's slots on a worker
            # A standing reserve keeps its workers free of batch lines from the start.
            kept = args.idle_min_workers if setup == "with-batch-headroom" else 0
            batch_workers = args.replicas - min(kept, args.replicas - 1)
            fill = min(args.batch_concurrency, batch_workers * background_limit(cap, DEFAULT_RESERVE))
            for _ in range(300):  # up to a minute for the gateway to fill the fleet with batch lines
                if (batch_in_flight := await busy_slots(client)) >= fill:
                    break
                await asyncio.sleep(0.2)
        deadline = time.monotonic() + args.seconds
        await asyncio.gather(*(user(client, n, args, deadline, ttfts) for n in range(args.users)))
        completed = None
        if batch_id is not None:
            counts = (await client.get(f"/v1/batches/{batch_id}")).json()["request_counts"]
            completed = counts["completed"]
            await client.post(f"/v1/batches/{batch_id}/cancel")
    values = [ttft for _, ttft in ttfts]
    settled = [ttft for left, ttft in ttfts if left <= args.seconds - SETTLE_S]
    return {
        "setup": setup,
        "num_interactive": len(values),
        "ttft_p50_ms": round(1000 * statistics.median(values), 1),
        "ttft_p99_ms": p99(values),
        # A diagnostic, not the figure: the requests sent from SETTLE_S into the window on (the
        # headroom's workers drain their batch lines first).
        "ttft_p99_after_settle_ms": p99(settled) if settled else None,
        "batch_lines_completed": completed,
        "batch_in_flight_at_start": batch_in_flight,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def measure(args: argparse.Namespace, setup: str, endpoints: list[str], log_dir: Path) -> dict[str, Any]:
    manifest_path = log_dir / "manifest.yaml"
    manifest_path.write_text(json.dumps(demo_manifest(NAME, ENGINE, replicas=args.replicas)))
    batch_dir = log_dir / f"batches-{setup}"
    shutil.rmtree(batch_dir, ignore_errors=True)
    port = free_port()
    batch = [
        "--batch-dir",
        str(batch_dir),
        "--batch-concurrency",
        str(args.batch_concurrency),
        "--no-access-log",
        "--batch-idle-max-share",
        str(args.idle_max_share if setup == "with-batch-headroom" else 0.0),
        "--batch-idle-min-workers",
        str(args.idle_min_workers if setup == "with-batch-headroom" else 0),
    ]
    argv = orchestrator_argv(manifest_path, endpoints, token=TOKEN, port=port, extra=batch)
    url = f"http://{HOST}:{port}"
    with serving(argv, ready_url=f"{url}/health", log=log_dir / f"orchestrator-{setup}.log", env={}):
        time.sleep(2.0)  # a few health polls admit both workers
        result = asyncio.run(run(url, args, setup))
        time.sleep(args.batch_output * 0.1)  # the cancelled batch's lines in flight end before the next run
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2, help="simulated workers of the same shape")
    parser.add_argument(
        "--users", type=int, default=2, help="interactive clients (a quarter of 2 workers' 8 running slots)"
    )
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--batch-lines", type=int, default=5000)
    parser.add_argument("--batch-output", type=int, default=32)
    parser.add_argument(
        "--batch-concurrency",
        type=int,
        default=None,
        help="batch lines the gateway runs at once (default: twice the sequences the fleet runs)",
    )
    parser.add_argument(
        "--idle-max-share",
        type=float,
        default=IdleHeadroom().max_share,
        help="--batch-idle-max-share of the with-batch-headroom setup (the gateway's default)",
    )
    parser.add_argument(
        "--idle-min-workers",
        type=int,
        default=IdleHeadroom().min_workers,
        help="--batch-idle-min-workers of the with-batch-headroom setup (a standing reserve; default 0)",
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="the interactive window of each run")
    parser.add_argument("--out", type=Path, default=Path("bench/results/batch_interference.json"))
    args = parser.parse_args()
    if args.batch_concurrency is None:
        args.batch_concurrency = 2 * args.replicas * MAX_BATCH_SIZE
    log_dir = Path("/tmp/herd-batch-interference")
    log_dir.mkdir(parents=True, exist_ok=True)
    num = args.replicas
    ports = free_port_block(2 * num)
    argv = herd_worker_argv(
        DEMO_MODEL, name=NAME, port=ports[0], internal_port=ports[num], token=TOKEN, engine=ENGINE
    )
    argv += ["--replicas", str(num)]
    endpoints = [f"http://{HOST}:{ports[n]},http://{HOST}:{ports[num + n]}" for n in range(num)]
    runs: list[dict[str, Any]] = []
    with serving(
        argv,
        ready_url=f"http://{HOST}:{ports[num - 1]}/ready",
        log=log_dir / "workers.log",
        env=thread_env(1),
    ):
        for number in range(args.rounds):
            for setup in SETUPS if number % 2 == 0 else reversed(SETUPS):
                entry = {"round": number, **measure(args, setup, endpoints, log_dir)}
                print(json.dumps(entry), flush=True)
                runs.append(entry)
    summary: dict[str, Any] = {
        setup: {
            key: [run[key] for run in runs if run["setup"] == setup]
            for key in ("ttft_p99_ms", "ttft_p50_ms", "ttft_p99_after_settle_ms", "batch_lines_completed")
        }
        for setup in SETUPS
    }
    for setup in BATCH_SETUPS:
        for key in ("ttft_p99_ms", "ttft_p50_ms"):
            ratios = [
                round(mine / alone, 3)
                for mine, alone in zip(summary[setup][key], summary["alone"][key], strict=True)
            ]
            summary[setup][f"{key.removesuffix('_ms')}_ratio"] = ratios
            summary[setup][f"median_{key.removesuffix('_ms')}_ratio"] = statistics.median(ratios)
    write_report(args, ENGINE, runs, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
