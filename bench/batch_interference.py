"""Issue 21's batch benchmark: interactive TTFT p99 while a Batch API job keeps the fleet at 2x capacity.

Two simulated workers (``herd worker --replicas 2``, the cost-model engine on the demo model's config
and tokenizer, ``maxBatchSize`` 4 and ``maxQueueLen`` 4: 8 sequences run at once, the gateway holds
at most 16 on the fleet) behind ``herd orchestrator --batch-dir``. Interactive clients (``--users``,
a closed loop: each streams a short chat, reads its first token, reads to the end, sends the next)
measure their time to first token. The two setups differ in one thing:

* ``alone``: only the interactive clients.
* ``with-batch``: before they start, a batch of ``--batch-lines`` completions (``--batch-output``
  tokens each) is uploaded and created through ``/v1/files`` and ``/v1/batches``; the gateway runs
  ``--batch-concurrency`` lines at once (16: twice the 8 sequences the fleet runs), at the lowest
  priority; the interactive window starts once the fleet holds as many as the gateway lets it
  (``--batch-concurrency``, at most the part of each worker's 8 slots that background work may take,
  ``herd.orchestrator.routing.reserve``: 6 a worker by default), and the batch is cancelled after.

Each run has a fresh orchestrator and batch folder; the setups alternate over ``--rounds`` rounds.
The figure is the interactive TTFT p99 with the batch over the same round's without (target <= 1.2).

    .venv/bin/python bench/batch_interference.py --rounds 3 --out bench/results/batch_interference.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from herd.orchestrator.routing.reserve import DEFAULT_RESERVE, background_limit

NUM_WORKERS = 2
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
SETUPS = ("alone", "with-batch")


async def user(
    client: httpx.AsyncClient, number: int, args: argparse.Namespace, deadline: float, ttfts: list[float]
) -> None:
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
            ttfts.append(first)


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


async def run(url: str, args: argparse.Namespace, setup: str) -> dict[str, Any]:
    ttfts: list[float] = []
    async with httpx.AsyncClient(
        base_url=url, timeout=300.0, limits=httpx.Limits(max_connections=256)
    ) as client:
        batch_id = None
        batch_in_flight = 0
        if setup == "with-batch":
            batch_id = await start_batch(client, args)
            cap = MAX_BATCH_SIZE + MAX_QUEUE_LEN  # the gateway's slots on a worker
            fill = min(args.batch_concurrency, NUM_WORKERS * background_limit(cap, DEFAULT_RESERVE))
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
    ordered = sorted(ttfts)
    return {
        "setup": setup,
        "num_interactive": len(ordered),
        "ttft_p50_ms": round(1000 * statistics.median(ordered), 1),
        "ttft_p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
        "batch_lines_completed": completed,
        "batch_in_flight_at_start": batch_in_flight,
    }


def measure(args: argparse.Namespace, setup: str, endpoints: list[str], log_dir: Path) -> dict[str, Any]:
    manifest_path = log_dir / "manifest.yaml"
    manifest_path.write_text(json.dumps(demo_manifest(NAME, ENGINE, replicas=2)))
    batch_dir = log_dir / f"batches-{setup}"
    shutil.rmtree(batch_dir, ignore_errors=True)
    port = free_port()
    batch = [
        "--batch-dir",
        str(batch_dir),
        "--batch-concurrency",
        str(args.batch_concurrency),
        "--no-access-log",
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
    parser.add_argument(
        "--users", type=int, default=2, help="interactive clients (a quarter of the fleet's 8 running slots)"
    )
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--batch-lines", type=int, default=5000)
    parser.add_argument("--batch-output", type=int, default=32)
    parser.add_argument(
        "--batch-concurrency", type=int, default=16, help="twice the 8 sequences the fleet runs"
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="the interactive window of each run")
    parser.add_argument("--out", type=Path, default=Path("bench/results/batch_interference.json"))
    args = parser.parse_args()
    log_dir = Path("/tmp/herd-batch-interference")
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = free_port_block(4)
    argv = herd_worker_argv(
        DEMO_MODEL, name=NAME, port=ports[0], internal_port=ports[2], token=TOKEN, engine=ENGINE
    )
    argv += ["--replicas", str(NUM_WORKERS)]
    endpoints = [f"http://{HOST}:{ports[n]},http://{HOST}:{ports[2 + n]}" for n in range(NUM_WORKERS)]
    runs: list[dict[str, Any]] = []
    with serving(
        argv, ready_url=f"http://{HOST}:{ports[1]}/ready", log=log_dir / "workers.log", env=thread_env(1)
    ):
        for number in range(args.rounds):
            for setup in SETUPS if number % 2 == 0 else reversed(SETUPS):
                entry = {"round": number, **measure(args, setup, endpoints, log_dir)}
                print(json.dumps(entry), flush=True)
                runs.append(entry)
    ratios = []
    for number in range(args.rounds):
        by_setup = {run["setup"]: run for run in runs if run["round"] == number}
        ratios.append(round(by_setup["with-batch"]["ttft_p99_ms"] / by_setup["alone"]["ttft_p99_ms"], 3))
    summary = {
        "p99_ratio": ratios,
        "median_p99_ratio": statistics.median(ratios),
        **{
            setup: {
                "ttft_p99_ms": [run["ttft_p99_ms"] for run in runs if run["setup"] == setup],
                "ttft_p50_ms": [run["ttft_p50_ms"] for run in runs if run["setup"] == setup],
            }
            for setup in SETUPS
        },
    }
    write_report(args, ENGINE, runs, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
