"""Issue 3: output tokens/s of the herd worker against ``transformers serve --continuous-batching``.

Both servers serve the same checkpoint (SmolLM2-135M-Instruct, fp32, CPU) and are driven by the
same HTTP client, herd's load generator (``herd.cli.loadgen``, what ``herd bench`` runs): 16
requests kept in flight, chat prompts of 128-512 random common words (about one token each),
``max_tokens`` drawn from 64-256, a fixed seed, so both servers get the identical request sequence.

Fairness:
- One server at a time (never both on the shared cores), each started fresh, warmed up with two
  short requests on other prompts, then measured; then stopped by pid.
- The same engine budget: the peer's paged cache gets as many 16-token blocks as herd's KV pool
  holds, and the same per-step token budget (``--cb-max-batch-tokens`` = ``maxBatchTokens``).
- The same torch/OpenMP thread count for both (``--threads``).
- ``transformers serve`` rejects unknown fields (422), so no ``ignore_eos`` / ``min_tokens`` is sent
  to either server; both decode greedily (``temperature: 0``) from the same weights, so they stop at
  about the same places. Throughput counts the completion tokens each server reports in ``usage``.
- herd's prefix cache stays on (its default): the chat template's default system prompt is shared
  by every request, which the report shows as the prefix-cache hit rate.

    .venv/bin/python bench/worker_serving.py                  # writes bench/results/worker_serving.json
    .venv/bin/python bench/worker_serving.py --num-requests 4 --output-len 8:16 --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import secrets
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    BYTES_PER_TOKEN,
    DEMO_MODEL,
    HOST,
    REPO,
    Launch,
    free_port,
    herd_worker_argv,
    machine_info,
    run_load,
    serving,
    summary_row,
    thread_env,
    write_json,
)

from herd.cli.loadgen import BenchConfig

__all__ = ["main"]

TARGET_RATIO = 2.0
BLOCK_SIZE = 16
SERVED_NAME = "smollm2"


@dataclass(frozen=True, slots=True)
class Server:
    """How to start one server and what to call it over HTTP."""

    name: str
    argv: list[str]
    url: str
    ready_path: str
    model: str
    env: dict[str, str]
    token: str = ""  # the internal token, kept out of the results
    launch: Launch | None = None  # how to start and stop it (default: by its pid)

    @property
    def printable_argv(self) -> str:
        """The command line without the internal token."""
        return shlex.join([a.replace(self.token, "<token>") for a in self.argv] if self.token else self.argv)


def num_kv_blocks(args: argparse.Namespace) -> int:
    """The blocks herd's KV pool gets from ``--kv-memory-gib`` (the peer gets as many)."""
    return int(args.kv_memory_gib * 2**30) // (BYTES_PER_TOKEN * BLOCK_SIZE)


def herd_server(args: argparse.Namespace) -> Server:
    port = free_port()
    engine = {
        "dtype": "float32",
        "device": "cpu",
        "maxModelLen": 2048,
        "maxBatchSize": args.concurrency * 2,
        "maxBatchTokens": args.max_batch_tokens,
        "kvCache": {"blockSize": BLOCK_SIZE, "memoryGiB": args.kv_memory_gib, "prefixCaching": True},
    }
    token = secrets.token_urlsafe(16)
    argv = herd_worker_argv(
        args.model, name=SERVED_NAME, port=port, internal_port=free_port(), token=token, engine=engine
    )
    url = f"http://{HOST}:{port}"
    return Server("herd", argv, url, "/ready", SERVED_NAME, thread_env(args.threads), token=token)


def transformers_server(args: argparse.Namespace) -> Server:
    port = free_port()
    argv = [
        str(Path(sys.executable).with_name("transformers")),
        "serve",
        "--continuous-batching",
        "--cb-block-size",
        str(BLOCK_SIZE),
        "--cb-num-blocks",
        str(num_kv_blocks(args)),
        "--cb-max-batch-tokens",
        str(args.max_batch_tokens),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--host",
        HOST,
        "--port",
        str(port),
        *(["--attn-implementation", args.peer_attn] if args.peer_attn else []),
        str(args.model),
    ]
    # Offline: the hub cache must exist and be writable even though the model is a local folder.
    hf_home = Path(tempfile.mkdtemp(prefix="herd-bench-hf-"))
    (hf_home / "hub").mkdir()
    env = {**thread_env(args.threads), "HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home)}
    return Server("transformers", argv, f"http://{HOST}:{port}", "/health", str(args.model), env)


SERVERS: dict[str, Callable[[argparse.Namespace], Server]] = {
    "herd": herd_server,
    "transformers": transformers_server,
}


def load_config(server: Server, args: argparse.Namespace, *, is_warmup: bool) -> BenchConfig:
    """The same requests for every server; the warm-up uses other, shorter prompts."""
    return BenchConfig(
        url=server.url,
        model=server.model,
        workload="synthetic",
        input_len="64" if is_warmup else args.input_len,
        output_len="8" if is_warmup else args.output_len,
        concurrency=2 if is_warmup else args.concurrency,
        num_requests=2 if is_warmup else args.num_requests,
        duration_s=None if is_warmup else args.max_seconds,
        ignore_eos=False,
        extra_body={"temperature": 0.0},
        timeout_s=args.request_timeout,
        seed=args.seed + 1 if is_warmup else args.seed,
    )


def measure(server: Server, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    log = log_dir / f"{server.name}.log"
    started = time.monotonic()
    with serving(
        server.argv, ready_url=server.url + server.ready_path, log=log, env=server.env, launch=server.launch
    ):
        startup_s = time.monotonic() - started
        run_load(load_config(server, args, is_warmup=True))
        load_before = machine_info()["load_average"]
        report = run_load(load_config(server, args, is_warmup=False))
    print(f"{server.name}: {report['output_token_throughput']:.1f} output tok/s; log {log}", flush=True)
    return {
        **summary_row(report),
        "startup_s": round(startup_s, 1),
        "load_average_before": load_before,
        "load_average_after": machine_info()["load_average"],
        "argv": server.printable_argv,
    }


def verdict(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if not {"herd", "transformers"} <= results.keys():
        return {}
    peer = results["transformers"]["output_token_throughput"]
    ratio = results["herd"]["output_token_throughput"] / peer if peer else None
    return {
        "ratio_herd_over_transformers_serve": round(ratio, 3) if ratio is not None else None,
        "target_ratio": TARGET_RATIO,
        "target_met": ratio is not None and ratio >= TARGET_RATIO,
    }


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| server | output tok/s | completion tokens | requests ok | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in results.items():
        ttft, itl = row["ttft_ms"] or {}, row["itl_ms"] or {}
        lines.append(
            f"| {name} | {row['output_token_throughput']:.1f} | {row['total_output_tokens']} | "
            f"{row['num_completed']} | {ttft.get('p50', 0):.0f} / {ttft.get('p99', 0):.0f} | "
            f"{itl.get('p50', 0):.0f} / {itl.get('p99', 0):.0f} |"
        )
    return "\n".join(lines)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """What the server builders (``herd_server``, ``transformers_server``) read, besides ``concurrency``."""
    parser.add_argument("--model", type=Path, default=DEMO_MODEL, help="HF-format checkpoint folder")
    parser.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads of each server")
    parser.add_argument(
        "--kv-memory-gib", type=float, default=1.0, help="herd's KV pool (the peers: as many bytes)"
    )
    parser.add_argument("--max-batch-tokens", type=int, default=1024, help="per-step token budget of all")
    parser.add_argument("--peer-attn", default=None, help="--attn-implementation for transformers serve")
    parser.add_argument("--request-timeout", type=float, default=600.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_arguments(parser)
    parser.add_argument("--servers", default="herd,transformers", help="comma-separated, run in this order")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=32, help="measured requests per server")
    parser.add_argument("--input-len", default="128:512", help="prompt words: N or LOW:HIGH")
    parser.add_argument("--output-len", default="64:256", help="max_tokens: N or LOW:HIGH")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=420.0, help="stop sending after this per server")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "worker_serving.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [name.strip() for name in args.servers.split(",") if name.strip()]
    if unknown := set(names) - SERVERS.keys():
        print(f"--servers: unknown {sorted(unknown)}; choose from {sorted(SERVERS)}", file=sys.stderr)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="herd-bench-serving-"))
    machine = machine_info()
    results = {name: measure(SERVERS[name](args), args, log_dir) for name in names}
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    document = {
        "benchmark": "worker_serving",
        "command": shlex.join(
            ["python", "bench/worker_serving.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": machine,
        "settings": {**settings, "num_kv_blocks": num_kv_blocks(args), "block_size": BLOCK_SIZE},
        "servers": results,
        **verdict(results),
    }
    write_json(args.out, document)
    print(markdown_table(results))
    print(
        {
            key: document[key]
            for key in ("ratio_herd_over_transformers_serve", "target_met")
            if key in document
        }
    )
    return 0 if all(row["num_completed"] for row in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
