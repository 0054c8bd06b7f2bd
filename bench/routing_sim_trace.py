"""routing_sim.py's simulator on routing_scale.py's traces: herd's strategies on a simulated fleet of
8 to 256 workers, replaying a saved trace open loop, in simulated time (no HTTP, no machine noise).

Each worker is herd's engine on the cost-model runner with the scale runs' settings (the unit cost
model dilated as ``routing_scale.py`` dilates it, batches of 2, queues of 32, its KV pool), every
request is routed by the orchestrator's ``decide`` over a real ``KVIndex``, and the workers' KV events
and load reports reach the index every ``--poll-ms`` (the status stream's period). Requests arrive at
the trace's own gaps scaled to the rate; a request that extends an earlier one of its session (a
chat's next turn) waits for its answer, as ``herd bench``'s replay does. Reported per router: the hit
rate and its share of the oracle (``herd bench oracle`` on the same trace and fleet), TTFT p50/p99 in
simulated ms, and in-flight max/mean as the scale runs compute it (each worker's mean in-flight over
the run by Little's law, the busiest over the mean), with what the busiest worker served (``busiest``:
its requests, those sharing its most common two-block opening, and how many requests and workers
that opening had over the run).

Each spill (a request sent away from the worker holding its longest cached run) is counted by its
cause: ``forced`` when every holder was at the bounded-load cap, else by the term of kv_cache_aware's
cost that outweighed the prompt tokens the holder would have saved (``queue``: the holder's prefill
queue, ``requests``: its requests in flight, ``both``: neither alone; ``other``: not the load terms,
as a pool's eviction, or a router that does not price them), and ``direct_loss`` is those
saved tokens over all the prompt tokens: the hit rate the spills cost on their own requests. With
several ``--seeds`` (trace seeds) a summary follows: median [min-max] over the seeds.

    .venv/bin/python bench/routing_sim_trace.py --traces shared-prefix,multi-turn,mooncake \
        --sizes 8,32,128 --seeds 0,1,2,3 --routers sticky_session,kv_cache_aware
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from routing_scale import UNIT_COST, dilated, fleet_dilation, make_case, oracle
from routing_scale import parse_args as scale_args
from routing_sim import MODEL_ID, Request, Shape, Simulation, SimWorker

from herd.api.kv_hash import block_hashes
from herd.api.prompt import PromptRenderer
from herd.orchestrator.routing import RequestContext, WorkerView, decide
from herd.orchestrator.routing._load import bounded_load_cap
from herd.orchestrator.routing.kv_cache_aware import MIN_RUN_BLOCKS, REQUEST_SHARE
from herd.worker.config import EngineConfig
from herd.worker.simulated_runner import CostModel, VirtualClock, simulated_engine

__all__ = ["main"]

BLOCK_SIZE = 16


@dataclass
class TraceRequest(Request):
    session: str = ""
    after: int | None = None
    """The number of the request this one extends (it waits for that one's answer)."""
    arrival_ms: float = 0.0


class TraceSimulation(Simulation):
    """One router replaying one trace on one fleet, open loop."""

    def __init__(self, shape: Shape, router: str, requests: list[TraceRequest], engine: dict[str, Any],
                 cost: dict[str, float], renderer: PromptRenderer) -> None:  # fmt: skip
        self.engine_block, self.cost = engine, cost
        super().__init__(shape, router, 0, renderer)
        self.requests = requests
        self.waiting: dict[int, list[TraceRequest]] = {}
        """Requests waiting for the answer of the request they extend, by its number."""
        self.finished: set[int] = set()
        self.served_by: dict[int, str] = {}
        self.spills: Counter[str] = Counter()
        self.spilled_tokens = 0

    def _worker(self, number: int, renderer: PromptRenderer) -> SimWorker:
        config = EngineConfig(model_path=self._model_path, served_name=MODEL_ID, engine=self.engine_block)
        cost = CostModel(
            step_ms=self.cost["stepMs"], seq_ms=self.cost["seqMs"], token_ms=self.cost["tokenMs"]
        )
        clock = VirtualClock()
        engine = simulated_engine(
            config, num_blocks=self.shape.pool_blocks, cost=cost, clock=clock, renderer=renderer
        )
        worker = SimWorker(f"worker-{number}", engine, clock)
        self.index.reset(worker.id, engine.kv_snapshot())
        return worker

    _model_path = Path(__file__).resolve().parent.parent / ".cache" / "models" / "smollm2-135m-instruct"

    def run(self) -> dict[str, Any]:
        for request in self.requests:
            self._at(request.arrival_ms, "arrive", request)
        self._run_until(len(self.requests))
        return self._trace_summary()

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "arrive":
            self._arrive(payload)
        else:
            super()._handle(kind, payload)

    def _arrive(self, request: TraceRequest) -> None:
        if request.after is not None and request.after not in self.finished:
            self.waiting.setdefault(request.after, []).append(request)
            return
        self._route(request)

    def _route(self, request: TraceRequest) -> None:
        request.sent_ms = self.now
        views = [self._view(worker) for worker in self.workers]
        context = RequestContext(model=MODEL_ID, token_ids=request.token_ids, block_hashes=request.hashes,
                                 session_key=request.session, pinned_worker_id=self.pins.get(f"{MODEL_ID}:{request.session}"))  # fmt: skip
        decision = decide(self.model, views, context)
        self._count_spill(views, request, decision.worker.id)
        self._apply(decision)
        request.num_prefill_tokens = decision.num_prefill_tokens
        self._admit(next(w for w in self.workers if w.id == decision.worker.id), request)

    def _count_spill(self, views: list[WorkerView], request: TraceRequest, chosen: str) -> None:
        """A spill: the request went elsewhere than a worker holding its longest cached run; counted by
        its cause (see the module's docstring)."""
        matched = self.index.match(request.hashes)
        if not matched or matched.get(chosen, 0) == (best := max(matched.values())):
            return
        self.num_spilled += 1
        saved = BLOCK_SIZE * (best - matched.get(chosen, 0))
        self.spilled_tokens += saved
        cap = bounded_load_cap(views, self.shape.load_factor)
        holders = [view for view in views if matched.get(view.id, 0) == best and view.num_in_flight < cap]
        if not holders:
            self.num_forced += 1
            self.spills["forced"] += 1
            return
        per_request = len(request.token_ids) * REQUEST_SHARE * self.shape.load_weight

        def terms(view: WorkerView) -> tuple[float, float]:
            return view.queued_prefill_tokens * self.shape.load_weight, view.num_requests * per_request

        queued, requests = terms(next(view for view in views if view.id == chosen))
        holder_queued, holder_requests = min((terms(view) for view in holders), key=sum)
        by_queue, by_requests = holder_queued - queued, holder_requests - requests
        self.spills["queue" if by_queue >= saved > by_requests else "requests" if by_requests >= saved > by_queue
                    else "both" if by_queue + by_requests >= saved else "other"] += 1  # fmt: skip

    def _finish(self, worker: SimWorker, request: Request) -> None:
        del worker.requests[str(request.number)]
        request.finished_ms = self.now
        self.in_flight[worker.id] -= 1
        self.served_by[request.number] = worker.id
        self.finished.add(request.number)
        self.done.append(request)
        for waiting in self.waiting.pop(request.number, []):
            self._route(waiting)

    def _poll(self) -> None:
        """The status streams' period: the workers read."""
        self._read_workers()

    def _trace_summary(self) -> dict[str, Any]:
        done = self.done
        prompt = sum(len(request.token_ids) for request in done)
        cached = sum(request.num_cached_tokens for request in done)
        ttft = sorted((request.first_token_ms or 0.0) - request.sent_ms for request in done)
        span = max(r.finished_ms for r in done) - min(r.sent_ms for r in done)
        busy = {worker.id: 0.0 for worker in self.workers}
        for request in done:
            busy[self.served_by[request.number]] += request.finished_ms - request.sent_ms
        mean = statistics.fmean(busy.values())
        return {
            "hit_rate": round(cached / prompt, 4),
            "ttft_p50_ms": round(statistics.median(ttft), 1),
            "ttft_p99_ms": round(ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))], 1),
            "in_flight_max_over_mean": round(max(busy.values()) / mean, 3) if mean else None,
            "span_s": round(span / 1000, 1),
            "spill_rate": round(self.num_spilled / len(done), 3),
            "forced_spill_rate": round(self.num_forced / len(done), 3),
            "spills": dict(self.spills),
            "direct_loss": round(self.spilled_tokens / prompt, 4),
            "busiest": self._busiest(max(busy, key=busy.__getitem__)),
        }

    def _busiest(self, worker_id: str) -> dict[str, int]:
        """What the busiest worker served: its requests, how many of them share its most common
        opening (the prompt's first ``MIN_RUN_BLOCKS`` blocks: a Mooncake application's context, a
        shared-prefix group's system prompt), that opening's requests in the whole trace and how many
        workers served them."""
        served = [r for r in self.done if self.served_by[r.number] == worker_id]
        openings = Counter(r.hashes[MIN_RUN_BLOCKS - 1] for r in served if len(r.hashes) >= MIN_RUN_BLOCKS)
        if not openings:
            return {"requests": len(served)}
        top, count = openings.most_common(1)[0]
        same = [
            r for r in self.done if len(r.hashes) >= MIN_RUN_BLOCKS and r.hashes[MIN_RUN_BLOCKS - 1] == top
        ]
        return {"requests": len(served), "top_opening": count, "opening_requests": len(same),
                "opening_workers": len({self.served_by[r.number] for r in same})}  # fmt: skip


def load_trace(path: Path, renderer: PromptRenderer, rate: float) -> list[TraceRequest]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    stamps = [line["timestamp"] for line in lines]
    scale = (len(lines) / rate * 1000) / max(1.0, stamps[-1] - stamps[0]) if len(lines) > 1 else 1.0
    last_of: dict[str, int] = {}
    requests = []
    for number, line in enumerate(lines):
        ids = renderer.encode_chat(line["messages"], add_generation_prompt=True)
        session = line.get("session_id") or ""
        previous = last_of.get(session)
        extends = (
            previous is not None
            and line["messages"][: len(lines[previous]["messages"])] == lines[previous]["messages"]
        )
        request = TraceRequest(number, 0, ids, block_hashes(ids, BLOCK_SIZE, model_id=MODEL_ID), 0.0,
                               session=session, after=previous if extends else None,
                               arrival_ms=(line["timestamp"] - stamps[0]) * scale)  # fmt: skip
        requests.append(request)
        last_of[session] = number
    return requests


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per trace, fleet size and router: median [min-max] over the seeds of the headline figures."""

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"

    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["trace"], row["size"], row["router"]), []).append(row)
    return [
        f"{trace} x {size} {router:<16} of oracle {spread([r['of_oracle'] for r in group])}, "
        f"max/mean {spread([r['in_flight_max_over_mean'] for r in group])}, "
        f"TTFT p99 {spread([r['ttft_p99_ms'] for r in group])}, spills {spread([r['spill_rate'] for r in group])} "
        f"(forced {spread([r['forced_spill_rate'] for r in group])})"
        for (trace, size, router), group in groups.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traces", default="shared-prefix", help="kinds, comma-separated")
    parser.add_argument("--sizes", default="8,32,128")
    parser.add_argument("--routers", default="round_robin,sticky_session,kv_cache_aware")
    parser.add_argument("--load", type=float, default=80.0, help="percent of the base fleet's capacity")
    parser.add_argument("--poll-ms", type=float, default=900.0)
    parser.add_argument("--load-factor", type=float, default=1.25)
    parser.add_argument("--load-weight", type=float, default=1.0, help="kv_cache_aware's loadWeight")
    parser.add_argument("--fixed-traces", action="store_true")
    parser.add_argument("--seeds", default="0", help="the traces' seeds, comma-separated")
    parser.add_argument("--out", type=Path, help="write every row here as JSON")
    args = parser.parse_args(argv)
    rows = []
    for trace, seed in ((t, int(s)) for t in args.traces.split(",") for s in args.seeds.split(",")):
        rows += run_trace(trace, seed, args)
    if len(args.seeds.split(",")) > 1:
        print("\n".join(summary(rows)))
    if args.out:
        args.out.write_text(json.dumps({"argv": sys.argv[1:] if argv is None else argv, "args": {k: str(v) for k, v in vars(args).items()},
                                        "rows": rows}, indent=1))  # fmt: skip
    return 0


def run_trace(trace: str, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every router over one trace seed at every fleet size."""
    scale = scale_args(["--seed", str(seed), *(["--fixed-traces"] if args.fixed_traces else [])])
    renderer = PromptRenderer.from_pretrained(scale.model)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for size in (int(size) for size in args.sizes.split(",")):
            case = make_case(trace, size, (args.load / 100,), scale, Path(folder))
            cost = dilated(UNIT_COST, fleet_dilation(case.base_shape, scale))
            engine = {"maxBatchSize": scale.batch, "maxBatchTokens": 4096, "maxQueueLen": scale.max_queue,
                      "kvCache": {"blockSize": BLOCK_SIZE}}  # fmt: skip
            shape = Shape(num_workers=size, pool_blocks=case.num_blocks, poll_ms=args.poll_ms,
                          load_factor=args.load_factor, load_weight=args.load_weight)  # fmt: skip
            rate = args.load / 100 * scale.capacity_rps
            best = oracle(case.trace, size, case.num_blocks, scale.model)
            print(f"{trace} (seed {seed}) x {size} workers, {case.shape.num_requests} requests at {rate:.1f}/s, "
                  f"pool {case.num_blocks} blocks, oracle {best['oracle_hit_rate']}, ceiling {best['ceiling_hit_rate']}")  # fmt: skip
            for router in args.routers.split(","):
                requests = load_trace(case.trace, renderer, rate)
                row = TraceSimulation(shape, router, requests, engine, cost, renderer).run()
                row["of_oracle"] = round(row["hit_rate"] / best["oracle_hit_rate"], 3)
                print(f"  {router:<16} {row}", flush=True)
                rows.append({"trace": trace, "seed": seed, "size": size, "router": router, **row})
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
