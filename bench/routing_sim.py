"""Issue 4's routing benchmark (and issue 14's deployment) as a fast, deterministic simulation built
from the real pieces.

What is real: each simulated worker is herd's own ``LLMEngine`` (its scheduler, its block manager
with the LRU prefix cache that frees a sequence's blocks tail first, its KV events and load report)
on the cost-model runner (``herd.worker.simulated_runner``), and every request is routed by the
orchestrator's own ``decide`` (``herd.orchestrator.routing.decision``: capacity filter, the model's
strategy, the blocks to expect, the session pin) over a real ``KVIndex``. The simulator applies each
decision as the gateway does, in one step: its in-flight count per worker (with the request's
uncached prompt tokens until its first token), ``KVIndex.expect`` and the pin. The worker's ``stored`` / ``removed`` events and load reports reach the orchestrator only
at the registry's next poll (every 250 ms). The two reference routers below are strategies too.

What is modelled: there is no model. A worker step costs ``step_ms + seq_ms x sequences +
token_ms x tokens`` of simulated time (the runner's ``CostModel``; defaults near SmolLM2 fp32 on one
CPU thread: a 300-token prefill about 0.5 s, a decode step 60 ms) on the worker's own ``VirtualClock``, and the two
workers step independently (no contention for the CPU). A step's effects on the cache (committed
blocks, their events) happen when it runs, one step before its simulated end. The workers read the
demo model's ``config.json`` and tokenizer (``make run`` or the tests prepare it in
``.cache/models``), no weights. Clients form a closed loop: ``N``
requests in flight, each finished request immediately replaced by the next one. Tenants are drawn
i.i.d. uniformly by ``herd.cli.loadgen``'s own shared-prefix workload (the tenant and user-turn
length of every request are its draws); every tenant's system prompt is ``prefix_blocks`` full
blocks plus 3 tokens, the user turn its 16-32 words plus 9 template tokens (the real run averaged
308 prompt tokens; here about 308 too), and 8 output tokens. ``--shape issue14`` is issue 14's
deployment instead: 34-block prefixes (~550-token prompts), 16 output tokens, 8 in flight, pools of
436 blocks (0.3 GiB: every prefix fits on both workers) and the calibrated cost model of
``examples/smollm2-simulated.yaml``. ``--replay`` replays the benchmark's
exact sequences (12 warm-up requests drawn with seed + 1, the warm-up drained, then 36 measured
with the seed), to show how much a 36-request run varies from one seed to the next.

Two reference routers that exist only here bound what routing can do:

* ``affine``: a perfect tenant-affine router, tenant ``t`` always on worker ``t mod n`` (a balanced
  split, no load limit at all);
* ``affine_bounded``: the same home, but under the issue's bounded-load cap (``_load``): when the home
  is at the cap, the least loaded worker.

Hit rate = cached prompt tokens over prompt tokens (what the benchmark reads from
``usage.prompt_tokens_details.cached_tokens``), over the measured requests after a warm-up.
``ceiling`` is the share of prompt tokens in full prefix blocks (the user turn and the partial
block never hit). Also reported: TTFT p50 and p99 in simulated ms, requests per simulated second,
the mean over decisions of the busiest worker's in-flight count over the mean; the spill rate (requests sent to a
worker other than one holding the longest run of their prefix, by the index, when they were
routed) and the forced part of it (every such worker was at the bounded-load cap); and the mean
number of tenants whose whole prefix every worker's cache holds (duplication), sampled at each poll.

    .venv/bin/python bench/routing_sim.py                 # the benchmark's shape, several seeds
    .venv/bin/python bench/routing_sim.py --sweep         # plus tenants, pool share, in-flight count
    .venv/bin/python bench/routing_sim.py --out bench/results/routing_sim.json
    .venv/bin/python bench/routing_sim.py --shape issue14 --routers round_robin,kv_cache_aware
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import statistics
import sys
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import TypeAdapter

from herd.api.crd import RoundRobinRouting, RoutingSpec
from herd.api.kv_hash import block_hashes
from herd.api.prompt import PromptRenderer
from herd.api.protocol import KVEventBatch, KVSnapshot, LoadReport
from herd.cli.loadgen.workloads import LengthRange, SharedPrefixWorkload
from herd.orchestrator.discovery import ModelConfig
from herd.orchestrator.kv_index import KVIndex
from herd.orchestrator.routing import (
    Decision,
    RequestContext,
    RoutingStrategy,
    WorkerView,
    build_strategy,
    decide,
    pin_key,
)
from herd.orchestrator.routing._load import bounded_load_cap, least_in_flight
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.outputs import RequestOutput
from herd.worker.sampling_params import SamplingParams
from herd.worker.simulated_runner import CostModel, VirtualClock, simulated_engine

__all__ = ["main"]

REAL = ("round_robin", "least_request", "random", "prefix_hash", "sticky_session", "kv_cache_aware")
REFERENCE = ("affine", "affine_bounded")
BLOCK_SIZE = 16
MODEL_ID = "smollm2"
PREFIX_EXTRA_TOKENS = 3
USER_WORDS = "16:32"
TEMPLATE_TOKENS = 9
DEMO_MODEL = Path(__file__).resolve().parent.parent / ".cache" / "models" / "smollm2-135m-instruct"


ISSUE14_COST = {"step_ms": 39.2, "seq_ms": 23.1, "token_ms": 2.08}
"""The cost model examples/smollm2-simulated.yaml carries (``herd bench calibrate`` on the demo model)."""
SHAPES: dict[str, dict[str, Any]] = {
    "issue4": {},
    "issue14": {
        "prefix_blocks": 34,  # ~500-word system prompts: ~550-token prompts
        "pool_blocks": 436,  # 0.3 GiB of the demo model's fp32 KV: every prefix fits on both workers
        "output_tokens": 16,
        "concurrency": 8,
        **ISSUE14_COST,
    },
}
"""``--shape``: issue 4's benchmark (each pool holds half of the prefixes) and issue 14's deployment."""


@dataclass(frozen=True)
class Shape:
    """One workload and cluster shape."""

    num_tenants: int = 8
    prefix_blocks: int = 17
    cache_share: float = 0.5
    pool_blocks: int | None = None
    """Every worker's KV pool in blocks; ``None``: sized by ``cache_share`` (``num_kv_blocks``)."""
    output_tokens: int = 8
    concurrency: int = 4
    num_workers: int = 2
    warmup: int = 200
    measured: int = 2000
    replay: bool = False
    """The benchmark's own request sequence: ``warmup`` drawn with seed + 1, then ``measured`` with seed."""
    poll_ms: float = 250.0
    step_ms: float = 60.0
    seq_ms: float = 0.0
    token_ms: float = 1.5
    load_factor: float = 1.25
    """``spec.routing.loadFactor`` of prefix_hash, kv_cache_aware and affine_bounded (1.25: the default)."""
    load_weight: float = 1.0
    """``spec.routing.loadWeight`` of kv_cache_aware (1.0: the default)."""

    def num_kv_blocks(self) -> int:
        """As ``bench/routing_strategies.py`` sizes a pool: the share of all prefixes, plus the private
        blocks of the worker's share of the requests in flight; ``pool_blocks`` if given."""
        if self.pool_blocks is not None:
            return self.pool_blocks
        per_request = math.ceil((LengthRange.parse(USER_WORDS).high + self.output_tokens) / BLOCK_SIZE) + 1
        private = math.ceil(self.concurrency / self.num_workers) * per_request
        return math.ceil(self.num_tenants * self.prefix_blocks * self.cache_share) + private


@dataclass
class Request:
    number: int
    tenant: int
    token_ids: list[int]
    hashes: list[int]
    sent_ms: float
    first_token_ms: float | None = None
    finished_ms: float = 0.0
    num_cached_tokens: int = 0
    num_prefill_tokens: int = 0
    """The uncached tokens its decision counted on the worker until its first token."""


@dataclass
class SimWorker:
    id: str
    engine: LLMEngine
    clock: VirtualClock
    busy: bool = False
    requests: dict[str, Request] = field(default_factory=dict)
    report: LoadReport = field(default_factory=LoadReport)


@dataclass(frozen=True)
class SimModel:
    """The served model ``decide`` reads (``RoutedModel``): its config, strategy and KV index."""

    config: ModelConfig
    strategy: RoutingStrategy
    kv_index: KVIndex


class Affine(RoutingStrategy):
    """Reference router: tenant ``t`` always on worker ``t mod n``; with ``load_factor``, only while
    that worker is under the bounded-load cap (else the least loaded worker)."""

    name: ClassVar[str] = "affine"

    def __init__(self, load_factor: float | None, rng: random.Random) -> None:
        self.load_factor = load_factor
        self.rng = rng

    def select(self, workers: Seq[WorkerView], ctx: RequestContext) -> WorkerView | None:
        home = workers[int(ctx.headers["tenant"]) % len(workers)]
        if self.load_factor is None or home.num_in_flight < bounded_load_cap(workers, self.load_factor):
            return home
        return least_in_flight(workers, self.rng)


def routed_model(name: str, index: KVIndex, seed: int, shape: Shape) -> SimModel:
    """A real strategy, or one of the reference routers, as the routing of one served model."""
    if name in REFERENCE:
        bound = shape.load_factor if name == "affine_bounded" else None
        config = ModelConfig(MODEL_ID, RoundRobinRouting(strategy="round_robin"), block_size=BLOCK_SIZE)
        return SimModel(config, Affine(bound, random.Random(seed)), index)
    settings: dict[str, Any] = {"strategy": name}
    if name in ("prefix_hash", "kv_cache_aware"):
        settings["loadFactor"] = shape.load_factor
    if name == "kv_cache_aware":
        settings["loadWeight"] = shape.load_weight
    spec = TypeAdapter(RoutingSpec).validate_python(settings)
    strategy = build_strategy(spec, kv_index=index, block_size=BLOCK_SIZE, rng=random.Random(seed))
    return SimModel(ModelConfig(MODEL_ID, spec, block_size=BLOCK_SIZE), strategy, index)


class Simulation:
    """One router over one shape and seed: a discrete-event loop in simulated milliseconds."""

    def __init__(self, shape: Shape, router_name: str, seed: int, renderer: PromptRenderer) -> None:
        self.shape = shape
        self.now = 0.0
        self.index = KVIndex(clock=lambda: self.now / 1000)
        self.model = routed_model(router_name, self.index, seed, shape)
        self.workers = [self._worker(number, renderer) for number in range(shape.num_workers)]
        self.in_flight = {worker.id: 0 for worker in self.workers}
        self.prefill_in_flight = {worker.id: 0 for worker in self.workers}
        self.pins: dict[str, str] = {}
        self.turns = self._turns(seed)
        self.prefixes = [
            random.Random(seed * 1000 + t).choices(range(49152), k=self._prefix_len())
            for t in range(shape.num_tenants)
        ]
        self.events: list[tuple[float, int, str, Any]] = []
        self.counter = itertools.count()
        self.done: list[Request] = []
        self.num_sent = 0
        self.num_spilled = 0
        self.num_forced = 0
        self.duplication: list[int] = []
        self.imbalance: list[float] = []

    def _prefix_len(self) -> int:
        return self.shape.prefix_blocks * BLOCK_SIZE + PREFIX_EXTRA_TOKENS

    def _worker(self, number: int, renderer: PromptRenderer) -> SimWorker:
        shape, clock = self.shape, VirtualClock()
        config = EngineConfig(
            model_path=DEMO_MODEL,
            served_name=MODEL_ID,
            engine={"maxBatchTokens": 1024, "maxBatchSize": 64, "kvCache": {"blockSize": BLOCK_SIZE}},
        )
        cost = CostModel(step_ms=shape.step_ms, seq_ms=shape.seq_ms, token_ms=shape.token_ms)
        engine = simulated_engine(
            config, num_blocks=shape.num_kv_blocks(), cost=cost, clock=clock, renderer=renderer
        )
        worker = SimWorker(f"worker-{number}", engine, clock)
        epoch = engine.info.epoch
        self.index.reset(worker.id, KVSnapshot(epoch=epoch, seq=0, block_size=BLOCK_SIZE, block_hashes=[]))
        return worker

    def run(self) -> dict[str, Any]:
        for _ in range(self.shape.concurrency):
            self._send()
        self._run_until(len(self.turns))
        first, end = self.shape.warmup, self.shape.warmup + self.shape.measured
        return self._summary([request for request in self.done if first <= request.number < end])

    def _run_until(self, num_done: int) -> None:
        """The event loop, polls included, until ``num_done`` requests have finished."""
        self._at(self.shape.poll_ms, "poll", None)
        while len(self.done) < num_done:
            self.now, _, kind, payload = heapq.heappop(self.events)
            self._handle(kind, payload)

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "step":
            self._step(payload)
        elif kind == "first_token":
            worker, request = payload
            self.prefill_in_flight[worker.id] -= request.num_prefill_tokens
        elif kind == "finish":
            self._finish(*payload)
        elif kind == "poll":
            self._poll()
            self._at(self.now + self.shape.poll_ms, "poll", None)

    def _at(self, when: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (when, next(self.counter), kind, payload))

    def _turns(self, seed: int) -> list[tuple[int, int]]:
        """``(tenant, user words)`` of every request, drawn by ``herd.cli.loadgen`` as ``herd bench`` does."""

        def draw(seed: int, count: int) -> list[tuple[int, int]]:
            workload = SharedPrefixWorkload(
                num_tenants=self.shape.num_tenants,
                prefix_len=1,
                input_len=LengthRange.parse(USER_WORDS),
                output_len=LengthRange.parse(str(self.shape.output_tokens)),
                seed=seed,
            )
            specs = [workload.next_request() for _ in range(count)]
            return [(spec.tenant or 0, len(spec.messages[-1]["content"].split())) for spec in specs]

        if self.shape.replay:
            return draw(seed + 1, self.shape.warmup) + draw(seed, self.shape.measured)
        # A few more than needed: the closed loop sends its last requests while the others finish.
        return draw(seed, self.shape.warmup + self.shape.measured + self.shape.concurrency)

    def _send(self) -> None:
        if self.num_sent >= len(self.turns):
            return
        if self.shape.replay and self.num_sent >= self.shape.warmup > len(self.done):
            return  # the benchmark's warm-up run ends before its measured run starts
        tenant, num_words = self.turns[self.num_sent]
        user = random.Random(self.num_sent).choices(range(49152), k=num_words + TEMPLATE_TOKENS)
        token_ids = self.prefixes[tenant] + user
        hashes = block_hashes(token_ids, BLOCK_SIZE, model_id=MODEL_ID)
        request = Request(self.num_sent, tenant, token_ids, hashes, self.now)
        self.num_sent += 1
        self._admit(self._route(request), request)

    def _route(self, request: Request) -> SimWorker:
        """The gateway's decision for ``request``, applied; counts it as a spill (forced or not)."""
        views = [self._view(worker) for worker in self.workers]
        matched = self._held(request.hashes)
        decision = decide(self.model, views, self._context(request))
        self._apply(decision)
        request.num_prefill_tokens = decision.num_prefill_tokens
        choice = decision.worker
        if matched and matched.get(choice.id, 0) < max(matched.values()):
            self.num_spilled += 1
            cap = bounded_load_cap(views, self.shape.load_factor)
            best = max(matched.values())
            if all(view.num_in_flight >= cap for view in views if matched.get(view.id, 0) == best):
                self.num_forced += 1
        return next(w for w in self.workers if w.id == choice.id)

    def _held(self, hashes: list[int]) -> dict[str, int]:
        """Each worker's leading run of ``hashes`` by the index: on its device or expected there."""
        return self.index.match(hashes)

    def _context(self, request: Request) -> RequestContext:
        session = f"tenant-{request.tenant}"
        return RequestContext(
            model=MODEL_ID,
            token_ids=request.token_ids,
            block_hashes=request.hashes,
            session_key=session,
            pinned_worker_id=self.pins.get(pin_key(MODEL_ID, session)),
            headers={"tenant": str(request.tenant)},
        )

    def _apply(self, decision: Decision) -> None:
        """The gateway's one step: count the worker in flight with its prefill tokens, expect its
        blocks, write the pin."""
        self.in_flight[decision.worker.id] += 1
        self.prefill_in_flight[decision.worker.id] += decision.num_prefill_tokens
        counts = self.in_flight.values()
        self.imbalance.append(max(counts) * len(counts) / sum(counts))
        if decision.expected_blocks:
            self.index.expect(decision.worker.id, decision.expected_blocks)
        if decision.pin is not None:
            self.pins[decision.pin.key] = decision.pin.worker_id

    def _view(self, worker: SimWorker) -> WorkerView:
        report = worker.report
        return WorkerView(
            id=worker.id,
            url=f"http://{worker.id}",
            num_in_flight=self.in_flight[worker.id],
            num_prefill_tokens_in_flight=self.prefill_in_flight[worker.id],
            num_running=report.num_running,
            num_waiting=report.num_waiting,
            num_waiting_prefill_tokens=report.num_waiting_prefill_tokens,
            num_total_blocks=report.num_total_blocks,
            max_batch_tokens=report.max_batch_tokens,
            prefill_tokens_per_s=report.prefill_tokens_per_s,
            decode_step_s=report.decode_step_s,
        )

    def _admit(self, worker: SimWorker, request: Request) -> None:
        request_id = str(request.number)
        worker.requests[request_id] = request
        worker.engine.add_request(
            request_id,
            request.token_ids,
            SamplingParams(max_tokens=self.shape.output_tokens, ignore_eos=True),
        )
        if not worker.busy:
            worker.busy = True
            self._at(self.now, "step", worker)

    def _step(self, worker: SimWorker) -> None:
        """One engine step on the worker's clock, set to now: its cost is how far the clock moved."""
        engine = worker.engine
        if not engine.has_unfinished_requests():
            worker.busy = False
            return
        worker.clock.now = started = self.now / 1000
        outputs = engine.step()
        if worker.clock.now == started and not outputs:
            # Nothing fitted (the free blocks are lent to a peer's pull): idle until a request or a
            # release wakes the worker, rather than step again at the same instant.
            worker.busy = False
            return
        finish_ms = worker.clock.now * 1000
        for output in outputs:
            self._record(worker, output, finish_ms)
        # Pushed after the finishes of the same instant, so they retire before the next step.
        self._at(finish_ms, "step", worker)

    def _record(self, worker: SimWorker, output: RequestOutput, finish_ms: float) -> None:
        request = worker.requests[output.request_id]
        if output.new_token_ids and request.first_token_ms is None:
            request.first_token_ms = finish_ms
            self._at(finish_ms, "first_token", (worker, request))
        if output.finished:
            request.num_cached_tokens = output.num_cached_tokens
            self._at(finish_ms, "finish", (worker, request))

    def _finish(self, worker: SimWorker, request: Request) -> None:
        del worker.requests[str(request.number)]
        request.finished_ms = self.now
        self.in_flight[worker.id] -= 1
        self.done.append(request)
        is_warmup_over = self.shape.replay and len(self.done) == self.shape.warmup
        for _ in range(self.shape.concurrency if is_warmup_over else 1):
            self._send()

    def _poll(self) -> None:
        """The registry's poll: the workers read, and the duplication sampled."""
        self._read_workers()
        self.duplication.append(self._num_duplicated())

    def _read_workers(self) -> None:
        """Each worker's KV events since the last read, into the index, and its load report."""
        for worker in self.workers:
            engine = worker.engine
            batch = KVEventBatch(epoch=engine.info.epoch, events=engine.drain_kv_events())
            if batch.events and not self.index.apply(worker.id, batch):
                raise RuntimeError(f"{worker.id}: KV events out of order; the simulation lost some")
            worker.report = engine.load_report()

    def _num_duplicated(self) -> int:
        """Tenants whose whole prefix every worker's cache holds."""
        caches = [set(worker.engine.kv_snapshot().block_hashes) for worker in self.workers]
        count = 0
        for prefix in self.prefixes:
            last = block_hashes(prefix, BLOCK_SIZE, model_id=MODEL_ID)[-1]
            count += all(last in cache for cache in caches)
        return count

    def _summary(self, measured: list[Request]) -> dict[str, Any]:
        prompt = sum(len(request.token_ids) for request in measured)
        cached = sum(request.num_cached_tokens for request in measured)
        ttft = sorted((request.first_token_ms or 0.0) - request.sent_ms for request in measured)
        span_ms = max(r.finished_ms for r in measured) - min(r.sent_ms for r in measured)
        return {
            "hit_rate": cached / prompt,
            "ceiling": len(measured) * self.shape.prefix_blocks * BLOCK_SIZE / prompt,
            "ttft_p50_ms": statistics.median(ttft),
            "ttft_p99_ms": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
            "requests_per_s": 1000 * len(measured) / span_ms,
            "in_flight_max_over_mean": statistics.fmean(self.imbalance),
            "spill_rate": self.num_spilled / self.num_sent,
            "forced_spill_rate": self.num_forced / self.num_sent,
            "duplicated_tenants": statistics.fmean(self.duplication) if self.duplication else 0.0,
        }


def simulate(shape: Shape, routers: Seq[str], seeds: Seq[int]) -> dict[str, dict[str, float]]:
    """Mean of each figure over ``seeds``, per router, plus the hit rate over round robin's."""
    table: dict[str, dict[str, float]] = {}
    renderer = PromptRenderer.from_pretrained(DEMO_MODEL)  # one for every simulated worker
    for name in routers:
        runs = [Simulation(shape, name, seed, renderer).run() for seed in seeds]
        table[name] = {key: round(statistics.fmean(run[key] for run in runs), 4) for key in runs[0]}
        table[name]["hit_rate_min"] = round(min(run["hit_rate"] for run in runs), 4)
        table[name]["hit_rate_max"] = round(max(run["hit_rate"] for run in runs), 4)
    base = table.get("round_robin", {}).get("hit_rate")
    for row in table.values():
        row["vs_round_robin"] = round(row["hit_rate"] / base, 3) if base else math.nan
    return table


def sweep_shapes(base: Shape) -> list[tuple[str, Shape]]:
    """The benchmark's shape, then one knob at a time."""
    shapes = [("benchmark", base)]
    shapes += [(f"tenants={n}", Shape(**{**vars(base), "num_tenants": n})) for n in (4, 16)]
    shapes += [(f"cache_share={s}", Shape(**{**vars(base), "cache_share": s})) for s in (0.34, 0.75)]
    shapes += [(f"concurrency={c}", Shape(**{**vars(base), "concurrency": c})) for c in (2, 8)]
    shapes += [(f"load_factor={f}", Shape(**{**vars(base), "load_factor": f})) for f in (2.0,)]
    return shapes


def print_table(label: str, shape: Shape, table: dict[str, dict[str, float]]) -> None:
    print(
        f"\n{label}: {shape.num_tenants} tenants x {shape.prefix_blocks} blocks, pool {shape.num_kv_blocks()}"
    )
    print(
        "| router | hit rate (min-max) | vs round robin | of ceiling | TTFT p50 / p99 (sim ms) | req/s "
        "| in flight max/mean | spill (forced) | dup tenants |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in table.items():
        print(
            f"| {name} | {row['hit_rate']:.1%} ({row['hit_rate_min']:.1%}-{row['hit_rate_max']:.1%}) | "
            f"{row['vs_round_robin']:.2f}x | {row['hit_rate'] / row['ceiling']:.0%} | "
            f"{row['ttft_p50_ms']:.0f} / {row['ttft_p99_ms']:.0f} | {row['requests_per_s']:.2f} | "
            f"{row['in_flight_max_over_mean']:.2f} | {row['spill_rate']:.1%} ({row['forced_spill_rate']:.1%}) | {row['duplicated_tenants']:.2f} |"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--routers", default=",".join(("round_robin", *REFERENCE, *REAL[1:])))
    parser.add_argument("--seeds", type=int, default=5, help="runs per router (seeds 0..N-1), averaged")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--measured", type=int, default=2000)
    parser.add_argument(
        "--replay", action="store_true", help="the benchmark's sequences: 12 warm-up (seed + 1), 36 measured"
    )
    parser.add_argument("--load-factor", type=float, default=1.25, help="spec.routing.loadFactor")
    parser.add_argument("--load-weight", type=float, default=1.0, help="kv_cache_aware's loadWeight")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="issue4",
        help="issue 4's benchmark or issue 14's deployment",
    )
    parser.add_argument("--sweep", action="store_true", help="also vary tenants, pool share, in-flight")
    parser.add_argument("--out", type=Path, default=None, help="write the tables as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    routers = [name.strip() for name in args.routers.split(",") if name.strip()]
    if unknown := set(routers) - set(REAL) - set(REFERENCE):
        print(
            f"--routers: unknown {sorted(unknown)}; choose from {', '.join(REAL + REFERENCE)}",
            file=sys.stderr,
        )
        return 2
    knobs = {"load_factor": args.load_factor, "load_weight": args.load_weight}
    base = Shape(**SHAPES[args.shape], warmup=args.warmup, measured=args.measured, **knobs)
    if args.replay:
        base = Shape(warmup=12, measured=36, replay=True, **knobs)
    shapes = sweep_shapes(base) if args.sweep else [("benchmark", base)]
    results = {}
    for label, shape in shapes:
        table = simulate(shape, routers, range(args.seeds))
        print_table(label, shape, table)
        results[label] = {"shape": {**vars(shape), "num_kv_blocks": shape.num_kv_blocks()}, "routers": table}
    if args.out is not None:
        command = ["python", "bench/routing_sim.py", *(argv if argv is not None else sys.argv[1:])]
        args.out.write_text(
            json.dumps(
                {"benchmark": "routing_sim", "command": " ".join(command), "shapes": results}, indent=2
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
