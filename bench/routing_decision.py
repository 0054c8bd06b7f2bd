"""Routing decision time: the routing core alone, every strategy, 64 and 1,000 synthetic workers.

Each decision is ``strategy.select(healthy(workers), ctx)`` on workers with varied loads (a few
unhealthy), for 512-token prompts (block 16, so 32 block hashes) drawn from tenants that share a
256-token system prompt; the KV index holds each tenant's prefix on a few workers and sticky
sessions arrive with a pin. Hashing the prompt is not timed (the gateway does it before routing,
and only for strategies that need tokens). Between decisions the chosen worker's in-flight count
goes up and a random one comes down, so bounded loads and ties see moving state.

Each decision is timed twice: wall clock (``perf_counter_ns``, what a request waits) and the
thread's CPU time (``thread_time_ns``, the work itself). On a shared, oversubscribed machine the
wall-clock tail is dominated by the scheduler taking the core away mid-decision (4 ms ticks);
the CPU-time figures show what the routing core costs apart from that. They still have a tail that
is not routing's: a virtual machine's CPU time runs on while its host gives the core to another
guest, and caches come back cold after a neighbour ran. So after each decision the script times a
``control_task``, a fixed piece of work of about a decision's size: its p99 over its p50 is the
tail the machine gives any work of that size, side by side with the decisions.

``--tiers`` (issue 20) times kv_cache_aware's three tier costs (measured, weights, device) on a fleet
whose holders also keep the rest of each prompt in their host tier, each worker with its own measured
restore cost, so every decision prices restores.

``--baseline REV`` times kv_cache_aware as it was at git revision ``REV`` (its module loaded from git)
against the working tree's, on the same fleet and requests, alternating them over ``--rounds`` rounds:
per setup the median and the range of each round's percentiles (with ``--tiers``, on the tiered fleet).

    .venv/bin/python bench/routing_decision.py            # writes bench/results/routing.json
    .venv/bin/python bench/routing_decision.py --tiers --out bench/results/routing_decision_tiers.json
    .venv/bin/python bench/routing_decision.py --baseline 9928186 --workers 1000 --rounds 5 \
        --out bench/results/routing_decision_kv_ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import TypeAdapter

from herd.api.crd import RoutingSpec
from herd.api.kv_hash import block_hashes
from herd.api.protocol import KVSnapshot
from herd.orchestrator.kv_index import KVIndex
from herd.orchestrator.routing import (
    KVCacheAware,
    RequestContext,
    RoutingStrategy,
    WorkerView,
    build_strategy,
    healthy,
)

__all__ = ["main"]

STRATEGIES = ["round_robin", "least_request", "random", "prefix_hash", "sticky_session", "kv_cache_aware"]
TARGET_P99_US = {64: 200.0, 1000: 1000.0}
BLOCK_SIZE = 16
PROMPT_TOKENS = 512
PREFIX_TOKENS = 256


@dataclass(frozen=True, slots=True)
class Fleet:
    workers: list[WorkerView]
    kv_index: KVIndex
    requests: list[RequestContext]


TIER_COSTS = ["measured", "weights", "device"]


def make_workers(num_workers: int, rng: random.Random) -> list[WorkerView]:
    return [
        WorkerView(
            id=f"worker-{i:04d}",
            url=f"http://10.0.{i // 250}.{i % 250}:8000",
            num_in_flight=rng.randrange(8),
            num_running=rng.randrange(16),
            num_waiting=rng.randrange(4),
            num_waiting_prefill_tokens=rng.randrange(4096),
            num_total_blocks=rng.randrange(64, 256),
            is_healthy=rng.random() > 0.02,
            host_block_tokens=rng.uniform(0.2, 2.0),
        )
        for i in range(num_workers)
    ]


def make_prompt(tenant_prefix: list[int], rng: random.Random) -> list[int]:
    return tenant_prefix + rng.choices(range(32000), k=PROMPT_TOKENS - PREFIX_TOKENS)


def make_fleet(num_workers: int, num_requests: int, seed: int, *, tiers: bool = False) -> Fleet:
    rng = random.Random(seed)
    workers = make_workers(num_workers, rng)
    prefixes = [rng.choices(range(32000), k=PREFIX_TOKENS) for _ in range(2 * num_workers)]
    kv_index = KVIndex()
    held: dict[str, list[int]] = {worker.id: [] for worker in workers}
    host: dict[str, list[int]] = {worker.id: [] for worker in workers}
    for prefix in prefixes:
        hashes = block_hashes(make_prompt(prefix, rng), BLOCK_SIZE, model_id="bench")
        for worker in rng.sample(workers, 3):
            on_device = rng.randrange(8, len(hashes) + 1)
            held[worker.id].extend(hashes[:on_device])
            host[worker.id].extend(hashes[on_device:] if tiers else [])
    for worker_id, blocks in held.items():
        snapshot = KVSnapshot(
            epoch="e",
            seq=0,
            block_size=BLOCK_SIZE,
            block_hashes=blocks,
            tier_block_hashes={"host": host[worker_id]},
        )
        kv_index.reset(worker_id, snapshot)
    requests = [make_request(rng.choice(prefixes), workers, rng) for _ in range(num_requests)]
    return Fleet(workers, kv_index, requests)


def make_request(prefix: list[int], workers: list[WorkerView], rng: random.Random) -> RequestContext:
    tokens = make_prompt(prefix, rng)
    session = f"session-{rng.randrange(10_000)}"
    return RequestContext(
        model="bench",
        token_ids=tokens,
        block_hashes=block_hashes(tokens, BLOCK_SIZE, model_id="bench"),
        session_key=session,
        pinned_worker_id=rng.choice(workers).id if rng.random() < 0.8 else None,
        headers={"x-session-id": session},
    )


def control_task(workers: list[WorkerView]) -> int:
    """A fixed piece of work of about a kv_cache_aware decision's size at 1,000 workers (six passes
    over the views), timed between the decisions: what its p99 is to its p50 is the machine's doing
    (preemption, a neighbour's load, cache misses), not routing's."""
    return sum(sum([view.num_in_flight + view.num_running for view in workers]) for _ in range(6))


def time_decisions(
    strategy: RoutingStrategy, fleet: Fleet, num_warmup: int, seed: int
) -> tuple[list[float], list[float], list[float]]:
    """Wall-clock and CPU microseconds per decision, after ``num_warmup`` untimed ones (which build
    the hash ring), and the CPU microseconds of a ``control_task`` run after each."""
    rng = random.Random(seed)
    wall: list[float] = []
    cpu: list[float] = []
    control: list[float] = []
    workers = fleet.workers
    position = {view.id: i for i, view in enumerate(workers)}
    for i, ctx in enumerate(fleet.requests):
        cpu_start, wall_start = time.thread_time_ns(), time.perf_counter_ns()
        chosen = strategy.select(healthy(workers), ctx)
        wall_end, cpu_end = time.perf_counter_ns(), time.thread_time_ns()
        control_task(workers)
        control_end = time.thread_time_ns()
        if chosen is None:
            raise RuntimeError(f"{strategy.name} chose no worker; the benchmark fleet always has room")
        # Views are never edited (the registry gives a changed worker a new one): replace them.
        workers[position[chosen.id]] = replace(chosen, num_in_flight=chosen.num_in_flight + 1)
        other = rng.choice(workers)
        workers[position[other.id]] = replace(other, num_in_flight=max(0, other.num_in_flight - 1))
        if i >= num_warmup:
            wall.append((wall_end - wall_start) / 1000)
            cpu.append((cpu_end - cpu_start) / 1000)
            control.append((control_end - cpu_end) / 1000)
    return wall, cpu, control


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(
    name: str, num_workers: int, num_decisions: int, seed: int, tier_cost: str | None = None
) -> dict[str, object]:
    fleet = make_fleet(num_workers, num_decisions + 200, seed, tiers=tier_cost is not None)
    settings = {"strategy": name} | ({"tierCost": tier_cost} if tier_cost else {})
    spec = TypeAdapter(RoutingSpec).validate_python(settings)
    strategy = build_strategy(spec, kv_index=fleet.kv_index, block_size=BLOCK_SIZE, rng=random.Random(seed))
    wall, cpu, control = time_decisions(strategy, fleet, num_warmup=200, seed=seed)
    target = TARGET_P99_US[num_workers]
    return {
        "strategy": name if tier_cost is None else f"{name} (tiers: {tier_cost})",
        "workers": num_workers,
        "decisions": len(wall),
        "wall_mean_us": round(statistics.fmean(wall), 1),
        "wall_p50_us": round(percentile(wall, 0.50), 1),
        "wall_p99_us": round(percentile(wall, 0.99), 1),
        "cpu_p50_us": round(percentile(cpu, 0.50), 1),
        "cpu_p99_us": round(percentile(cpu, 0.99), 1),
        "control_cpu_p50_us": round(percentile(control, 0.50), 1),
        "control_cpu_p99_us": round(percentile(control, 0.99), 1),
        "target_p99_us": target,
        "wall_meets_target": percentile(wall, 0.99) <= target,
        "cpu_meets_target": percentile(cpu, 0.99) <= target,
    }


def baseline_class(rev: str) -> type[KVCacheAware]:
    """``KVCacheAware`` as it was at git revision ``rev``, loaded as a module of its own."""
    path = "orchestrator/herd/orchestrator/routing/kv_cache_aware.py"
    source = subprocess.run(
        ["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    name = f"kv_cache_aware_{rev}"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    strategy: type[KVCacheAware] = module.KVCacheAware
    return strategy


def compare(
    rev: str, num_workers: int, num_decisions: int, rounds: int, seed: int, *, tiers: bool
) -> list[dict[str, object]]:
    """kv_cache_aware (its default tier cost, measured) at ``rev`` and in the working tree,
    alternating, each round on a fresh copy of the same fleet (the decisions move its loads)."""
    setups = {rev: baseline_class(rev), "working tree": KVCacheAware}
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
    for _ in range(rounds):
        for name, cls in setups.items():
            fleet = make_fleet(num_workers, num_decisions + 200, seed, tiers=tiers)
            strategy = cls(
                kv_index=fleet.kv_index,
                load_factor=1.25,
                cache_weight=1.0,
                load_weight=1.0,
                block_size=BLOCK_SIZE,
                rng=random.Random(seed),
            )
            wall, cpu, _ = time_decisions(strategy, fleet, num_warmup=200, seed=seed)
            samples[name].append(
                {
                    "wall_p50_us": percentile(wall, 0.50),
                    "wall_p99_us": percentile(wall, 0.99),
                    "cpu_p50_us": percentile(cpu, 0.50),
                    "cpu_p99_us": percentile(cpu, 0.99),
                }
            )
    rows: list[dict[str, object]] = []
    for name, rounds_of in samples.items():
        row: dict[str, object] = {
            "setup": name,
            "workers": num_workers,
            "decisions": num_decisions,
            "tiers": tiers,
        }
        for key in rounds_of[0]:
            values = [sample[key] for sample in rounds_of]
            row[key] = round(statistics.median(values), 1)
            row[f"{key}_range"] = [round(min(values), 1), round(max(values), 1)]
        rows.append(row)
    return rows


def compare_markdown(rows: list[dict[str, object]], command: str) -> str:
    lines = [
        "| kv_cache_aware | workers | wall p50 (us) | wall p99 (us) | CPU p50 (us) | CPU p99 (us) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = [f"{row[key]} ({row[f'{key}_range'][0]}-{row[f'{key}_range'][1]})" for key in PERCENTILES]  # type: ignore[index]
        lines.append(f"| {row['setup']} | {row['workers']} | " + " | ".join(cells) + " |")
    return (
        f"Command: `{command}`  (median of the rounds, their range in brackets)\n\n" + "\n".join(lines) + "\n"
    )


PERCENTILES = ["wall_p50_us", "wall_p99_us", "cpu_p50_us", "cpu_p99_us"]


def markdown(results: list[dict[str, object]], command: str) -> str:
    lines = [
        "| strategy | workers | wall p50 (us) | wall p99 (us) | CPU p50 (us) | CPU p99 (us) | p99 target (us) "
        "| control CPU p50 / p99 (us) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        wall_p99 = row["wall_p99_us"] if row["wall_meets_target"] else f"**{row['wall_p99_us']}**"
        cpu_p99 = row["cpu_p99_us"] if row["cpu_meets_target"] else f"**{row['cpu_p99_us']}**"
        lines.append(
            f"| {row['strategy']} | {row['workers']} | {row['wall_p50_us']} | {wall_p99} | "
            f"{row['cpu_p50_us']} | {cpu_p99} | {row['target_p99_us']:.0f} "
            f"| {row['control_cpu_p50_us']} / {row['control_cpu_p99_us']} |"
        )
    return f"Command: `{command}`  (bold: p99 above its target)\n\n" + "\n".join(lines) + "\n"


def run_baseline(args: argparse.Namespace, command: str, load_before: float) -> int:
    """``--baseline``: the two kv_cache_aware versions side by side, a table and the raw JSON."""
    rows = [
        row
        for n in args.workers
        for row in compare(args.baseline, n, args.decisions, args.rounds, args.seed, tiers=args.tiers)
    ]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    load = [load_before, os.getloadavg()[0]]
    report = {
        "command": command,
        "commit": head.stdout.strip(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_1m_before_after": load,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**report, "results": rows}, indent=2) + "\n")
    print(compare_markdown(rows, command))
    print(f"load average (1 min) before / after: {load_before:.1f} / {load[1]:.1f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=5000, help="timed decisions per case")
    parser.add_argument("--workers", type=int, nargs="+", default=[64, 1000], choices=sorted(TARGET_P99_US))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/routing.json"))
    parser.add_argument("--tiers", action="store_true", help="kv_cache_aware's tier costs on a tiered fleet")
    parser.add_argument(
        "--baseline", help="git revision whose kv_cache_aware to time against the working tree's"
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of --baseline")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    command = " ".join([".venv/bin/python bench/routing_decision.py", *sys.argv[1:]])
    if args.baseline:
        return run_baseline(args, command, load_before)
    if args.tiers:
        cases = [("kv_cache_aware", n, cost) for n in args.workers for cost in TIER_COSTS]
    else:
        cases = [(name, n, None) for n in args.workers for name in STRATEGIES]
    results = [measure(name, n, args.decisions, args.seed, cost) for name, n, cost in cases]
    report = {
        "command": command,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m_before_after": [load_before, os.getloadavg()[0]],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**report, "results": results}, indent=2) + "\n")
    print(markdown(results, command))
    print(f"load average (1 min) before / after: {load_before:.1f} / {os.getloadavg()[0]:.1f}")
    return 0 if all(row["wall_meets_target"] for row in results) else 1


if __name__ == "__main__":
    sys.exit(main())
