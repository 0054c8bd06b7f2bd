"""The gateway's whole routing step at 1,000 workers: views, idle headroom, decision, counts.

``bench/routing_decision.py`` times a strategy's ``select`` alone. What a request waits for in the
gateway is more: ``Gateway._route`` takes a view of every worker of the model from the registry
(``Registry.all_views``), asks the idle headroom which workers to keep off batch work
(``Headrooms.kept``), decides (``decide``: health, capacity and slot reserve, the strategy, the
session pin, the expected blocks) and counts the choice in flight (``apply_decision``), in one
synchronous step. This script times that step on a real ``Registry`` holding ``--workers`` worker
states (loads, KV index, prompts and sessions from ``routing_decision.make_fleet``; no worker process:
the status streams are not started), every tenth request at the batch's priority. Between decisions
the oldest request in flight ends (its hold is released), so the fleet's load stays steady and each
decision sees one worker changed by its own choice and one by an ending request, as in a gateway
under a steady load.

``--max-in-flight N`` gives the model a per-worker limit (``max_in_flight_per_worker``, as
``engine.maxBatchSize + engine.maxQueueLen`` sets it): ``decide``'s capacity filter then runs, for the
batch's requests with the slot reserve's rule (``routing.reserve``); without it (the default) every
healthy worker is open and the filter does not run. The fleet starts with up to 7 requests on a worker
(about 3.5 on average, held steady), so a limit of 8 keeps every worker open and has the filter walk
them all; a much lower one leaves no worker open (``at_capacity``). ``most_in_flight`` is the most
requests a chosen worker held once the choice was counted: at most N with a limit. The step's CPU p50
is also given for the interactive requests and the batch's apart (their capacity filters differ).

Two setups alternate over ``--rounds`` rounds on the same fleet and requests: ``reused`` is the
registry as it is (a worker's view is given again while nothing it shows has changed); ``rebuilt``
drops every worker's kept view before each decision (untimed), so every decision builds 1,000 views,
as the registry did before it kept them (that registry also copied each worker's in-flight counts
by priority into its view; ``rebuilt`` does not, so it slightly flatters the old cost).

``--baseline REV`` runs this script as it was at git revision ``REV`` (its whole tree, from ``git
archive``, on ``PYTHONPATH``) and the working tree's, each in a process of its own, alternating them
over ``--rounds`` rounds of one run each: per tree and setup, the median and range of the rounds.
With ``--max-in-flight``, which an older script lacks, both trees run this checkout's script (the
baseline must then have the APIs it calls: ``Registry.forget_views`` and ``decide_with_headroom``).

    .venv/bin/python bench/gateway_decision.py --out bench/results/gateway_decision.json
    .venv/bin/python bench/gateway_decision.py --baseline 55acea1 --rounds 3 \
        --out bench/results/gateway_decision_ab.json
    .venv/bin/python bench/gateway_decision.py --baseline 450ae74 --max-in-flight 8 --rounds 3 \
        --out bench/results/gateway_decision_ab_limit.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from ab import run_once
from pydantic import TypeAdapter
from routing_decision import BLOCK_SIZE, Fleet, make_fleet, percentile

from herd.api.crd import RoutingSpec
from herd.api.protocol import LoadReport
from herd.orchestrator.apply import apply_decision, decide_with_headroom
from herd.orchestrator.discovery import Membership, ModelConfig, WorkerEndpoint
from herd.orchestrator.registry import Hold, Registry
from herd.orchestrator.routing.headroom import Headrooms, IdleHeadroom
from herd.orchestrator.routing.reserve import BACKGROUND_PRIORITY, DEFAULT_RESERVE
from herd.orchestrator.served import ServedModel
from herd.orchestrator.state import MemoryState
from herd.orchestrator.worker_client import WorkerClient

__all__ = ["main"]

MODEL = "bench"
SETUPS = ("reused", "rebuilt")
TARGET_P99_US = 1000.0


def gateway_of(
    num_workers: int, num_requests: int, strategy: str, seed: int, max_in_flight: int | None = None
) -> tuple[Registry, ServedModel, Fleet]:
    """A registry whose workers joined as the fleet's (their status streams not yet started: nothing
    awaits while the steps are timed), with the fleet's loads and KV index, and the fleet; the model
    holds at most ``max_in_flight`` requests on a worker (``None``: no limit)."""
    fleet = make_fleet(num_workers, num_requests, seed)
    spec = TypeAdapter(RoutingSpec).validate_python({"strategy": strategy})
    config = ModelConfig(MODEL, spec, block_size=BLOCK_SIZE, max_in_flight_per_worker=max_in_flight or 0)
    registry = Registry(WorkerClient(httpx.AsyncClient(), token=None), MemoryState())
    endpoints = tuple(WorkerEndpoint(view.id, MODEL, view.url, view.url) for view in fleet.workers)
    registry.apply_membership(Membership(models=(config,), endpoints=endpoints))
    served = registry.models[MODEL] = ServedModel(config, kv_index=fleet.kv_index)
    for view in fleet.workers:
        worker = registry.workers[view.id]
        worker.is_healthy = view.is_healthy
        worker.take_report(
            LoadReport(
                num_running=view.num_running,
                num_waiting=view.num_waiting,
                num_waiting_prefill_tokens=view.num_waiting_prefill_tokens,
                num_total_blocks=view.num_total_blocks,
            )
        )
    return registry, served, fleet


async def time_steps(
    strategy: str,
    num_workers: int,
    num_decisions: int,
    setup: str,
    seed: int,
    max_in_flight: int | None = None,
    num_warmup: int = 200,
) -> dict[str, float]:
    """The step's wall-clock and CPU percentiles over ``num_decisions`` decisions after ``num_warmup``
    untimed ones, and ``most_in_flight`` over the timed ones."""
    registry, served, fleet = gateway_of(
        num_workers, num_decisions + num_warmup, strategy, seed, max_in_flight
    )
    state = registry.state
    headrooms = Headrooms(IdleHeadroom(), DEFAULT_RESERVE)
    in_flight: collections.deque[Hold] = collections.deque()
    for view in fleet.workers:  # the fleet's starting load, held as the gateway holds requests
        in_flight.extend(registry.hold(view.id) for _ in range(view.num_in_flight))
    wall: list[float] = []
    cpu: list[float] = []
    cpu_by_kind: dict[bool, list[float]] = {False: [], True: []}  # by is_background
    most_in_flight = 0
    for i, ctx in enumerate(fleet.requests):
        if setup == "rebuilt":
            registry.forget_views()
        priority = BACKGROUND_PRIORITY if i % 10 == 9 else 0
        ctx = dataclasses.replace(ctx, priority=priority)
        cpu_start, wall_start = time.thread_time_ns(), time.perf_counter_ns()
        views = registry.all_views(MODEL)
        decision = decide_with_headroom(registry, headrooms, served, views, ctx, DEFAULT_RESERVE)
        route = apply_decision(registry, state, served, decision, priority=priority)
        wall_end, cpu_end = time.perf_counter_ns(), time.thread_time_ns()
        in_flight.append(route.hold)
        in_flight.popleft().release("success")
        if i >= num_warmup:
            wall.append((wall_end - wall_start) / 1000)
            cpu.append((cpu_end - cpu_start) / 1000)
            cpu_by_kind[priority == BACKGROUND_PRIORITY].append(cpu[-1])
            most_in_flight = max(most_in_flight, decision.worker.num_in_flight + 1)
    tasks = [worker.task for worker in registry.workers.values() if worker.task is not None]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "wall_p50_us": percentile(wall, 0.50),
        "wall_p99_us": percentile(wall, 0.99),
        "cpu_p50_us": percentile(cpu, 0.50),
        "cpu_p99_us": percentile(cpu, 0.99),
        "interactive_cpu_p50_us": percentile(cpu_by_kind[False], 0.50),
        "batch_cpu_p50_us": percentile(cpu_by_kind[True], 0.50),
        "most_in_flight": most_in_flight,
    }


def summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    """Each figure's median over the rounds and its range."""
    return {
        key: {
            "median": round(statistics.median(run[key] for run in runs), 1),
            "range": [round(min(run[key] for run in runs), 1), round(max(run[key] for run in runs), 1)],
        }
        for key in runs[0]
    }


def tree_command(args: argparse.Namespace, root: Path) -> list[str]:
    """The script and options that run one round on the tree at ``root``: the tree's own script,
    unless ``--max-in-flight`` is given (an older script lacks it): then this checkout's."""
    command = ["--workers", str(args.workers), "--decisions", str(args.decisions), "--rounds", "1"]
    command += ["--strategies", args.strategies, "--seed", str(args.seed)]
    if args.max_in_flight is None:
        return [str(root / "bench" / "gateway_decision.py"), *command]
    return [str(Path(__file__).resolve()), *command, "--max-in-flight", str(args.max_in_flight)]


def run_trees(args: argparse.Namespace) -> dict[tuple[str, str, str], list[dict[str, float]]]:
    """``--baseline``: this script at ``args.baseline`` and in the working tree, one round each in
    turn (the order flips every round), each in its own process on its own tree's packages."""
    runs: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp, "base")
        base.mkdir()
        archive = subprocess.run(["git", "archive", args.baseline], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        trees = [(args.baseline, base), ("working tree", Path(__file__).resolve().parent.parent)]
        for round_number in range(args.rounds):
            for tree, root in trees if round_number % 2 == 0 else trees[::-1]:
                out = Path(tmp, f"round-{round_number}-{root.name}.json")
                for row in run_once(root, tree_command(args, root), out)["results"]:
                    figures = {key: value["median"] for key, value in row.items() if isinstance(value, dict)}
                    runs.setdefault((tree, row["strategy"], row["setup"]), []).append(figures)
    return runs


def run_setups(args: argparse.Namespace) -> dict[tuple[str, str, str], list[dict[str, float]]]:
    """The two setups in this process, alternating over the rounds."""
    runs: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    for round_number in range(args.rounds):
        order = SETUPS if round_number % 2 == 0 else SETUPS[::-1]
        for strategy in args.strategies.split(","):
            for setup in order:
                run = asyncio.run(
                    time_steps(strategy, args.workers, args.decisions, setup, args.seed, args.max_in_flight)
                )
                runs.setdefault(("working tree", strategy, setup), []).append(run)
                print(
                    json.dumps({"round": round_number, "strategy": strategy, "setup": setup, **run}),
                    flush=True,
                )
    return runs


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--decisions", type=int, default=3000, help="timed decisions per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategies", default="kv_cache_aware,least_request,round_robin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-in-flight",
        type=positive_int,
        default=None,
        help="the model's per-worker limit on requests in flight, so that decide's capacity filter runs "
        "(default: none)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--baseline", help="git revision of this script and its tree to time against the working tree"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    runs = run_trees(args) if args.baseline else run_setups(args)
    results = [
        {
            "tree": tree,
            "strategy": strategy,
            "setup": setup,
            "workers": args.workers,
            "max_in_flight": args.max_in_flight,
            "rounds": len(rows),
        }
        | summary(rows)
        for (tree, strategy, setup), rows in sorted(runs.items())
    ]
    print(
        "| tree | strategy | views | wall p50 (us) | wall p99 (us) | CPU p50 (us) | CPU p99 (us) "
        "| interactive CPU p50 (us) | batch CPU p50 (us) |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for row in results:
        keys = (
            "wall_p50_us",
            "wall_p99_us",
            "cpu_p50_us",
            "cpu_p99_us",
            "interactive_cpu_p50_us",
            "batch_cpu_p50_us",
        )
        cells = [  # an older tree's own script may lack a figure
            f"{row[k]['median']} ({row[k]['range'][0]}-{row[k]['range'][1]})" if k in row else "-"
            for k in keys
        ]
        print(f"| {row['tree']} | {row['strategy']} | {row['setup']} | " + " | ".join(cells) + " |")
    load_after = os.getloadavg()[0]
    print(
        f"load average (1 min) before / after: {load_before:.1f} / {load_after:.1f}; p99 target {TARGET_P99_US:.0f} us"
    )
    if args.out is not None:
        report = {
            "command": " ".join([".venv/bin/python bench/gateway_decision.py", *sys.argv[1:]]),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_1m_before_after": [load_before, load_after],
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
