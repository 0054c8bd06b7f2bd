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
without (target <= 1.2), with and without headroom, per round and pooled: a round's p99 of about 60
requests is its slowest one, so the summary also pools each setup's requests over its rounds
(``pooled_ttft_p99_ratio``). Each run also records the batch lines completed in its window and the
machine's load average.

Where the tail comes from: each run splits its slowest requests' TTFT (``slowest``) into the
gateway's part (``gateway_ms``: the access log's TTFT, from the gateway taking the request to the
worker's first chunk in: its queue, routing and the worker's time), the relay (``relay_ms``: the
gateway relaying that chunk to the client) and ``held_ms`` (from that chunk to the first with text: a
first token that is one byte of a multi-byte character shows no text until the next token, a decode
step later), with when each was sent (``sent_s`` into the window);
``workers`` gives, for each worker that served interactive requests, the worker's own clock over the
window (its ``/metrics``: requests, mean TTFT and how many took 250 ms or more from its handler
taking the request to its first token, its engine steps' mean), beside how many of its interactive
requests took 250 ms or more at the client. The workers run in one ``herd worker --replicas N``
process by default (one event loop and GIL for all); ``--workers-per-process 1`` runs a process
each, as a pod each would.

    .venv/bin/python bench/batch_interference.py --rounds 3 --out bench/results/batch_interference.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
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
from prometheus_client.parser import text_string_to_metric_families

from herd.api.metrics import HERD_ENGINE_STEP_SECONDS, TIME_TO_FIRST_TOKEN_SECONDS
from herd.api.protocol import REQUEST_ID_HEADER, WORKER_HEADER
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
SLOW_TTFT_S = 0.25
"""A worker-side TTFT bucket bound (``herd.worker``'s histogram has one here): the tail's diagnostic."""
SLOW_MS = int(SLOW_TTFT_S * 1000)


@dataclass(frozen=True)
class Sample:
    """One interactive request: seconds before the window ended when sent, the client's TTFT (to the
    first chunk with text), its first chunk of any kind (the role chunk, sent with the first token),
    its id and the worker that served it (the gateway's ``X-Herd-Worker``)."""

    left: float
    ttft: float
    first_chunk: float
    request_id: str
    worker: str


async def user(
    client: httpx.AsyncClient,
    number: int,
    args: argparse.Namespace,
    deadline: float,
    samples: list[Sample],
    setup: str,
) -> None:
    """One closed-loop user; ``samples`` gains each of its requests with a first token."""
    turn = 0
    while time.monotonic() < deadline:
        body = {
            "model": NAME,
            "messages": [{"role": "user", "content": f"User {number}, question {turn}: name a colour."}],
            "max_tokens": args.output_len,
            "ignore_eos": True,
            "stream": True,
        }
        request_id = f"{setup}-{number}-{turn}"
        turn += 1
        started, first, first_chunk = time.monotonic(), None, None
        left = deadline - started
        headers = {REQUEST_ID_HEADER: request_id}
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                await asyncio.sleep(0.1)
                continue
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {"):
                    at = time.monotonic() - started
                    first_chunk = at if first_chunk is None else first_chunk
                    if '"content":""' not in line.replace(" ", ""):
                        first = at
            worker = response.headers.get(WORKER_HEADER, "")
        if first is not None and first_chunk is not None:
            samples.append(Sample(left, first, first_chunk, request_id, worker))


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


async def worker_figures(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """A worker's own clock so far (its ``/metrics``): requests with a first token, their TTFT sum
    (from the worker's handler taking the request to its first token out) and how many took
    ``SLOW_TTFT_S`` or more, and its engine steps (count, seconds)."""
    text = (await client.get(f"{url}/metrics")).raise_for_status().text
    figures = dict.fromkeys(("ttft_count", "ttft_sum", "ttft_fast", "step_count", "step_sum"), 0.0)
    names = {
        f"{TIME_TO_FIRST_TOKEN_SECONDS}_count": "ttft_count",
        f"{TIME_TO_FIRST_TOKEN_SECONDS}_sum": "ttft_sum",
        f"{HERD_ENGINE_STEP_SECONDS}_count": "step_count",
        f"{HERD_ENGINE_STEP_SECONDS}_sum": "step_sum",
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                figures[names[sample.name]] += sample.value
            elif sample.name == f"{TIME_TO_FIRST_TOKEN_SECONDS}_bucket" and float(
                sample.labels["le"]
            ) == float(SLOW_TTFT_S):
                figures["ttft_fast"] += sample.value
    return figures


def worker_side(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """One worker's figures over a window (``worker_figures`` after minus before)."""
    delta = {key: after[key] - before[key] for key in after}
    count, steps = delta["ttft_count"], delta["step_count"]
    return {
        "requests": int(count),
        "ttft_mean_ms": round(1000 * delta["ttft_sum"] / count, 1) if count else None,
        f"ttft_over_{SLOW_MS}ms": int(count - delta["ttft_fast"]),
        "steps": int(steps),
        "step_mean_ms": round(1000 * delta["step_sum"] / steps, 1) if steps else None,
    }


class ClientPauses:
    """This process's garbage collections of 5 ms or more while entered, as (seconds since ``start``,
    milliseconds): a pause of the client's loop would read as the server's latency."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.long: list[tuple[float, float]] = []
        self._began = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        now = time.monotonic()
        if phase == "start":
            self._began = now
        elif (now - self._began) >= 0.005:
            self.long.append((round(self._began - self.start, 2), round(1000 * (now - self._began), 1)))

    def __enter__(self) -> ClientPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


async def run(url: str, args: argparse.Namespace, setup: str, workers: list[str]) -> dict[str, Any]:
    samples: list[Sample] = []
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
        before = await asyncio.gather(*(worker_figures(client, worker) for worker in workers))
        # This client's own collector must not pause its users' reads: what the bench made so far
        # (parsed pages, the batch file) is kept out of the collections in the window.
        gc.collect()
        gc.freeze()
        deadline = time.monotonic() + args.seconds
        with ClientPauses(deadline - args.seconds) as pauses:
            await asyncio.gather(
                *(user(client, n, args, deadline, samples, setup) for n in range(args.users))
            )
        gc.unfreeze()
        after = await asyncio.gather(*(worker_figures(client, worker) for worker in workers))
        completed = None
        if batch_id is not None:
            counts = (await client.get(f"/v1/batches/{batch_id}")).json()["request_counts"]
            completed = counts["completed"]
            await client.post(f"/v1/batches/{batch_id}/cancel")
    values = [sample.ttft for sample in samples]
    settled = [sample.ttft for sample in samples if sample.left <= args.seconds - SETTLE_S]
    interactive = {sample.worker for sample in samples}
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
        "samples": samples,
        # The client's own garbage collections of 5 ms or more in the window: (seconds in, ms).
        "client_gc_pauses": pauses.long,
        # The worker's own clock on the workers that served interactive requests (a worker's
        # histogram mixes in the batch lines it served, if any).
        "workers": {
            f"worker-{n}": {
                "interactive": sum(sample.worker == f"worker-{n}" for sample in samples),
                f"client_ttft_over_{SLOW_MS}ms": sum(
                    sample.worker == f"worker-{n}" and sample.ttft >= SLOW_TTFT_S for sample in samples
                ),
                **worker_side(before[n], after[n]),
            }
            for n in range(len(workers))
            if f"worker-{n}" in interactive
        },
    }


def gateway_ttfts(log: Path) -> dict[str, float]:
    """Each request's TTFT at the gateway (from taking the request to the worker's first chunk in:
    its queue wait, routing and the worker's time), by request id, from the orchestrator's access log."""
    ttfts: dict[str, float] = {}
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if entry.get("request_id") and entry.get("ttft_ms") is not None:
                ttfts[entry["request_id"]] = float(entry["ttft_ms"]) / 1000
    return ttfts


def split(result: dict[str, Any], log: Path, seconds: float) -> dict[str, Any]:
    """``result`` with its samples replaced by every client TTFT (``ttfts_ms``, pooled over rounds in
    the summary) and the split of the slowest ones: when each was sent into the window of
    ``seconds``, the client's TTFT, the gateway's (``gateway_ttfts``), the relay (the gateway's first
    chunk reaching the client) and ``held_ms``, from that first chunk to the first with text: a first
    token that is part of a character (a byte of a multi-byte one) shows no text until the next
    token completes it, a decode step later. The relay's median and worst beside."""
    gateway = gateway_ttfts(log)
    samples: list[Sample] = result.pop("samples")

    def row(sample: Sample) -> dict[str, Any]:
        at_gateway = gateway.get(sample.request_id)
        return {
            "worker": sample.worker,
            "sent_s": round(seconds - sample.left, 2),
            "client_ms": round(1000 * sample.ttft, 1),
            "gateway_ms": None if at_gateway is None else round(1000 * at_gateway, 1),
            "relay_ms": None if at_gateway is None else round(1000 * (sample.first_chunk - at_gateway), 1),
            "held_ms": round(1000 * (sample.ttft - sample.first_chunk), 1),
        }

    rows = [row(sample) for sample in samples]
    relays = [r["relay_ms"] for r in rows if r["relay_ms"] is not None]
    slowest = sorted(rows, key=lambda r: -r["client_ms"])[: num_slowest(len(rows))]
    return {
        **result,
        "ttfts_ms": [round(1000 * sample.ttft, 1) for sample in samples],
        "relay_p50_ms": round(statistics.median(relays), 1) if relays else None,
        "relay_max_ms": max(relays) if relays else None,
        "slowest": slowest,
    }


def num_slowest(num: int) -> int:
    """The slowest requests kept for the split: the p99 and the two behind it, at least 3."""
    return max(3, num - int(0.99 * num) + 2)


def measure(
    args: argparse.Namespace, setup: str, endpoints: list[str], workers: list[str], log_dir: Path
) -> dict[str, Any]:
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
        "--batch-idle-max-share",
        str(args.idle_max_share if setup == "with-batch-headroom" else 0.0),
        "--batch-idle-min-workers",
        str(args.idle_min_workers if setup == "with-batch-headroom" else 0),
    ]
    argv = orchestrator_argv(manifest_path, endpoints, token=TOKEN, port=port, extra=batch)
    url = f"http://{HOST}:{port}"
    log = log_dir / f"orchestrator-{setup}.log"
    with serving(argv, ready_url=f"{url}/health", log=log, env={}):
        time.sleep(2.0)  # a few health polls admit both workers
        result = asyncio.run(run(url, args, setup, workers))
        time.sleep(args.batch_output * 0.1)  # the cancelled batch's lines in flight end before the next run
    return split(result, log, args.seconds)


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
    parser.add_argument(
        "--workers-per-process",
        type=int,
        default=None,
        help="simulated workers each `herd worker --replicas` process hosts (default: all in one; 1 "
        "runs a process a worker, as a pod a worker does)",
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="the interactive window of each run")
    parser.add_argument("--out", type=Path, default=Path("bench/results/batch_interference.json"))
    args = parser.parse_args()
    if args.batch_concurrency is None:
        args.batch_concurrency = 2 * args.replicas * MAX_BATCH_SIZE
    log_dir = Path("/tmp/herd-batch-interference")
    log_dir.mkdir(parents=True, exist_ok=True)
    num = args.replicas
    per = args.workers_per_process or num
    ports = free_port_block(2 * num)
    endpoints = [f"http://{HOST}:{ports[n]},http://{HOST}:{ports[num + n]}" for n in range(num)]
    workers = [f"http://{HOST}:{ports[n]}" for n in range(num)]
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        for first in range(0, num, per):  # each process serves workers first .. first + per - 1
            count = min(per, num - first)
            argv = herd_worker_argv(
                DEMO_MODEL,
                name=NAME,
                port=ports[first],
                internal_port=ports[num + first],
                token=TOKEN,
                engine=ENGINE,
            )
            stack.enter_context(
                serving(
                    [*argv, "--replicas", str(count)],
                    ready_url=f"{workers[first + count - 1]}/ready",
                    log=log_dir / f"workers-{first}.log",
                    env=thread_env(1),
                )
            )
        for number in range(args.rounds):
            for setup in SETUPS if number % 2 == 0 else reversed(SETUPS):
                entry = {"round": number, **measure(args, setup, endpoints, workers, log_dir)}
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
    # One round's p99 of ~60 requests is its slowest request; pooled over the rounds, a p99 is a p99.
    pooled = {
        setup: [ttft / 1000 for run in runs if run["setup"] == setup for ttft in run["ttfts_ms"]]
        for setup in SETUPS
    }
    for setup in SETUPS:
        summary[setup]["pooled_num_interactive"] = len(pooled[setup])
        summary[setup]["pooled_ttft_p99_ms"] = p99(pooled[setup])
        summary[setup]["pooled_ttft_p50_ms"] = round(1000 * statistics.median(pooled[setup]), 1)
    for setup in BATCH_SETUPS:
        for key in ("pooled_ttft_p99_ms", "pooled_ttft_p50_ms"):
            ratio = summary[setup][key] / summary["alone"][key]
            summary[setup][f"{key.removesuffix('_ms')}_ratio"] = round(ratio, 3)
    write_report(args, ENGINE, runs, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
