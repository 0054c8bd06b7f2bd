"""Issue 21's SLO benchmark: SLO-aware routing against least_request at 80 % and 100 % of capacity.

Four simulated workers (``herd worker --replicas 4``, the cost-model engine on the demo model's
config and tokenizer, its default cost model: a step is 60 ms plus 1.5 ms a scheduled token, so a
long prompt's prefill holds a worker's steps for seconds) behind one ``herd orchestrator`` whose
strategy is least_request. Requests arrive as a Poisson process at ``--loads`` times the fleet's
capacity, which a closed-loop probe measures first (requests finished per second with every batch
slot busy). A quarter of the prompts are long (``--long-len`` tokens), the rest short; every request
streams ``--output-len`` tokens. The two setups send the same arrivals (each prompt led by a tag of
its run, so no run finds another's prompts cached on the workers) and differ in one header:

* ``slo``: every request carries ``x-slo-ttft-ms: --ttft-ms``, so ``decide`` sends it to the worker
  its online latency fit predicts has the most headroom (docs/admission.md).
* ``least_request``: no header; the model's strategy, least_request, decides.

The figure is the share of requests whose time to first token (client side) met ``--ttft-ms``, with
TTFT p50/p99. Each ``slo`` run also reads the gateway's access log: every stream the SLO choice routed
carries what the latency fit predicted on its worker and the TTFT that followed (``slo_note``), which
``predictions`` sums up per worker (bias, mean absolute error, how many the fit wrongly said would
meet the target) along with the gateway's own time before it sent each request. Setups alternate over ``--rounds`` rounds at each load; each run has a fresh
orchestrator (so the latency fit starts empty and learns during the warm-up), the workers stay up;
each run records the machine's 1-minute load average before and after it (the machine is shared).

    .venv/bin/python bench/slo_routing.py --rounds 3 --out bench/results/slo_routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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

NAME = "sim"
TOKEN = "slo-routing"
NUM_WORKERS = 4
ENGINE = {"backend": "simulated", "maxModelLen": 4096, "maxBatchSize": 8, "maxQueueLen": 64}
SETUPS = ("slo", "least_request")
WORDS = ["amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "island", "juniper"]


def prompt(rng: random.Random, num_words: int) -> str:
    """About one token a word; a random start so that no two prompts share a cached prefix."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


async def one(
    client: httpx.AsyncClient, text: str, args: argparse.Namespace, headers: dict[str, str]
) -> float:
    """The request's TTFT in seconds (infinite when it failed)."""
    body = {"model": NAME, "prompt": text, "max_tokens": args.output_len, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                return float("inf")
            ttft = float("inf")
            async for line in response.aiter_lines():
                if line.startswith("data: {") and ttft == float("inf"):
                    ttft = time.monotonic() - started
            return ttft
    except httpx.HTTPError:
        return float("inf")


async def arrivals(
    url: str, args: argparse.Namespace, rate: float, headers: dict[str, str], seed: int, tag: str
) -> list[float]:
    """Poisson arrivals at ``rate`` for ``--warmup-s`` plus ``--seconds``; the TTFTs of the measured ones.

    Every prompt starts with ``tag``, the run's own: the workers outlive the runs, and the two setups
    of a pair draw the same prompts from ``seed``, so without it the second would find the first's
    prompts in the workers' prefix caches."""
    rng = random.Random(seed)
    tasks: list[tuple[float, asyncio.Task[float]]] = []
    limits = httpx.Limits(max_connections=1024)
    async with httpx.AsyncClient(base_url=url, timeout=300.0, limits=limits) as client:
        start = time.monotonic()
        at = start
        while at < start + args.warmup_s + args.seconds:
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            length = args.long_len if rng.random() < 0.25 else args.short_len
            task = asyncio.create_task(one(client, f"{tag} {prompt(rng, length)}", args, headers))
            tasks.append((at - start, task))
        finished = [(sent, await task) for sent, task in tasks]
    return [ttft for sent, ttft in finished if sent >= args.warmup_s]


async def capacity(url: str, args: argparse.Namespace) -> float:
    """Requests finished per second with every batch slot of the fleet busy (the same prompt mix)."""
    rng = random.Random(7)
    done: list[float] = []
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=300.0, limits=limits) as client:
        deadline = time.monotonic() + args.probe_s

        async def loop() -> None:
            while time.monotonic() < deadline:
                length = args.long_len if rng.random() < 0.25 else args.short_len
                await one(client, prompt(rng, length), args, {})
                if time.monotonic() < deadline:
                    done.append(time.monotonic())

        started = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(NUM_WORKERS * int(ENGINE["maxBatchSize"]))))
    return len(done) / (time.monotonic() - started)


def gateway_argv(endpoints: list[str], log_dir: Path, port: int) -> list[str]:
    manifest_path = log_dir / "manifest.yaml"
    manifest_path.write_text(json.dumps(demo_manifest(NAME, ENGINE, replicas=NUM_WORKERS)))
    return orchestrator_argv(manifest_path, endpoints, token=TOKEN, port=port)


def predictions(log: Path, target_ms: int) -> dict[str, Any]:
    """The SLO choice's predicted TTFT against the observed one (both from sending the request to its
    first chunk), per worker and over all, from the access-log lines of ``log``; and the gateway's time
    before it sent the request (its access-log TTFT less the observed one: parsing, tokenizing,
    deciding, waiting in its queue)."""
    notes: list[tuple[str, dict[str, float], float]] = []
    for line in log.read_text().splitlines():
        if not line.startswith("{") or '"slo"' not in line:
            continue
        entry = json.loads(line)
        if entry.get("ttft_ms") is not None:
            notes.append((str(entry["worker"]), entry["slo"], float(entry["ttft_ms"])))

    def summary(group: list[tuple[str, dict[str, float], float]]) -> dict[str, Any]:
        errors = [note["predicted_ttft_ms"] - note["observed_ttft_ms"] for _, note, _ in group]
        wrong = [
            note for _, note, _ in group if note["predicted_ttft_ms"] <= target_ms < note["observed_ttft_ms"]
        ]
        return {
            "num": len(group),
            "observed_ms_p50": round(statistics.median(note["observed_ttft_ms"] for _, note, _ in group), 1),
            "bias_ms": round(statistics.fmean(errors), 1),
            "mae_ms": round(statistics.fmean(abs(error) for error in errors), 1),
            "predicted_met_but_missed": len(wrong),
            "missed_with_queued_prefill_zero": sum(note["queued_prefill_tokens"] == 0 for note in wrong),
            "gateway_before_send_ms_p50": round(
                statistics.median(total - note["observed_ttft_ms"] for _, note, total in group), 1
            ),
        }

    if not notes:
        return {}
    workers = sorted({worker for worker, _, _ in notes})
    return {
        "all": summary(notes),
        **{worker: summary([n for n in notes if n[0] == worker]) for worker in workers},
    }


def measure(
    args: argparse.Namespace,
    setup: str,
    rate: float,
    endpoints: list[str],
    log_dir: Path,
    seed: int,
    tag: str,
) -> dict[str, Any]:
    port = free_port()
    url = f"http://{HOST}:{port}"
    headers = {"x-slo-ttft-ms": str(args.ttft_ms)} if setup == "slo" else {}
    log = log_dir / f"gw-{setup}.log"
    load_before = os.getloadavg()[0]
    with serving(gateway_argv(endpoints, log_dir, port), ready_url=f"{url}/health", log=log, env={}):
        time.sleep(2.0)  # a few health polls admit every worker
        ttfts = asyncio.run(arrivals(url, args, rate, headers, seed, tag))
    finite = sorted(ttft for ttft in ttfts if ttft != float("inf"))
    met = sum(ttft * 1000 <= args.ttft_ms for ttft in ttfts)
    return {
        "setup": setup,
        "num_requests": len(ttfts),
        "num_failed": len(ttfts) - len(finite),
        "met_share": met / max(1, len(ttfts)),
        "ttft_p50_ms": round(1000 * statistics.median(finite), 1) if finite else None,
        "ttft_p99_ms": round(1000 * finite[min(len(finite) - 1, int(0.99 * len(finite)))], 1)
        if finite
        else None,
        "predictions": predictions(log, args.ttft_ms),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.8, 1.0])
    parser.add_argument("--ttft-ms", type=int, default=2000, help="the TTFT target every slo request carries")
    parser.add_argument("--short-len", type=int, default=64)
    parser.add_argument("--long-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=30.0, help="the measured arrivals of each run")
    parser.add_argument("--probe-s", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/slo_routing.json"))
    args = parser.parse_args()
    log_dir = Path("/tmp/herd-slo-routing")
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = free_port_block(2 * NUM_WORKERS)
    argv = herd_worker_argv(
        DEMO_MODEL, name=NAME, port=ports[0], internal_port=ports[NUM_WORKERS], token=TOKEN, engine=ENGINE
    )
    argv += ["--replicas", str(NUM_WORKERS)]
    endpoints = [
        f"http://{HOST}:{ports[n]},http://{HOST}:{ports[NUM_WORKERS + n]}" for n in range(NUM_WORKERS)
    ]
    runs: list[dict[str, Any]] = []
    with serving(
        argv,
        ready_url=f"http://{HOST}:{ports[NUM_WORKERS - 1]}/ready",
        log=log_dir / "workers.log",
        env=thread_env(1),
    ):
        port = free_port()
        url = f"http://{HOST}:{port}"
        with serving(
            gateway_argv(endpoints, log_dir, port),
            ready_url=f"{url}/health",
            log=log_dir / "gw-probe.log",
            env={},
        ):
            time.sleep(2.0)
            fleet_rate = asyncio.run(capacity(url, args))
        print(json.dumps({"capacity_rps": fleet_rate}), flush=True)
        for number in range(args.rounds):
            for load in args.loads:
                for setup in SETUPS if number % 2 == 0 else reversed(SETUPS):
                    run = {"round": number, "load": load, "rate_rps": round(load * fleet_rate, 3)}
                    run |= measure(
                        args,
                        setup,
                        load * fleet_rate,
                        endpoints,
                        log_dir,
                        seed=1000 * number + int(100 * load),
                        tag=f"run {len(runs):02d}:",
                    )
                    print(json.dumps(run), flush=True)
                    runs.append(run)
    summary = {
        f"{setup}@{load}": {
            "median_met_share": statistics.median(
                run["met_share"] for run in runs if run["setup"] == setup and run["load"] == load
            ),
            "met_share": [run["met_share"] for run in runs if run["setup"] == setup and run["load"] == load],
            "ttft_p99_ms": [
                run["ttft_p99_ms"] for run in runs if run["setup"] == setup and run["load"] == load
            ],
        }
        for load in args.loads
        for setup in SETUPS
    }
    write_report(args, ENGINE, runs, summary, capacity_rps=fleet_rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
