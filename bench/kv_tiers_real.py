"""Issue 20's tier benchmark on 4 real workers: no tier, a host tier, host and disk, host with peer
pulls, and routing by restore cost against tier-blind routing and fixed weights, side by side.

Four ``herd worker`` processes of SmolLM2-135M-Instruct (fp32, CPU, one torch thread each) behind one
``herd orchestrator`` routing with kv_cache_aware; each worker's device KV pool is ``--pool-blocks``
blocks, so the trace's working set is ``--working-sets`` x the fleet's device pool. Every run starts
fresh workers and a fresh orchestrator (no tier's contents carry over), sends one short request to
each worker to load its kernels, then replays the trace through ``herd bench``'s load generator
(``herd.cli.loadgen``, the ``trace`` workload) as a closed loop of ``--concurrency`` requests in
flight; a multi-turn session's next turn waits for its previous answer.

Traces (``herd bench trace`` kinds, generated from the round's seed, the same for every setup of a
round): ``tenants`` (multi-tenant: shared-prefix, system prompts of ``--prefix-words`` words, short
questions) and ``turns`` (multi-turn: sessions of ``--turns`` turns resending their history). The
number of tenants or sessions is chosen so that the trace's distinct 16-word blocks (its
``hash_ids``, about one token a word) are the working-set multiple of the fleet's device blocks; the
result records the exact ratio.

What differs between setups is only the tiers and the routing spec:

* ``none``: no tier below the device pool; kv_cache_aware, tierCost measured;
* ``host``: ``hostMemoryGiB`` holding a worker's share of the working set (``--host-share``), measured;
* ``host+disk``: a host tier of a quarter of that and a disk tier of the whole (a fresh folder);
* ``host+pulls``: ``host`` with ``peerPulls: true``;
* ``host, tier-blind`` and ``host, weights 1.0/0.8``: ``host``'s tiers with tierCost device / weights.

Each round runs every cell (trace and working set) in turn and, in each, the setups in turn, forward
in even rounds and reversed in odd ones (the results are rewritten after every run); each figure is the median over
the rounds with its range. Hit rate is the load generator's (usage ``cached_tokens`` over prompt
tokens); the workers' metrics give the blocks restored per tier and the peer pulls.

    nice -n 19 .venv/bin/python bench/kv_tiers_real.py --out bench/results/kv_tiers_real.json
    nice -n 19 .venv/bin/python bench/kv_tiers_real.py --rounds 1 --requests 16 \\
        --setups none host --traces tenants --out /tmp/smoke.json

``--resume PATH`` continues a run that was cut: it keeps ``PATH``'s complete rounds (every cell and
setup of this run's settings measured) and runs the rounds after them, up to ``--rounds`` in all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from _common import (
    BYTES_PER_TOKEN,
    DEMO_MODEL,
    HOST,
    REPO,
    demo_manifest,
    free_port,
    herd_worker_argv,
    machine_info,
    orchestrator_argv,
    run_load,
    serving,
    summary_row,
    thread_env,
    write_report,
)
from kv_tiers import Setup
from prometheus_client.parser import text_string_to_metric_families
from support.procs import running, wait_until

from herd.api import metrics
from herd.cli.loadgen import BenchConfig
from herd.cli.loadgen.traces import MultiTurnTrace, SharedPrefixTrace, dump_trace, generate
from herd.cli.up import free_port_block

NAME = "smollm2"
BLOCK_SIZE = 16
BLOCK_BYTES = BYTES_PER_TOKEN * BLOCK_SIZE
NUM_WORKERS = 4


SETUPS = {
    setup.name: setup
    for setup in (
        Setup("none", 0.0, 0.0, "measured"),
        Setup("host", 1.0, 0.0, "measured"),
        Setup("host+disk", 0.25, 1.0, "measured"),
        Setup("host+pulls", 1.0, 0.0, "measured", peer_pulls=True),
        Setup("host, tier-blind", 1.0, 0.0, "device"),
        Setup("host, weights 1.0/0.8", 1.0, 0.0, "weights"),
    )
}


def engine_block(
    args: argparse.Namespace, setup: Setup, working_set_blocks: int, disk_dir: Path
) -> dict[str, Any]:
    """Exactly ``--pool-blocks`` device blocks (half a block of slack for rounding); the tiers sized as
    shares of a worker's part of the working set."""
    share_bytes = working_set_blocks / NUM_WORKERS * BLOCK_BYTES
    kv_cache: dict[str, Any] = {
        "blockSize": BLOCK_SIZE,
        "memoryGiB": round((args.pool_blocks + 0.5) * BLOCK_BYTES / 2**30, 6),
    }
    if setup.host_share:
        kv_cache["hostMemoryGiB"] = round(setup.host_share * args.host_share * share_bytes / 2**30, 6)
    if setup.disk_share:
        size = setup.disk_share * args.host_share * share_bytes / 2**30
        kv_cache["disk"] = {"path": str(disk_dir), "sizeGiB": round(size, 6)}
    return {"device": "cpu", "dtype": "float32", "maxModelLen": 2048, "kvCache": kv_cache}


def manifest(setup: Setup, engine: dict[str, Any]) -> dict[str, Any]:
    routing = {"strategy": "kv_cache_aware", "tierCost": setup.tier_cost, "peerPulls": setup.peer_pulls}
    return demo_manifest(NAME, engine, replicas=NUM_WORKERS, routing=routing)


def make_trace(args: argparse.Namespace, trace: str, working_set: float, seed: int) -> tuple[Path, int, int]:
    """The round's trace file, its streams (tenants or sessions) and its working set in blocks (the
    distinct 16-word blocks at least two of its requests share): streams chosen so that the working
    set comes closest to ``working_set`` x the fleet's device blocks. A multi-tenant trace has
    ``--requests`` requests; a multi-turn one every turn of its sessions."""
    target = working_set * NUM_WORKERS * args.pool_blocks

    def build(streams: int) -> list[Any]:
        if trace == "tenants":
            spec: Any = SharedPrefixTrace(
                num_groups=streams,
                prompts_per_group=math.ceil(args.requests / streams),
                system_prompt_len=args.prefix_words,
                question_len=args.question_words,
                output_len=args.output_tokens,
            )
            return generate(spec, seed)[: args.requests]
        spec = MultiTurnTrace(
            num_sessions=streams,
            num_turns=args.turns,
            user_len=str(args.user_words),
            output_len=str(args.output_tokens),
        )
        return generate(spec, seed)

    def shared(requests: list[Any]) -> int:
        uses = Counter(block for request in requests for block in set(request.hash_ids))
        return sum(1 for count in uses.values() if count > 1)

    sizes = {1: shared(build(1))}
    streams = 1
    while streams < 1000 and sizes[streams] < target:
        streams += 1
        sizes[streams] = shared(build(streams))
    if streams > 1 and target - sizes[streams - 1] < sizes[streams] - target:
        streams -= 1
    requests = build(streams)
    path = Path(tempfile.mkdtemp(prefix="herd-kv-tiers-real-")) / f"{trace}-{working_set}-{seed}.jsonl"
    dump_trace(requests, path)
    return path, streams, sizes[streams]


@contextlib.contextmanager
def fleet(engine: dict[str, Any], token: str, log_dir: Path, threads: int) -> Iterator[list[tuple[str, str]]]:
    """Four ``herd worker`` processes, started together, once all answer ``/ready``; each (public,
    internal) URL. Stopped by pid on exit."""
    with contextlib.ExitStack() as stack:
        urls, processes = [], []
        for number in range(NUM_WORKERS):
            port, internal = free_port_block(2)
            argv = herd_worker_argv(
                DEMO_MODEL, name=NAME, port=port, internal_port=internal, token=token, engine=engine
            )
            log = log_dir / f"worker-{number}.log"
            processes.append(stack.enter_context(running(argv, log=log, env=thread_env(threads), grace=20.0)))
            urls.append((f"http://{HOST}:{port}", f"http://{HOST}:{internal}"))
        for process, (url, _) in zip(processes, urls, strict=True):

            def is_ready(process: Any = process, url: str = url) -> bool:
                assert process.poll() is None, f"worker {url} exited; see {log_dir}"
                return httpx.get(f"{url}/ready", timeout=2.0).status_code == httpx.codes.OK

            wait_until(is_ready, timeout=300, interval=0.5, what=f"{url}/ready")
        yield urls


def warm(urls: list[tuple[str, str]]) -> None:
    """One short request per worker, so the first measured ones do not load kernels."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hello."}], "max_tokens": 2}
    with httpx.Client(timeout=120) as client:
        for url, _ in urls:
            client.post(f"{url}/v1/chat/completions", json=body).raise_for_status()


def worker_counters(urls: list[tuple[str, str]]) -> dict[str, float]:
    """Over the fleet: blocks restored per tier, peer pulls per outcome, and the leases the holders
    gave by whether they held any and why their run ended."""
    totals: dict[str, float] = {}
    for url, _ in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).raise_for_status().text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == metrics.HERD_KV_TIER_RESTORED_TOTAL:
                    key = f"restored_{sample.labels.get('medium', '?')}"
                elif sample.name == metrics.HERD_KV_PEER_PULLS_TOTAL:
                    key = f"pulls_{sample.labels.get('outcome', '?')}"
                elif sample.name == metrics.HERD_KV_LEASES_TOTAL:
                    key = f"leases_{sample.labels.get('held', '?')}_{sample.labels.get('end', '?')}"
                else:
                    continue
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def measure(
    args: argparse.Namespace, setup: Setup, trace: Path, working_set_blocks: int, log_dir: Path
) -> dict[str, Any]:
    """One run: fresh workers with ``setup``'s tiers, a fresh orchestrator with its routing, the trace."""
    token = secrets.token_urlsafe(16)
    with tempfile.TemporaryDirectory(prefix="herd-kv-disk-") as disk_dir:
        engine = engine_block(args, setup, working_set_blocks, Path(disk_dir))
        log_dir.mkdir(parents=True, exist_ok=True)
        manifest_path = log_dir / "manifest.json"
        manifest_path.write_text(json.dumps(manifest(setup, engine)))
        started = time.perf_counter()
        with fleet(engine, token, log_dir, args.threads) as urls:
            warm(urls)
            startup = time.perf_counter() - started
            port = free_port()
            endpoints = [f"{public},{internal}" for public, internal in urls]
            argv = orchestrator_argv(manifest_path, endpoints, token=token, port=port)
            url = f"http://{HOST}:{port}"
            with serving(argv, ready_url=f"{url}/ready", log=log_dir / "orchestrator.log", env={}):
                time.sleep(3.0)  # /ready needs one healthy worker; a few health polls admit the rest
                config = BenchConfig(
                    url=url,
                    model=NAME,
                    workload="trace",
                    trace=trace,
                    concurrency=args.concurrency,
                    num_requests=len(trace.read_text().splitlines()),
                    timeout_s=args.request_timeout,
                )
                started = time.perf_counter()
                report = run_load(config)
                seconds = time.perf_counter() - started
            counters = worker_counters(urls)
    row = summary_row(report)
    return {
        "hit_rate": row["prefix_cache_hit_rate"],
        "ttft_p50_ms": row["ttft_ms"]["p50"] if row["ttft_ms"] else None,
        "ttft_p99_ms": row["ttft_ms"]["p99"] if row["ttft_ms"] else None,
        "output_tokens_per_s": row["output_token_throughput"],
        "num_completed": row["num_completed"],
        "num_errors": row["num_errors"],
        "wall_s": round(seconds, 1),
        "startup_s": round(startup, 1),
        **counters,
        "engine": engine,
        "load_average_after": machine_info()["load_average"],
        "full": row,
    }


FIGURES = ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "output_tokens_per_s")


def table(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per setup, each figure's median over the rounds and its range."""
    names = list(dict.fromkeys(run["setup"] for run in runs))
    result: dict[str, dict[str, dict[str, float]]] = {}
    for name in names:
        rows = [run for run in runs if run["setup"] == name]
        keys = [
            *FIGURES,
            *sorted({k for r in rows for k in r if k.startswith(("restored_", "pulls_", "leases_"))}),
        ]
        result[name] = {}
        for key in keys:
            values = [r.get(key) or 0.0 for r in rows]
            result[name][key] = {
                "median": round(statistics.median(values), 4),
                "min": round(min(values), 4),
                "max": round(max(values), 4),
            }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traces", nargs="+", default=["tenants", "turns"], choices=["tenants", "turns"])
    parser.add_argument("--working-sets", type=float, nargs="+", default=[3.0, 1.5])
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument(
        "--setups-1-5",
        nargs="+",
        default=["none", "host", "host+disk", "host+pulls"],
        choices=list(SETUPS),
        help="the setups at working sets below 2x (the routing trio runs at the larger ones)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pool-blocks", type=int, default=16, help="each worker's device pool")
    parser.add_argument("--host-share", type=float, default=1.0, help="host tier / a worker's share")
    parser.add_argument("--requests", type=int, default=64, help="requests per run")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (whole fleet)")
    parser.add_argument("--prefix-words", type=int, default=112, help="tenants: system prompt words")
    parser.add_argument("--question-words", type=int, default=16, help="tenants: question words")
    parser.add_argument("--turns", type=int, default=3, help="turns: turns per session")
    parser.add_argument("--user-words", type=int, default=64, help="turns: words per user turn")
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--log-dir", default="/tmp/herd-kv-tiers-real")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "kv_tiers_real.json")
    parser.add_argument("--resume", type=Path, help="an earlier run's JSON whose complete rounds to keep")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    cells = [(working_set, trace) for working_set in args.working_sets for trace in args.traces]
    wanted = {
        (working_set, trace, name)
        for working_set, trace in cells
        for name in (args.setups if working_set >= 2 else args.setups_1_5)
    }
    runs = [] if args.resume is None else complete_rounds(json.loads(args.resume.read_text())["runs"], wanted)
    shapes: dict[tuple[float, str], dict[str, Any]] = {}
    first = len({run["round"] for run in runs})
    for round_number in range(first, args.rounds):  # every cell in each round, so a cut run has all
        for working_set, trace in cells:
            setups = args.setups if working_set >= 2 else args.setups_1_5
            path, streams, blocks = make_trace(args, trace, working_set, round_number)
            shapes[working_set, trace] = {
                "streams": streams,
                "working_set_blocks": blocks,
                "working_set_measured": round(blocks / (NUM_WORKERS * args.pool_blocks), 2),
                "requests": len(path.read_text().splitlines()),
            }
            for name in setups if round_number % 2 == 0 else setups[::-1]:
                cell = f"{trace}-{working_set}-{round_number}-{name.replace(' ', '_')}"
                result = measure(args, SETUPS[name], path, blocks, Path(args.log_dir) / cell)
                run = {"trace": trace, "working_set": working_set, "round": round_number, "setup": name}
                runs.append(run | {"streams": streams, "working_set_blocks": blocks, **result})
                shown = {k: v for k, v in runs[-1].items() if k not in ("engine", "full")}
                print(json.dumps(shown), flush=True)
                report(args, shapes, runs)
    return 0


def complete_rounds(runs: list[dict[str, Any]], wanted: set[tuple[float, str, str]]) -> list[dict[str, Any]]:
    """The runs of the leading rounds (0, 1, ...) in which every ``(working set, trace, setup)`` of
    ``wanted`` was measured, the others dropped."""
    kept: list[dict[str, Any]] = []
    for round_number in range(len(runs)):  # a round has one run at least
        in_round = [run for run in runs if run["round"] == round_number]
        measured = {(run["working_set"], run["trace"], run["setup"]) for run in in_round}
        if not in_round or not wanted <= measured:
            break
        kept += [run for run in in_round if (run["working_set"], run["trace"], run["setup"]) in wanted]
    return kept


def report(
    args: argparse.Namespace, shapes: dict[tuple[float, str], dict[str, Any]], runs: list[dict[str, Any]]
) -> None:
    """The results so far (written after every run, so a run cut short keeps what it measured)."""
    cells = [
        {
            "trace": trace,
            "working_set": working_set,
            **shape,
            "rounds": len(
                {r["round"] for r in runs if (r["working_set"], r["trace"]) == (working_set, trace)}
            ),
            "setups": table([r for r in runs if (r["working_set"], r["trace"]) == (working_set, trace)]),
        }
        for (working_set, trace), shape in shapes.items()
    ]
    summary = {"cells": cells, "goals": goals(cells)}
    write_report(args, {"workers": NUM_WORKERS, "pool_blocks": args.pool_blocks}, runs, summary)


def goals(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals per cell: host over none (hit rate, TTFT p50) and the routing trio's p99."""
    out = []
    for cell in cells:
        setups = cell["setups"]
        row: dict[str, Any] = {"trace": cell["trace"], "working_set": cell["working_set"]}
        if "none" in setups and "host" in setups:
            none, host = setups["none"], setups["host"]
            row["hit_rate_x"] = round(host["hit_rate"]["median"] / max(none["hit_rate"]["median"], 1e-9), 2)
            row["ttft_p50_lower_x"] = round(none["ttft_p50_ms"]["median"] / host["ttft_p50_ms"]["median"], 2)
        trio = ("host", "host, weights 1.0/0.8", "host, tier-blind")
        if all(name in setups for name in trio):
            row["ttft_p99_ms"] = {name: setups[name]["ttft_p99_ms"]["median"] for name in trio}
        out.append(row)
    return out


if __name__ == "__main__":
    sys.exit(main())
