"""Issue 14 at scale: herd's six routing strategies and the peer routers on simulated fleets.

A fleet is one ``herd worker --replicas N`` process (the simulated backend: herd's scheduler, block
manager and prefix cache over a cost model, ``hostShare`` 0, so a worker's steps sleep as a GPU's
leave the host idle). A router is ``herd orchestrator`` with one strategy over the fleet's static
worker list, or a peer router (``tests/support/peer_routers.py``) with one of its policies over the
same workers.
Every run replays the same requests through ``herd bench``'s client (``herd.cli.loadgen``) and reads:

* from the client: realized hit rate (``usage.prompt_tokens_details.cached_tokens``), TTFT p50/p99,
  ITL p99, output tokens/s, errors (rejected requests);
* from every worker's own ``/metrics`` before and after the run: its requests and the sum of their
  end-to-end latencies, so its mean in-flight over the run is ``sum / run length`` (Little's law);
  the balance figure is the most loaded worker's mean in-flight over the fleet's mean;
* the oracle's hit rate for the same requests on the same fleet (``herd bench oracle``), so each
  router is reported as a share of the best any router could do.

**Capacity** is computed from the cost model, not ramped: a worker running ``maxBatchSize`` sequences
finishes them in ``output x decode step + batch x prompt x tokenMs`` (every prompt token computed, as
with no cache), so its capacity is ``batch / that`` requests a second. A good router's hits lower the
load it really puts on the fleet; "100 %" is the load a cache-blind router saturates the fleet with.

**One machine, many workers.** All processes share 2 cores, which carry a few tens of requests a
second however many workers there are. So the workers are slowed (the unit cost model, an
accelerator's shape, multiplied by ``dilation``) until a fleet of ``--base-size`` workers has a
capacity of ``--capacity-rps``; herd's status period is dilated with them. The same worker serves
every fleet size, and the loads refer to the base fleet: the size sweep offers the same request rate
to 8, 32, 128 and 256 workers (each cell records its share of that fleet's capacity), the load sweep
at ``--sweep-size`` (the base fleet) goes past capacity. TTFT is also reported in cold prefills
(TTFT over an idle worker's time to prefill the mean prompt).

**Traces grow with the fleet** (``TRACE_OPTIONS``): a fixed number of prefix groups, sessions or
applications per worker, so that on every fleet a router can both keep each prefix on one worker and
keep every worker busy; each worker's pool holds the same number of blocks at every size.
``--fixed-traces`` replays one trace at every size, as the runs before this did.

Every run starts from cold caches without restarting the fleet: each run sends its own
``cache_salt``, which both the workers and herd's gateway mix into the first block's hash (the
earlier runs' blocks are free and least recently used: evicted first). Routers alternate within a
round (a fresh router process per run), ``--rounds`` rounds, median and range reported.

    .venv/bin/python bench/routing_scale.py --quick --out /tmp/routing_scale_quick.json
    .venv/bin/python bench/routing_scale.py --sizes 8,32,128 --loads '' \
        --routers herd:round_robin,herd:least_request,herd:random,herd:prefix_hash,herd:sticky_session,\
herd:kv_cache_aware,sglang-router:cache_aware,smg:cache_aware,vllm-router:cache_aware
    .venv/bin/python bench/routing_scale.py --sizes '' --gateways 1,2,4 --gateway-size 32 \
        --out bench/results/routing_scale_gateways.json
    .venv/bin/python bench/routing_scale.py --replot bench/results/routing_scale*.json --plots-dir docs/routing-at-scale
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from _common import (
    BYTES_PER_TOKEN,
    DEMO_MODEL,
    HOST,
    REPO,
    free_port,
    herd_workers,
    machine_info,
    metric_sums,
    run_load,
    serving,
    write_json,
)
from prometheus_client.parser import text_string_to_metric_families
from routing_scale_report import cell_table, overhead_table, plot, summarize_cell, targets
from support.peer_routers import PEERS, peer_router

from herd.api.prompt import PromptRenderer
from herd.cli.loadgen import BenchConfig
from herd.cli.loadgen.stats import percentile

__all__ = ["main"]

T = TypeVar("T")

HERD_STRATEGIES = (
    "round_robin",
    "least_request",
    "random",
    "prefix_hash",
    "sticky_session",
    "kv_cache_aware",
)
SERVED_NAME = "sim"
BLOCK_SIZE = 16
TOKEN = "routing-scale"
SESSION_HEADER = "X-Session-ID"
# An accelerator's shape (an 8B model on one H100, roughly): prefill 0.1 ms a token, a decode step of
# 15 ms plus a little per sequence. Only ratios matter: every fleet runs it dilated (see above).
UNIT_COST = {"stepMs": 15.0, "seqMs": 0.2, "tokenMs": 0.1, "contextUs": 0.0}
BASE_POLL_S = 0.25
WORKER_COUNTERS = (
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
)


@dataclass(frozen=True, slots=True)
class Router:
    """``herd:<strategy>`` or ``<peer>:<policy>``."""

    kind: str
    policy: str

    @classmethod
    def parse(cls, text: str) -> Router:
        kind, _, policy = text.partition(":")
        if not policy:
            raise ValueError(f"--routers: {text!r} is not KIND:POLICY (e.g. herd:kv_cache_aware)")
        known = {"herd": HERD_STRATEGIES, **{name: peer.policies for name, peer in PEERS.items()}}
        if policy not in known.get(kind, ()):
            raise ValueError(
                f"--routers: {text!r} is none of {[f'{k}:{p}' for k in known for p in known[k]]}"
            )
        return cls(kind, policy)

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.policy}"


@dataclass(frozen=True, slots=True)
class Shape:
    """The mean request of a trace, in tokens as the workers count them."""

    prompt_tokens: float
    output_tokens: float
    working_set_blocks: int
    num_requests: int


@dataclass(frozen=True, slots=True)
class Case:
    """One trace on one fleet size, replayed at each of ``loads`` (fractions of capacity).

    ``base_shape`` is the trace's shape at ``--base-size`` (the fleet's workers are slowed from it, so
    the same worker serves every size) and ``num_blocks`` each worker's KV pool (see ``make_case``)."""

    kind: str
    trace: Path
    shape: Shape
    num_workers: int
    loads: tuple[float, ...]
    base_shape: Shape
    num_blocks: int


@dataclass(slots=True)
class Fleet:
    """A running fleet: public and internal URLs, worker by worker, and how it was sized."""

    public: list[str]
    internal: list[str]
    dilation: float
    cost: dict[str, float]
    engine: dict[str, Any]
    blocks_per_worker: int


def decode_step_ms(cost: dict[str, float], batch: int) -> float:
    return cost["stepMs"] + (cost["seqMs"] + cost["tokenMs"]) * batch


def worker_capacity_rps(cost: dict[str, float], shape: Shape, batch: int) -> float:
    """Requests a second one worker completes at full batch with every prompt token computed."""
    busy_ms = (
        shape.output_tokens * decode_step_ms(cost, batch) + batch * shape.prompt_tokens * cost["tokenMs"]
    )
    return 1000.0 * batch / busy_ms


def cold_prefill_ms(cost: dict[str, float], shape: Shape) -> float:
    """An idle worker's time to prefill the mean prompt: the floor of TTFT with nothing cached."""
    return cost["stepMs"] + cost["seqMs"] + cost["tokenMs"] * shape.prompt_tokens


def dilated(cost: dict[str, float], factor: float) -> dict[str, float]:
    return {key: round(value * factor, 6) for key, value in cost.items()}


def fleet_dilation(shape: Shape, args: argparse.Namespace) -> float:
    """How much slower than the unit model every worker runs: so that a fleet of ``--base-size``
    workers has a capacity of ``--capacity-rps`` (the same worker at every fleet size)."""
    capacity_rps: float = args.capacity_rps
    base_size: int = args.base_size
    return base_size * worker_capacity_rps(UNIT_COST, shape, args.batch) / capacity_rps


def poll_interval_s(fleet: Fleet) -> float:
    """herd's status-line period (``--poll-interval``): the default dilated with the workers. Before the
    status stream (when the registry polled each worker three times a period) it was also stretched
    beyond 32 workers, to about 32 workers a period; a stream needs no stretch."""
    return BASE_POLL_S * fleet.dilation


# Each kind of trace scaled down from `herd bench trace`'s defaults to fit the simulated KV pools and
# the 2 cores: at --base-size (8) workers, about sixty requests of a few hundred tokens and short answers.
# The options in PER_WORKER grow with the fleet (x size / base size): a fleet serves a fixed number of
# prefix groups, sessions or applications per worker, as real fleets serve many more prefixes than
# workers (SGLang's generated-shared-prefix default is 64 groups x 16 prompts). A trace with fewer
# groups than workers cannot be balanced by a router that keeps each group on one worker.
TRACE_OPTIONS: dict[str, dict[str, str]] = {
    "shared-prefix": {
        "num_groups": "16",
        "prompts_per_group": "4",
        "system_prompt_len": "256",
        "question_len": "32",
        "output_len": "8",
    },
    "multi-turn": {"num_sessions": "16", "num_turns": "4", "user_len": "32", "output_len": "8"},
    "mooncake": {
        "num_requests": "64",
        "num_apps": "2",
        "app_context_len": "256",
        "tool_calls": "3:6",
        "task_len": "16:32",
        "tool_result_len": "16:48",
        "chat_turns": "1:3",
        "chat_len": "16:64",
        "output_len": "4:12",
    },
    "hot-burst": {
        "num_requests": "64",
        "num_prefixes": "16",
        "prefix_len": "256",
        "question_len": "32",
        "output_len": "8",
        "burst_requests": "32",
    },
}
PER_WORKER: dict[str, tuple[str, ...]] = {
    "shared-prefix": ("num_groups",),
    "multi-turn": ("num_sessions",),
    "mooncake": ("num_requests", "num_apps"),
    "hot-burst": ("num_requests", "num_prefixes"),
}
"""The options that grow with the fleet (the hot burst's size does not: one burst on one prefix)."""
# The traces before they grew with the fleet (the results files before it keep them): 16 groups x 8
# prompts, 24 sessions, 128 Mooncake requests over 4 applications, 96 hot-burst requests over 8
# prefixes, whatever the fleet; `--fixed-traces` replays those.
FIXED_TRACE_OPTIONS: dict[str, dict[str, str]] = {
    "shared-prefix": {**TRACE_OPTIONS["shared-prefix"], "prompts_per_group": "8"},
    "multi-turn": {**TRACE_OPTIONS["multi-turn"], "num_sessions": "24"},
    "mooncake": {**TRACE_OPTIONS["mooncake"], "num_requests": "128", "num_apps": "4"},
    "hot-burst": {**TRACE_OPTIONS["hot-burst"], "num_requests": "96", "num_prefixes": "8"},
}


def trace_options(kind: str, size: int, args: argparse.Namespace) -> dict[str, str]:
    """The options of the trace replayed on ``size`` workers (see ``TRACE_OPTIONS``)."""
    if args.fixed_traces:
        return FIXED_TRACE_OPTIONS[kind]
    scale = size / args.base_size
    grown = {name: str(max(1, round(int(TRACE_OPTIONS[kind][name]) * scale))) for name in PER_WORKER[kind]}
    return {**TRACE_OPTIONS[kind], **grown}


def herd_cli(*arguments: str) -> str:
    """``herd ARGUMENTS`` in this venv; its standard output (raises naming the command on failure)."""
    argv = [sys.executable, "-m", "herd.cli.main", *arguments]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv[2:])} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def write_trace(kind: str, size: int, args: argparse.Namespace, out_dir: Path) -> Path:
    """The trace of ``kind`` for ``size`` workers, written by ``herd bench trace``."""
    path = out_dir / f"{kind}-{size}.jsonl"
    options = [
        item
        for name, value in trace_options(kind, size, args).items()
        for item in (f"--{name.replace('_', '-')}", value)
    ]
    herd_cli("bench", "trace", "--kind", kind, "--out", str(path), "--seed", str(args.seed), *options)
    return path


def make_case(
    kind: str, size: int, loads: tuple[float, ...], args: argparse.Namespace, out_dir: Path
) -> Case:
    """``kind``'s trace for ``size`` workers. Each worker's pool holds ``--cache-share`` of the
    working set of the trace at ``--base-size`` (a quarter of the base trace's prefixes: twice a
    worker's fair share of them, whatever the size, since the trace grows with the fleet) plus room
    for the requests it runs; with ``--fixed-traces``, of the replayed trace's working set."""
    trace = write_trace(kind, size, args, out_dir)
    shape = trace_shape(trace, args.model)
    base_shape = (
        shape
        if size == args.base_size
        else trace_shape(write_trace(kind, args.base_size, args, out_dir), args.model)
    )
    working_set = shape.working_set_blocks if args.fixed_traces else base_shape.working_set_blocks
    batch: int = args.batch
    running = batch * math.ceil((shape.prompt_tokens + shape.output_tokens) / BLOCK_SIZE + 1)
    num_blocks = math.ceil(args.cache_share * working_set) + running
    return Case(kind, trace, shape, size, loads, base_shape, num_blocks)


def trace_shape(path: Path, model: Path) -> Shape:
    """Mean prompt and output tokens of a trace's requests, as the workers count them, and its
    working set: the distinct full KV blocks that more than one request's prompt holds."""
    from herd.api.kv_hash import block_hashes

    renderer = PromptRenderer.from_pretrained(model)
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [renderer.encode_chat(line["messages"], add_generation_prompt=True) for line in lines]
    uses = Counter(
        h for prompt in prompts for h in set(block_hashes(prompt, BLOCK_SIZE, model_id=SERVED_NAME))
    )
    return Shape(
        prompt_tokens=statistics.fmean(len(prompt) for prompt in prompts),
        output_tokens=statistics.fmean(line["output_length"] for line in lines),
        working_set_blocks=sum(1 for count in uses.values() if count > 1),
        num_requests=len(lines),
    )


def oracle(trace: Path, num_workers: int, num_blocks: int, model: Path) -> dict[str, Any]:
    """``herd bench oracle`` for the trace on this fleet: the ideal router's and the ceiling's hit rates."""
    output = herd_cli(
        "bench",
        "oracle",
        "--trace",
        str(trace),
        "--workers",
        str(num_workers),
        "--blocks-per-worker",
        str(num_blocks),
        "--model",
        str(model),
        "--block-size",
        str(BLOCK_SIZE),
    )
    report: dict[str, Any] = json.loads(output)
    return {key: report[key] for key in ("oracle_hit_rate", "ceiling_hit_rate", "num_requests")}


def engine_block(cost: dict[str, float], num_blocks: int, args: argparse.Namespace) -> dict[str, Any]:
    """The simulated workers' engine: exactly ``num_blocks`` KV blocks (half a block of slack)."""
    memory_gib = (num_blocks + 0.5) * BYTES_PER_TOKEN * BLOCK_SIZE / 2**30
    return {
        "backend": "simulated",
        "dtype": "float32",
        "device": "cpu",
        "maxModelLen": 4096,
        "maxBatchSize": args.batch,
        "maxBatchTokens": 4096,
        "maxQueueLen": args.max_queue,
        "kvCache": {"blockSize": BLOCK_SIZE, "memoryGiB": round(memory_gib, 6), "prefixCaching": True},
        "simulation": {"costModel": cost},
    }


@contextlib.contextmanager
def fleet(
    case: Case, args: argparse.Namespace, log_dir: Path, cost: dict[str, float] | None = None
) -> Iterator[Fleet]:
    """One ``herd worker --replicas N`` process on consecutive loopback ports; the unit cost model
    dilated for the fleet's size unless ``cost`` is given."""
    count = case.num_workers
    factor = 1.0 if cost else fleet_dilation(case.base_shape, args)
    cost, num_blocks = cost or dilated(UNIT_COST, factor), case.num_blocks
    engine = engine_block(cost, num_blocks, args)
    log = log_dir / f"fleet-{case.kind}-{count}.log"
    fleet = herd_workers(
        args.model, name=SERVED_NAME, token=TOKEN, engine=engine, log=log, replicas=count, timeout=600
    )
    with fleet as workers:
        public, internal = [url for url, _ in workers.urls], [url for _, url in workers.urls]
        yield Fleet(public, internal, factor, cost, engine, num_blocks)


def herd_manifest(strategy: str, engine: dict[str, Any], model: Path) -> dict[str, Any]:
    return {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": SERVED_NAME},
        "spec": {
            "model": {"source": f"file://{model.resolve()}", "servedName": SERVED_NAME},
            "engine": engine,
            "routing": {"strategy": strategy},  # sticky_session reads X-Session-ID, the default
        },
    }


def orchestrator_argv(manifest: Path, fleet: Fleet, port: int, redis_url: str | None) -> list[str]:
    """``herd orchestrator`` over the fleet; its poll period dilated with the workers (see above)."""
    argv = [sys.executable, "-m", "herd.cli.main", "orchestrator", "--manifest", str(manifest)]
    for number, (public, internal) in enumerate(zip(fleet.public, fleet.internal, strict=True)):
        argv += ["--worker", f"{public},{internal},unified,w{number:03d}"]
    argv += [f"--internal-token={TOKEN}", "--host", HOST, "--port", str(port), "--log-level", "WARNING"]
    argv += ["--poll-interval", f"{poll_interval_s(fleet):.3f}"]
    return argv + (["--redis", redis_url] if redis_url else [])


@contextlib.contextmanager
def herd_gateways(
    strategy: str,
    fleet: Fleet,
    args: argparse.Namespace,
    log_dir: Path,
    *,
    count: int = 1,
    redis_url: str | None = None,
) -> Iterator[list[str]]:
    """``count`` orchestrator replicas (over ``redis_url`` when more than one); their URLs."""
    manifest = log_dir / f"{strategy}.json"
    manifest.write_text(json.dumps(herd_manifest(strategy, fleet.engine, args.model)))
    with contextlib.ExitStack() as stack:
        urls = []
        for number in range(count):
            port = free_port()
            url = f"http://{HOST}:{port}"
            log = log_dir / f"orchestrator-{strategy}-{number}.log"
            argv = orchestrator_argv(manifest, fleet, port, redis_url)
            stack.enter_context(serving(argv, ready_url=f"{url}/ready", log=log, env={}, timeout=300))
            urls.append(url)
        wait_all_admitted(urls, len(fleet.public))
        yield urls


def wait_all_admitted(urls: Sequence[str], num_workers: int) -> None:
    """``/ready`` needs one healthy worker; the run waits until the gateway has admitted all."""
    deadline = time.monotonic() + 300
    for url in urls:
        while admitted_workers(url) < num_workers:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{url} admitted {admitted_workers(url)} of {num_workers} workers in 300 s"
                )
            time.sleep(0.5)


def admitted_workers(url: str) -> int:
    """The gateway's healthy workers, from its ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).raise_for_status().text
    return sum(
        int(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "herd_router_workers" and sample.labels.get("state") == "healthy"
    )


class RoundRobinTransport(httpx.AsyncBaseTransport):
    """Sends each request to the next gateway in turn (the client spreading load over replicas)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.targets = [httpx.URL(url) for url in urls]
        self.count = 0
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.inner = httpx.AsyncHTTPTransport(limits=limits)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        target = self.targets[self.count % len(self.targets)]
        self.count += 1
        request.url = request.url.copy_with(host=target.host, port=target.port)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def worker_counters(urls: Sequence[str]) -> list[dict[str, float]]:
    return [metric_sums(url, WORKER_COUNTERS) for url in urls]


def balance(before: list[dict[str, float]], after: list[dict[str, float]], seconds: float) -> dict[str, Any]:
    """Each worker's mean in-flight over the run (its requests' summed latency over the run's
    length) and requests, as max over mean across the fleet; the workers' own hit rate."""

    def delta(name: str) -> list[float]:
        return [end[name] - start[name] for start, end in zip(before, after, strict=True)]

    busy, requests = delta(WORKER_COUNTERS[0]), delta(WORKER_COUNTERS[1])
    hits, queries = sum(delta(WORKER_COUNTERS[2])), sum(delta(WORKER_COUNTERS[3]))
    mean_busy, mean_requests = statistics.fmean(busy), statistics.fmean(requests)
    return {
        "in_flight_mean": round(mean_busy / seconds, 3),
        "in_flight_max_over_mean": round(max(busy) / mean_busy, 3) if mean_busy else None,
        "requests_max_over_mean": round(max(requests) / mean_requests, 3) if mean_requests else None,
        "workers_used": sum(1 for count in requests if count),
        "worker_hit_rate": round(hits / queries, 4) if queries else None,
    }


def measure(
    urls: Sequence[str], fleet: Fleet, case: Case, load: float, args: argparse.Namespace, salt: str
) -> dict[str, Any]:
    """One replay of the trace through the router at ``urls`` (round robin over them when several)."""
    config = BenchConfig(
        url=urls[0],
        model=SERVED_NAME,
        workload="trace",
        trace=case.trace,
        session_header=SESSION_HEADER,
        request_rate=load * args.capacity_rps,
        num_requests=case.shape.num_requests,
        timeout_s=args.request_timeout,
        extra_body={"cache_salt": salt},
    )
    warm_up(urls, salt)
    before = worker_counters(fleet.public)
    report = run_load(config, transport=(lambda: RoundRobinTransport(urls)) if len(urls) > 1 else None)
    after = worker_counters(fleet.public)
    return {
        **summary(report, cold_prefill_ms(fleet.cost, case.shape)),
        **balance(before, after, report["duration_s"]),
    }


def warm_up(urls: Sequence[str], salt: str) -> None:
    """One short request through each router URL before the run, not counted: a fresh router's first
    request pays its one-time costs (herd's gateway loads the tokenizer then, about 0.7 s on a quiet
    host and many seconds on a starved one, and every request arriving meanwhile waits behind it).
    Its own salt keeps it out of the run's cache."""
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": "warm up"}],
        "max_tokens": 1,
        "cache_salt": f"{salt}-warm-up",
    }
    for url in urls:
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).raise_for_status()


def summary(report: dict[str, Any], cold_ms: float) -> dict[str, Any]:
    """The client's figures of one run; TTFT p99 also in cold prefills (comparable across sizes)."""
    ttft, itl = report["ttft_ms"] or {}, report["itl_ms"] or {}
    return {
        "hit_rate": report["prefix_cache_hit_rate"],
        "ttft_p50_ms": ttft.get("p50"),
        "ttft_p99_ms": ttft.get("p99"),
        "ttft_p99_cold_prefills": round(ttft["p99"] / cold_ms, 3) if ttft else None,
        "itl_p99_ms": itl.get("p99"),
        "output_tok_s": report["output_token_throughput"],
        "num_completed": report["num_completed"],
        "num_rejected": report["num_errors"],
        "errors": report["errors"],
        "duration_s": report["duration_s"],
    }


@contextlib.contextmanager
def router_urls(router: Router, fleet: Fleet, args: argparse.Namespace, log_dir: Path) -> Iterator[list[str]]:
    """A fresh router process over the fleet: herd's orchestrator or a peer; its URL(s)."""
    if router.kind == "herd":
        with herd_gateways(router.policy, fleet, args, log_dir) as urls:
            yield urls
        return
    log = log_dir / f"{router.kind}-{router.policy}.log"
    with peer_router(PEERS[router.kind], router.policy, fleet.public, log=log, timeout=120) as peer:
        yield [peer.url]


def cases_of(args: argparse.Namespace, out_dir: Path) -> list[Case]:
    """Per trace: the size sweep at ``--load`` and the load sweep at ``--sweep-size`` (a cross, not a grid)."""
    cases = []
    for kind in args.traces:
        for size in sorted({*args.sizes, args.sweep_size}):
            loads = {args.load} if size in args.sizes else set()
            loads |= set(args.loads) if size == args.sweep_size else set()
            if loads:
                cases.append(make_case(kind, size, tuple(sorted(loads)), args, out_dir))
    return cases


def run_case(
    case: Case, args: argparse.Namespace, log_dir: Path, record: Callable[[dict[str, Any]], None]
) -> None:
    """Every load of one trace on one fleet: the fleet once, routers alternating within each round."""
    with fleet(case, args, log_dir) as running:
        cells = [new_cell(case, running, load, args) for load in case.loads]
        for round_number in range(args.rounds):
            for router in rotated(args.routers, round_number):
                for cell, load in zip(cells, case.loads, strict=True):
                    salt = f"{case.kind}-{case.num_workers}-{load}-{router.name}-{round_number}"
                    row = run_one(router, running, case, load, args, log_dir, salt)
                    cell["routers"].setdefault(router.name, {"rounds": []})["rounds"].append(row)
                    record(cell)


def new_cell(case: Case, running: Fleet, load: float, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "trace": case.kind,
        "num_workers": case.num_workers,
        "load": load,
        "request_rate": round(load * args.capacity_rps, 3),
        "fleet_load": round(load * args.base_size / case.num_workers, 4),
        "poll_interval_s": round(poll_interval_s(running), 3),
        "trace_options": trace_options(case.kind, case.num_workers, args),
        "shape": asdict(case.shape),
        "dilation": round(running.dilation, 3),
        "blocks_per_worker": running.blocks_per_worker,
        "cold_prefill_ms": round(cold_prefill_ms(running.cost, case.shape), 1),
        "engine": running.engine,
        "oracle": oracle(case.trace, case.num_workers, running.blocks_per_worker, args.model),
        "routers": {},
    }


def rotated(items: Sequence[T], offset: int) -> list[T]:
    """Each round starts with the next one, so none always runs first."""
    offset %= len(items)
    return [*items[offset:], *items[:offset]]


def run_one(
    router: Router, fleet: Fleet, case: Case, load: float, args: argparse.Namespace, log_dir: Path, salt: str
) -> dict[str, Any]:
    """A fresh router, one replay; a failure is recorded in the row, and the matrix goes on."""
    started = time.monotonic()
    try:
        with router_urls(router, fleet, args, log_dir) as urls:
            row = measure(urls, fleet, case, load, args, salt)
    except (RuntimeError, httpx.HTTPError, OSError, AssertionError) as error:
        row = {"failed": f"{type(error).__name__}: {error}"}
    row.update(wall_s=round(time.monotonic() - started, 1), load_average=machine_info()["load_average"])
    print(f"{case.kind} {case.num_workers:>4} workers {load:.0%} {router.name:<26} {short(row)}", flush=True)
    return row


def short(row: dict[str, Any]) -> str:
    if "failed" in row:
        return f"FAILED {row['failed']}"
    return (
        f"hit {row['hit_rate']}  TTFT p99 {row['ttft_p99_ms']} ms  in-flight max/mean "
        f"{row['in_flight_max_over_mean']}  rejected {row['num_rejected']}  ({row['wall_s']} s)"
    )


def run_gateways(
    args: argparse.Namespace, out_dir: Path, log_dir: Path, record: Callable[[dict[str, Any]], None]
) -> None:
    """kv_cache_aware behind 1, 2 and 4 orchestrator replicas over one Redis, the client spreading
    requests round robin over them; counts alternate within each round."""
    from support.procs import redis_server

    case = make_case(args.gateway_trace, args.gateway_size, (args.load,), args, out_dir)
    with fleet(case, args, log_dir) as running, redis_server(log_dir) as redis_url:
        cell = {**new_cell(case, running, args.load, args), "gateways": {}}
        del cell["routers"]
        for round_number in range(args.rounds):
            for count in rotated(args.gateways, round_number):
                salt = f"gateways-{count}-{round_number}"
                row = run_replicas(count, running, case, args, log_dir, redis_url, salt)
                cell["gateways"].setdefault(str(count), {"rounds": []})["rounds"].append(row)
                record(cell)


def run_replicas(
    count: int, running: Fleet, case: Case, args: argparse.Namespace, log_dir: Path, redis_url: str, salt: str
) -> dict[str, Any]:
    started = time.monotonic()
    try:
        with herd_gateways(
            "kv_cache_aware", running, args, log_dir, count=count, redis_url=redis_url
        ) as urls:
            row = measure(urls, running, case, args.load, args, salt)
    except (RuntimeError, httpx.HTTPError, OSError, AssertionError) as error:
        row = {"failed": f"{type(error).__name__}: {error}"}
    row.update(wall_s=round(time.monotonic() - started, 1), load_average=machine_info()["load_average"])
    print(f"{case.kind} {case.num_workers:>4} workers, {count} gateway(s): {short(row)}", flush=True)
    return row


AIPERF = ("aiperf", "0.13.0")


def run_harnesses(
    args: argparse.Namespace, out_dir: Path, log_dir: Path, record: Callable[[dict[str, Any]], None]
) -> None:
    """The same trace through herd's kv_cache_aware, replayed by ``herd bench`` and by ``aiperf``
    (its own venv) at the same rate, alternating over the rounds."""
    case = make_case(args.harness_trace, args.harness_size, (args.load,), args, out_dir)
    with fleet(case, args, log_dir) as running:
        cell = {**new_cell(case, running, args.load, args), "harnesses": {}}
        del cell["routers"]
        for round_number in range(args.rounds):
            for harness in rotated(["herd bench", "aiperf"], round_number):
                salt = f"harness-{harness}-{round_number}"
                row = run_harness(harness, running, case, args, out_dir, salt)
                cell["harnesses"].setdefault(harness, {"rounds": []})["rounds"].append(row)
                record(cell)


def run_harness(
    harness: str, running: Fleet, case: Case, args: argparse.Namespace, out_dir: Path, salt: str
) -> dict[str, Any]:
    started = time.monotonic()
    try:
        with herd_gateways("kv_cache_aware", running, args, out_dir) as urls:
            if harness == "herd bench":
                row = measure(urls, running, case, args.load, args, salt)
            else:
                row = measure_aiperf(urls[0], running, case, args, out_dir / f"aiperf-{salt}", salt)
    except (RuntimeError, httpx.HTTPError, OSError, AssertionError, subprocess.TimeoutExpired) as error:
        row = {"failed": f"{type(error).__name__}: {error}"}
    row.update(wall_s=round(time.monotonic() - started, 1), load_average=machine_info()["load_average"])
    print(f"{case.kind} {case.num_workers:>4} workers, {harness:<10} {short(row)}", flush=True)
    return row


def aiperf_trace(case: Case, rate: float, path: Path) -> Path:
    """The trace as aiperf's ``mooncake_trace`` takes it: each line's ``messages`` sent as they are
    (the history included), arrival times scaled to ``rate`` a second; one conversation a line so
    aiperf adds no history of its own."""
    lines = [json.loads(line) for line in case.trace.read_text().splitlines() if line.strip()]
    scale = (len(lines) - 1) / rate * 1000 / max(lines[-1]["timestamp"], 1)
    with path.open("w") as out:
        for line in lines:
            entry = {"timestamp": round(line["timestamp"] * scale), "messages": line["messages"]}
            out.write(json.dumps({**entry, "output_length": line["output_length"]}) + "\n")
    return path


def measure_aiperf(
    url: str, fleet: Fleet, case: Case, args: argparse.Namespace, out: Path, salt: str
) -> dict[str, Any]:
    """One ``aiperf profile`` replay (fixed schedule, streaming chat) and its figures beside the workers'."""
    out.mkdir(parents=True, exist_ok=True)
    trace = aiperf_trace(case, args.load * args.capacity_rps, out / "trace.jsonl")
    python = Path.home() / ".cache" / "herd" / "venvs" / f"{AIPERF[0]}-{AIPERF[1]}" / "bin" / "python"
    argv = [str(python), "-m", "aiperf", "profile", "--model", SERVED_NAME, "--url", url]
    argv += ["--endpoint-type", "chat", "--streaming", "--input-file", str(trace)]
    argv += ["--custom-dataset-type", "mooncake_trace", "--fixed-schedule", "--tokenizer", str(args.model)]
    argv += [
        "--extra-inputs",
        "ignore_eos:true",
        "--extra-inputs",
        f"cache_salt:{salt}",
        "--artifact-dir",
        str(out),
    ]
    argv += ["--ui-type", "none"]
    before = worker_counters(fleet.public)
    started = time.monotonic()
    with (out / "aiperf.log").open("wb") as log:
        subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=600, check=True)
    seconds = time.monotonic() - started
    after = worker_counters(fleet.public)
    return {
        **aiperf_summary(out, fleet, case),
        **balance(before, after, seconds),
        "duration_s": round(seconds, 1),
    }


def aiperf_summary(out: Path, fleet: Fleet, case: Case) -> dict[str, Any]:
    """aiperf's own figures from its JSON export (its hit rate is the workers', see ``balance``)."""
    export = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())
    ttft, itl = export.get("time_to_first_token", {}), export.get("inter_token_latency", {})
    cold_ms = cold_prefill_ms(fleet.cost, case.shape)
    return {
        "hit_rate": None,
        "ttft_p50_ms": ttft.get("p50"),
        "ttft_p99_ms": ttft.get("p99"),
        "ttft_p99_cold_prefills": round(ttft["p99"] / cold_ms, 3) if "p99" in ttft else None,
        "itl_p99_ms": itl.get("p99"),
        "output_tok_s": export.get("output_token_throughput", {}).get("avg"),
        "num_completed": export.get("request_count", {}).get("avg"),
        "num_rejected": export.get("error_request_count", {}).get("avg", 0),
    }


OVERHEAD_BODY = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def run_overhead(args: argparse.Namespace, out_dir: Path, log_dir: Path) -> dict[str, Any]:
    """Each router's added latency per request: one simulated worker whose steps cost nothing, the
    same client sending the same small chat request to the worker directly and through the router,
    interleaved, routers alternating over the rounds."""
    case = make_case("shared-prefix", 1, (1.0,), args, out_dir)
    results: dict[str, Any] = {}
    with fleet(case, args, log_dir, cost=dict.fromkeys(UNIT_COST, 0.0)) as running:
        for round_number in range(args.rounds):
            for router in rotated(args.overhead_routers, round_number):
                with router_urls(router, running, args, log_dir) as urls:
                    row = added_latency(running.public[0], urls[0], args.overhead)
                results.setdefault(router.name, {"rounds": []})["rounds"].append(row)
                print(
                    f"overhead {router.name:<26} added p50 {row['added_p50_ms']} ms, p99 {row['added_p99_ms']} ms"
                )
    for entry in results.values():
        for key in ("added_p50_ms", "added_p99_ms", "direct_p50_ms", "router_p50_ms"):
            entry[key] = statistics.median(row[key] for row in entry["rounds"])
    return results


def added_latency(worker: str, router: str, num_requests: int) -> dict[str, float]:
    """Non-streaming round trips, direct and through the router in turn, after a warm-up."""
    direct, routed = [], []
    with httpx.Client(timeout=30) as client:
        for number in range(num_requests + 20):
            pair = [round_trip(client, worker), round_trip(client, router)]
            if number >= 20:
                direct.append(pair[0])
                routed.append(pair[1])
    added = [through - alone for alone, through in zip(direct, routed, strict=True)]
    return {
        "direct_p50_ms": round(1000 * percentile(direct, 50), 3),
        "router_p50_ms": round(1000 * percentile(routed, 50), 3),
        "added_p50_ms": round(1000 * percentile(added, 50), 3),
        "added_p99_ms": round(1000 * percentile(added, 99), 3),
    }


def round_trip(client: httpx.Client, url: str) -> float:
    started = time.perf_counter()
    client.post(f"{url}/v1/chat/completions", json=OVERHEAD_BODY).raise_for_status()
    return time.perf_counter() - started


PEER_ROUTERS = tuple(f"{name}:{policy}" for name, peer in PEERS.items() for policy in peer.policies)
# Each router's cheapest policy, for the added latency per request.
OVERHEAD_ROUTERS = (
    "herd:round_robin",
    "sglang-router:round_robin",
    "smg:prefix_hash",
    "vllm-router:consistent_hash",
)


def numbers(kind: Callable[[str], T]) -> Callable[[str], list[T]]:
    """A comma-separated list of ``kind``; an empty string is an empty list."""

    def parse(text: str) -> list[T]:
        try:
            return [kind(item) for item in text.split(",") if item.strip()]
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", type=Path, default=DEMO_MODEL, help="tokenizer and chat template of the simulated workers")
    add("--traces", type=numbers(str), default=["shared-prefix"], help=f"kinds: {', '.join(TRACE_OPTIONS)}")
    add(
        "--sizes",
        type=numbers(int),
        default=[8, 32, 128, 256],
        help="fleet sizes of the size sweep ('' for none)",
    )
    add("--load", type=float, default=80, help="load of the size sweep, percent of capacity")
    add("--sweep-size", type=int, default=8, help="fleet size of the load sweep")
    add("--loads", type=numbers(float), default=[50, 80, 100, 120], help="loads of the load sweep, percent")
    add(
        "--routers",
        type=numbers(Router.parse),
        default=None,
        help="KIND:POLICY, comma-separated (default: herd's six strategies and every peer policy)",
    )
    add("--rounds", type=int, default=3)
    add(
        "--capacity-rps",
        type=float,
        default=24.0,
        help="the capacity of a fleet of --base-size workers, requests a second (see above)",
    )
    add("--base-size", type=int, default=8, help="the fleet size --capacity-rps and the loads refer to")
    add("--batch", type=int, default=2, help="maxBatchSize of a worker")
    add("--max-queue", type=int, default=32, help="maxQueueLen of a worker (more waiting: 429)")
    add(
        "--cache-share",
        type=float,
        default=0.25,
        help="share of the trace's working set one worker's pool holds",
    )
    add(
        "--gateways", type=numbers(int), default=[], help="orchestrator replica counts over Redis, e.g. 1,2,4"
    )
    add("--gateway-trace", default="shared-prefix")
    add("--gateway-size", type=int, default=32)
    add(
        "--overhead",
        type=int,
        default=0,
        help="requests per router for the added-latency comparison (0: skip)",
    )
    add(
        "--overhead-routers",
        type=numbers(Router.parse),
        default=[Router.parse(name) for name in OVERHEAD_ROUTERS],
        help="routers of the added-latency comparison (each in its cheapest policy)",
    )
    add(
        "--harnesses",
        action="store_true",
        help="also replay one trace by herd bench and by aiperf, side by side",
    )
    add("--harness-trace", default="shared-prefix")
    add("--harness-size", type=int, default=8)
    add(
        "--fixed-traces",
        action="store_true",
        help="replay the same trace at every size (before traces grew with the fleet; see TRACE_OPTIONS)",
    )
    add("--seed", type=int, default=0)
    add("--request-timeout", type=float, default=300.0)
    add(
        "--quick",
        action="store_true",
        help="smoke run: 8 workers, 80 %%, 1 round (round_robin and kv_cache_aware unless --routers)",
    )
    add("--out", type=Path, default=REPO / "bench" / "results" / "routing_scale.json")
    add("--plots-dir", type=Path, default=None, help="write the PNG plots here (needs matplotlib)")
    add(
        "--replot",
        type=Path,
        nargs="+",
        default=None,
        help="only print the tables and targets and draw the plots of these results files (writes no JSON)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.sweep_size, args.loads, args.rounds = [8], 8, [80.0], 1
    quick_routers = ("herd:round_robin", "herd:kv_cache_aware")
    every_router = [f"herd:{name}" for name in HERD_STRATEGIES] + list(PEER_ROUTERS)
    if args.routers is None:
        args.routers = [Router.parse(name) for name in (quick_routers if args.quick else every_router)]
    args.load, args.loads = args.load / 100, [load / 100 for load in args.loads]
    return args


def plain(value: Any) -> Any:
    """A setting as JSON holds it: paths as text, routers by name."""
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value.name if isinstance(value, Router) else str(value) if isinstance(value, Path) else value


def recorder(document: dict[str, Any], path: Path) -> Callable[[dict[str, Any]], None]:
    """Keeps the results file current after every run, so a matrix cut short keeps what it measured."""

    def record(cell: dict[str, Any]) -> None:
        if not any(known is cell for known in document["cells"]):
            document["cells"].append(cell)
        summarize_cell(cell)
        document["machine_end"] = machine_info()
        write_json(path, document)

    return record


def finish(document: dict[str, Any], args: argparse.Namespace) -> None:
    """Targets, tables and plots from the results."""
    for cell in document["cells"]:
        summarize_cell(cell)
    document["targets"] = targets(document["cells"], args.load)
    for cell in document["cells"]:
        print(cell_table(cell) + "\n")
    if "overhead" in document:
        print(overhead_table(document["overhead"]) + "\n")
    for check in document["targets"]:
        print(
            f"{'met   ' if check['met'] else 'MISSED'} {check['target']}: {check['where']}: {check['value']}"
        )
    if args.plots_dir:
        for path in plot(document, args.plots_dir):
            print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        documents = [json.loads(path.read_text()) for path in args.replot]
        merged = {key: value for doc in reversed(documents) for key, value in doc.items()}
        merged["cells"] = [cell for doc in documents for cell in doc["cells"]]
        finish(merged, args)
        return 0
    out_dir = Path(tempfile.mkdtemp(prefix="herd-routing-scale-"))
    settings = {key: plain(value) for key, value in vars(args).items()}
    document: dict[str, Any] = {
        "benchmark": "routing_scale",
        "command": shlex.join(
            ["python", "bench/routing_scale.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": machine_info(),
        "settings": settings,
        "unit_cost_model": UNIT_COST,
        "trace_options": {
            f"{kind}@{size}": trace_options(kind, size, args)
            for kind in args.traces
            for size in sorted({*args.sizes, args.sweep_size})
        },
        "cells": [],
    }
    record = recorder(document, args.out)
    for case in cases_of(args, out_dir):
        run_case(case, args, out_dir, record)
    if args.gateways:
        run_gateways(args, out_dir, out_dir, record)
    if args.harnesses:
        run_harnesses(args, out_dir, out_dir, record)
    if args.overhead:
        document["overhead"] = run_overhead(args, out_dir, out_dir)
    finish(document, args)
    document["machine_end"] = machine_info()
    write_json(args.out, document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
