"""Issue 20's tier benchmark on a simulated fleet: no tier, a host tier, host and disk, and routing
by restore cost against tier-blind routing and fixed weights, side by side in one run.

Built on ``bench/routing_sim.py``'s discrete-event simulation: every worker is herd's own engine
(scheduler, block manager with its tiers, KV events with their medium, load report with its measured
rates) on the cost-model runner, whose tier moves cost their bytes over the cost model's ``hostGBps``
/ ``diskGBps`` (measured on this machine by ``herd bench calibrate``'s ``measure_tiers``: 6.5 and 0.6
GB/s for the demo model's 720 KiB blocks); every request is routed by the orchestrator's own
``decide`` with kv_cache_aware over a real ``KVIndex`` fed by the workers' events at each 250 ms
poll, and the views carry each worker's restore costs as the registry works them out
(``restore_block_tokens``). What differs between setups is only the tiers and ``tierCost``:

* ``none``: no tier below the device; kv_cache_aware (its tier cost has nothing to price);
* ``host``: ``hostMemoryGiB`` of ``--host-share`` x the working set's share of each worker, tierCost
  measured; ``host, tier-blind`` and ``host, weights 1.0/0.8``: the same workers, tierCost device and
  weights;
* ``host+disk``: a host tier of ``--small-host-share`` and a disk tier of ``--host-share``, measured.

Traces: ``tenants`` (multi-tenant: herd bench's shared-prefix workload, tenants drawn uniformly, a
system prompt of ``--prefix-blocks`` blocks each plus a 16-32 word user turn) and ``turns``
(multi-turn: sessions of up to ``--max-turns`` turns whose next prompt is the previous one plus its
output plus a new user turn, sessions drawn uniformly; a session that reached its last turn starts
over with a new history). The working set is the trace's distinct prefix blocks (tenants x prefix
blocks; sessions x their longest history) over the whole fleet's device blocks, ``--working-sets``
(1.5 and 3). Closed loop, ``--concurrency`` requests in flight per worker. Each setup runs every
round (seeds 0..rounds-1) in turn, alternating; the table gives each figure's median and its range.

    .venv/bin/python bench/kv_tiers.py --out bench/results/kv_tiers_sim.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter
from routing_sim import BLOCK_SIZE, ISSUE14_COST, MODEL_ID, Request, Shape, SimModel, Simulation, SimWorker

from herd.api.crd import RoutingSpec
from herd.api.kv_hash import block_hashes
from herd.api.prompt import PromptRenderer
from herd.api.protocol import KVSnapshot
from herd.orchestrator.discovery import ModelConfig
from herd.orchestrator.routing import RequestContext, WorkerView, build_strategy, decide, restore_block_tokens
from herd.worker.cache_geometry import bytes_per_block
from herd.worker.config import EngineConfig
from herd.worker.loader import read_model_args
from herd.worker.outputs import RequestOutput
from herd.worker.simulated_runner import CostModel, VirtualClock, simulated_engine

__all__ = ["main"]

DEMO_MODEL = Path(__file__).resolve().parent.parent / ".cache" / "models" / "smollm2-135m-instruct"
TIER_COST = {"host_gbps": 6.5, "disk_gbps": 0.6}


@dataclass(frozen=True)
class Setup:
    name: str
    host_share: float
    disk_share: float
    tier_cost: str


@dataclass(frozen=True)
class TierShape:
    trace: str
    working_set: float
    num_workers: int
    pool_blocks: int
    prefix_blocks: int
    max_turns: int
    concurrency: int

    def num_streams(self) -> int:
        """Tenants or sessions, so that their distinct blocks are ``working_set`` x the fleet's pool."""
        per_stream = (
            self.prefix_blocks if self.trace == "tenants" else self.prefix_blocks + 3 * self.max_turns
        )
        return max(1, round(self.working_set * self.num_workers * self.pool_blocks / per_stream))


class TierSimulation(Simulation):
    """``Simulation`` with tiered workers, tier-priced routing and a multi-turn trace."""

    def __init__(
        self, shape: Shape, tiers: TierShape, setup: Setup, seed: int, renderer: PromptRenderer
    ) -> None:
        self.tiers, self.setup = tiers, setup
        per_block = bytes_per_block(read_model_args(DEMO_MODEL), BLOCK_SIZE, _dtype())
        share = tiers.working_set * tiers.pool_blocks
        self.host_gib = setup.host_share * share * per_block / 2**30
        self.disk_gib = setup.disk_share * share * per_block / 2**30
        super().__init__(shape, "kv_cache_aware", seed, renderer)
        settings = {
            "strategy": "kv_cache_aware",
            "loadFactor": shape.load_factor,
            "tierCost": setup.tier_cost,
        }
        spec = TypeAdapter(RoutingSpec).validate_python(settings)
        strategy = build_strategy(spec, kv_index=self.index, block_size=BLOCK_SIZE, rng=random.Random(seed))
        self.model = SimModel(ModelConfig(MODEL_ID, spec, block_size=BLOCK_SIZE), strategy, self.index)
        self.histories: dict[int, list[int]] = {}
        self.num_turns: dict[int, int] = {}
        self.outputs: dict[int, list[int]] = {}

    def _worker(self, number: int, renderer: PromptRenderer) -> SimWorker:
        shape, clock = self.shape, VirtualClock()
        kv_cache: dict[str, Any] = {"blockSize": BLOCK_SIZE, "hostMemoryGiB": self.host_gib}
        if self.disk_gib:
            kv_cache["disk"] = {"path": "/nonexistent/simulated", "sizeGiB": self.disk_gib}
        config = EngineConfig(
            model_path=DEMO_MODEL,
            served_name=MODEL_ID,
            engine={"maxBatchTokens": 1024, "maxBatchSize": 64, "kvCache": kv_cache},
        )
        cost = CostModel(step_ms=shape.step_ms, seq_ms=shape.seq_ms, token_ms=shape.token_ms, **TIER_COST)
        engine = simulated_engine(
            config, num_blocks=shape.num_kv_blocks(), cost=cost, clock=clock, renderer=renderer
        )
        worker = SimWorker(f"worker-{number}", engine, clock)
        snapshot = KVSnapshot(epoch=engine.info.epoch, seq=0, block_size=BLOCK_SIZE, block_hashes=[])
        self.index.reset(worker.id, snapshot)
        return worker

    def _view(self, worker: SimWorker) -> WorkerView:
        view = super()._view(worker)
        view.host_block_tokens = restore_block_tokens(worker.report, "host")
        view.disk_block_tokens = restore_block_tokens(worker.report, "disk")
        return view

    def _send(self) -> None:
        if self.tiers.trace == "tenants":
            super()._send()
            return
        if self.num_sent >= len(self.turns):
            return
        session, num_words = self.turns[self.num_sent]
        if self.num_turns.get(session, 0) >= self.tiers.max_turns or session not in self.histories:
            self.histories[session] = random.Random(1_000_003 * session).choices(
                range(49152), k=self._prefix_len()
            )
            self.num_turns[session] = 0
        user = random.Random(self.num_sent).choices(range(49152), k=num_words + 9)
        token_ids = self.histories[session] + user
        request = Request(
            self.num_sent,
            session,
            token_ids,
            block_hashes(token_ids, BLOCK_SIZE, model_id=MODEL_ID),
            self.now,
        )
        self.num_sent += 1
        views = [self._view(worker) for worker in self.workers]
        decision = decide(self.model, views, self._context(request))
        self._apply(decision)
        request.num_prefill_tokens = decision.num_prefill_tokens
        self._admit(next(w for w in self.workers if w.id == decision.worker.id), request)

    def _record(self, worker: SimWorker, output: RequestOutput, finish_ms: float) -> None:
        request = worker.requests[output.request_id]
        self.outputs.setdefault(request.number, []).extend(output.new_token_ids)
        if output.finished and self.tiers.trace == "turns":
            self.histories[request.tenant] = request.token_ids + self.outputs.pop(request.number)
            self.num_turns[request.tenant] = self.num_turns.get(request.tenant, 0) + 1
        super()._record(worker, output, finish_ms)

    def _context(self, request: Request) -> RequestContext:
        return RequestContext(model=MODEL_ID, token_ids=request.token_ids, block_hashes=request.hashes)

    def _num_duplicated(self) -> int:
        return 0

    def _summary(self, measured: list[Request]) -> dict[str, Any]:
        summary = super()._summary(measured)
        counters = [worker.engine.block_manager.counters for worker in self.workers]
        summary["restored_host"] = sum(c.restored["host"] for c in counters)
        summary["restored_disk"] = sum(c.restored["disk"] for c in counters)
        return {
            key: summary[key]
            for key in (
                "hit_rate",
                "ttft_p50_ms",
                "ttft_p99_ms",
                "requests_per_s",
                "restored_host",
                "restored_disk",
            )
        }


def _dtype() -> Any:
    import torch

    return torch.float32


SETUPS = [
    Setup("none", 0.0, 0.0, "measured"),
    Setup("host", 1.0, 0.0, "measured"),
    Setup("host+disk", 0.25, 1.0, "measured"),
    Setup("host, tier-blind", 1.0, 0.0, "device"),
    Setup("host, weights 1.0/0.8", 1.0, 0.0, "weights"),
]


def run(tiers: TierShape, setups: list[Setup], rounds: int, warmup: int, measured: int) -> dict[str, Any]:
    renderer = PromptRenderer.from_pretrained(DEMO_MODEL)
    streams = tiers.num_streams()
    shape = Shape(
        num_tenants=streams,
        prefix_blocks=tiers.prefix_blocks,
        pool_blocks=tiers.pool_blocks,
        output_tokens=8,
        concurrency=tiers.concurrency * tiers.num_workers,
        num_workers=tiers.num_workers,
        warmup=warmup,
        measured=measured,
        **ISSUE14_COST,
    )
    runs: dict[str, list[dict[str, Any]]] = {setup.name: [] for setup in setups}
    for seed in range(rounds):
        for setup in setups:
            started = time.perf_counter()
            result = TierSimulation(shape, tiers, setup, seed, renderer).run()
            runs[setup.name].append(result)
            print(
                f"  {tiers.trace} {tiers.working_set}x seed {seed} {setup.name}: {result} ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    table = {
        name: {
            key: {
                "median": round(statistics.median(r[key] for r in results), 4),
                "min": round(min(r[key] for r in results), 4),
                "max": round(max(r[key] for r in results), 4),
            }
            for key in results[0]
        }
        for name, results in runs.items()
    }
    return {"shape": {**vars(tiers), "streams": streams}, "setups": table, "runs": runs}


def print_table(result: dict[str, Any]) -> None:
    shape = result["shape"]
    print(
        f"\n{shape['trace']} at {shape['working_set']}x the fleet's device pool "
        f"({shape['streams']} streams, {shape['num_workers']} workers x {shape['pool_blocks']} blocks)"
    )
    print("| setup | hit rate | TTFT p50 (sim ms) | TTFT p99 (sim ms) | req/s | restored host / disk |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in result["setups"].items():
        cells = [
            f"{row[key]['median']:.3g} ({row[key]['min']:.3g}-{row[key]['max']:.3g})"
            for key in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "requests_per_s")
        ]
        restored = f"{row['restored_host']['median']:.0f} / {row['restored_disk']['median']:.0f}"
        print(f"| {name} | {' | '.join(cells)} | {restored} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--pool-blocks", type=int, default=64, help="each worker's device pool")
    parser.add_argument("--prefix-blocks", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight per worker")
    parser.add_argument("--working-sets", type=float, nargs="+", default=[1.5, 3.0])
    parser.add_argument("--traces", nargs="+", default=["tenants", "turns"], choices=["tenants", "turns"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1500)
    parser.add_argument("--measured", type=int, default=1500)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results = []
    for trace in args.traces:
        for working_set in args.working_sets:
            tiers = TierShape(
                trace,
                working_set,
                args.workers,
                args.pool_blocks,
                args.prefix_blocks,
                args.max_turns,
                args.concurrency,
            )
            result = run(tiers, SETUPS, args.rounds, args.warmup, args.measured)
            print_table(result)
            results.append(result)
    if args.out is not None:
        command = " ".join(["python bench/kv_tiers.py", *(argv if argv is not None else sys.argv[1:])])
        args.out.write_text(
            json.dumps({"benchmark": "kv_tiers", "command": command, "results": results}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
