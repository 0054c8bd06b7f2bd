"""Issue 4: prefix-cache hit rate and TTFT of the six routing strategies, 2 real SmolLM2 workers.

Two ``herd worker`` processes serve SmolLM2-135M-Instruct (fp32, CPU) behind ``herd orchestrator``.
The workload is herd's shared-prefix multi-tenant one (``herd.cli.loadgen``, what ``herd bench``
runs): each tenant has a long system prompt that all its requests share, tenants drawn at random.
Each worker's KV pool is sized to hold about half of the tenants' prefixes (its number of blocks =
``--cache-share`` (0.5) x the tenants' full prefix blocks, plus room for the private blocks of the
requests it runs), so a worker that sees every tenant (round robin) keeps evicting prefixes, while
one that sees half of them keeps them all.

For each strategy the orchestrator restarts with that strategy; the same workload (same seed, so the
same tenant sequence, user turns and lengths) runs through it. Caches start cold for every strategy
without reloading the workers: each run's system prompts begin with that run's own tag ("Run 3.")
of the same token length, and block hashes chain from the first token, so no block of an earlier run
can be hit; the earlier runs' blocks are free and least recently used, so they are evicted first.
``--restart-workers`` restarts the workers instead (slower, the same in expectation). A warm-up of
``--warmup-requests`` on the same tenants (other user turns) fills the caches as the strategy routes,
so the measured requests show the steady-state hit rate rather than the first touch of each tenant.

Every request carries ``X-Session-ID: tenant-N`` (its tenant), which only sticky_session reads: a
tenant is a session, so sticky routing pins each tenant to one worker.

    .venv/bin/python bench/routing_strategies.py         # writes bench/results/routing_strategies.json
    .venv/bin/python bench/routing_strategies.py --num-requests 6 --strategies round_robin,prefix_hash \\
        --out /tmp/smoke.json
    .venv/bin/python bench/routing_strategies.py --strategies round_robin,kv_cache_aware --kv-load-weight 0 \
        --out bench/results/routing_strategies_kv_load_weight0.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import secrets
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import (
    BYTES_PER_TOKEN,
    DEMO_MODEL,
    HOST,
    REPO,
    free_port,
    herd_workers,
    machine_info,
    orchestrator_argv,
    run_load,
    serving,
    summary_row,
    write_json,
)

from herd.api.prompt import PromptRenderer
from herd.cli.loadgen import BenchConfig
from herd.cli.loadgen.workloads import LengthRange, RequestSpec, SharedPrefixWorkload

__all__ = ["main"]

STRATEGIES = ("round_robin", "least_request", "random", "prefix_hash", "sticky_session", "kv_cache_aware")
CACHE_AWARE = ("prefix_hash", "kv_cache_aware")
TARGET_HIT_RATIO = 2.0
BLOCK_SIZE = 16
SERVED_NAME = "smollm2"
SESSION_HEADER = "X-Session-ID"


class TaggedTenantWorkload(SharedPrefixWorkload):
    """The shared-prefix workload with every system prompt opened by ``tag`` (a cold cache per
    run), each request under its tenant's session id, and the request sequence (tenants, user
    turns, lengths) drawn from ``request_seed``, so a warm-up can use the same tenants."""

    def __init__(self, *, tag: str, session_header: str, request_seed: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.system_prompts = [f"{tag} {prompt}" for prompt in self.system_prompts]
        self.session_header = session_header
        self.rng = random.Random(request_seed)

    def next_request(self) -> RequestSpec:
        spec = super().next_request()
        spec.headers = {**spec.headers, self.session_header: f"tenant-{spec.tenant}"}
        return spec


class TaggedRunConfig(BenchConfig):
    """``BenchConfig`` whose workload is ``TaggedTenantWorkload``; the runner and client are herd's."""

    tag: str
    request_seed: int

    def build_workload(self) -> TaggedTenantWorkload:
        return TaggedTenantWorkload(
            tag=self.tag,
            session_header=self.session_header,
            request_seed=self.request_seed,
            num_tenants=self.num_tenants,
            prefix_len=self.prefix_len,
            input_len=LengthRange.parse(self.input_len),
            output_len=LengthRange.parse(self.output_len),
            seed=self.seed,
        )


def prefix_blocks_per_tenant(args: argparse.Namespace) -> int:
    """Full KV blocks of a tenant's system prompt as rendered by the chat template (the mean)."""
    renderer = PromptRenderer.from_pretrained(args.model)
    workload = run_config(args, url="http://unused", tag="Run 1.").build_workload()
    counts = [
        len(renderer.encode_chat([{"role": "system", "content": prompt}], add_generation_prompt=False))
        for prompt in workload.system_prompts
    ]
    return round(sum(counts) / len(counts)) // BLOCK_SIZE


def running_blocks(args: argparse.Namespace) -> int:
    """Room for the private blocks (user turn, template tail, output) of a worker's share of the
    requests in flight, so that the rest of the pool holds cached prefixes."""
    private_tokens = LengthRange.parse(args.input_len).high + LengthRange.parse(args.output_len).high
    per_request = math.ceil(private_tokens / BLOCK_SIZE) + 1
    return math.ceil(int(args.concurrency) / 2) * per_request


def engine_block(args: argparse.Namespace, num_blocks: int) -> dict[str, Any]:
    """The workers' engine: exactly ``num_blocks`` KV blocks (half a block of slack for rounding)."""
    memory_gib = (num_blocks + 0.5) * BYTES_PER_TOKEN * BLOCK_SIZE / 2**30
    return {
        "dtype": "float32",
        "device": "cpu",
        "maxModelLen": 2048,
        "maxBatchTokens": args.max_batch_tokens,
        "kvCache": {"blockSize": BLOCK_SIZE, "memoryGiB": round(memory_gib, 6), "prefixCaching": True},
    }


def manifest(args: argparse.Namespace, strategy: str, engine: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": SERVED_NAME},
        "spec": {
            "model": {"source": f"file://{args.model.resolve()}", "servedName": SERVED_NAME},
            "engine": engine,
            "workers": {"replicas": 2},
            "routing": routing(args, strategy),
        },
    }


def routing(args: argparse.Namespace, strategy: str) -> dict[str, Any]:
    """``spec.routing``: the strategy's defaults, except kv_cache_aware's ``loadWeight`` if given."""
    if strategy == "kv_cache_aware" and args.kv_load_weight is not None:
        return {"strategy": strategy, "loadWeight": args.kv_load_weight}
    return {"strategy": strategy}


def run_config(args: argparse.Namespace, *, url: str, tag: str, is_warmup: bool = False) -> TaggedRunConfig:
    return TaggedRunConfig(
        url=url,
        model=SERVED_NAME,
        workload="shared-prefix",
        num_tenants=args.num_tenants,
        prefix_len=args.prefix_len,
        input_len=args.input_len,
        output_len=args.output_len,
        session_header=SESSION_HEADER,
        concurrency=args.concurrency,
        num_requests=args.warmup_requests if is_warmup else args.num_requests,
        duration_s=None if is_warmup else args.max_seconds,
        timeout_s=args.request_timeout,
        seed=args.seed,
        tag=tag,
        request_seed=args.seed + 1 if is_warmup else args.seed,
    )


@contextlib.contextmanager
def workers(
    args: argparse.Namespace, engine: dict[str, Any], token: str, log_dir: Path
) -> Iterator[list[str]]:
    """Two ``herd worker`` processes, each ``URL,INTERNAL_URL`` as ``--worker`` takes it."""
    with contextlib.ExitStack() as stack:
        endpoints = []
        for number in range(2):
            log = log_dir / f"worker-{number}.log"
            worker = herd_workers(
                args.model, name=SERVED_NAME, token=token, engine=engine, log=log, threads=args.threads
            )
            endpoints += stack.enter_context(worker).endpoints
        yield endpoints


def measure(
    args: argparse.Namespace, strategy: str, endpoints: list[str], token: str, log_dir: Path, tag: str
) -> dict[str, Any]:
    """One strategy: a fresh orchestrator over the running workers, a warm-up on this run's tenants
    (other user turns), then the measured run."""
    engine = engine_block(args, args.num_kv_blocks)  # the orchestrator reads the block size from it
    manifest_path = log_dir / f"{strategy}.yaml"
    manifest_path.write_text(json.dumps(manifest(args, strategy, engine)))
    port = free_port()
    argv = orchestrator_argv(manifest_path, endpoints, token=token, port=port)
    url = f"http://{HOST}:{port}"
    with serving(argv, ready_url=f"{url}/ready", log=log_dir / f"orchestrator-{strategy}.log", env={}):
        time.sleep(2.0)  # /ready needs one healthy worker; a few health polls admit the second
        run_load(run_config(args, url=url, tag=tag, is_warmup=True))
        report = run_load(run_config(args, url=url, tag=tag))
    row = {**summary_row(report), "load_average_after": machine_info()["load_average"]}
    print(f"{strategy}: hit rate {row['prefix_cache_hit_rate']}, TTFT {row['ttft_ms']}", flush=True)
    return row


def run_all(args: argparse.Namespace, strategies: list[str], log_dir: Path) -> dict[str, dict[str, Any]]:
    token = secrets.token_urlsafe(16)
    engine = engine_block(args, args.num_kv_blocks)
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as shared:
        endpoints = (
            [] if args.restart_workers else shared.enter_context(workers(args, engine, token, log_dir))
        )
        for number, strategy in enumerate(strategies, start=1):
            with contextlib.ExitStack() as own:
                if args.restart_workers:
                    endpoints = own.enter_context(workers(args, engine, token, log_dir))
                results[strategy] = measure(args, strategy, endpoints, token, log_dir, tag=f"Run {number}.")
    return results


def verdict(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per cache-aware strategy: its hit rate over round robin's and whether TTFT p50 is lower."""
    base = results.get("round_robin")
    if base is None:
        return {}
    checks = {}
    for name in (name for name in CACHE_AWARE if name in results):
        row, base_hit = results[name], base["prefix_cache_hit_rate"] or 0.0
        ratio = (row["prefix_cache_hit_rate"] or 0.0) / base_hit if base_hit else None
        is_faster = row["ttft_ms"]["p50"] < base["ttft_ms"]["p50"]
        checks[name] = {
            "hit_rate_over_round_robin": round(ratio, 3) if ratio is not None else None,
            "ttft_p50_lower_than_round_robin": is_faster,
            "target_met": ratio is not None and ratio >= TARGET_HIT_RATIO and is_faster,
        }
    return {"target_hit_ratio": TARGET_HIT_RATIO, "targets": checks}


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| strategy | hit rate | TTFT p50 / p99 (ms) | E2E p50 / p99 (ms) | output tok/s | worker share | ok |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, row in results.items():
        ttft, e2e = row["ttft_ms"] or {}, row["e2e_ms"] or {}
        shares = ", ".join(f"{share:.0%}" for share in row["worker_share"].values())
        lines.append(
            f"| {name} | {row['prefix_cache_hit_rate'] or 0:.1%} | {ttft.get('p50', 0):.0f} / "
            f"{ttft.get('p99', 0):.0f} | {e2e.get('p50', 0):.0f} / {e2e.get('p99', 0):.0f} | "
            f"{row['output_token_throughput']:.1f} | {shares} | {row['num_completed']} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEMO_MODEL, help="HF-format checkpoint folder")
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated, run in this order"
    )
    parser.add_argument("--num-tenants", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=256, help="system prompt words per tenant")
    parser.add_argument("--input-len", default="16:32", help="user words per request: N or LOW:HIGH")
    parser.add_argument("--output-len", default="8", help="max_tokens (ignore_eos): N or LOW:HIGH")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--cache-share", type=float, default=0.5, help="tenants' prefixes a worker's pool holds"
    )
    parser.add_argument("--warmup-requests", type=int, default=12, help="unmeasured, per strategy")
    parser.add_argument("--num-requests", type=int, default=36, help="measured requests per strategy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads per worker")
    parser.add_argument("--max-batch-tokens", type=int, default=1024)
    parser.add_argument(
        "--kv-load-weight", type=float, default=None, help="kv_cache_aware's loadWeight (default: the CRD's)"
    )
    parser.add_argument("--restart-workers", action="store_true", help="fresh workers for every strategy")
    parser.add_argument(
        "--max-seconds", type=float, default=120.0, help="stop sending after this per strategy"
    )
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "routing_strategies.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    strategies = [name.strip() for name in args.strategies.split(",") if name.strip()]
    if unknown := set(strategies) - set(STRATEGIES):
        print(
            f"--strategies: unknown {sorted(unknown)}; choose from {', '.join(STRATEGIES)}", file=sys.stderr
        )
        return 2
    prefix_blocks = prefix_blocks_per_tenant(args)
    args.num_kv_blocks = math.ceil(args.num_tenants * prefix_blocks * args.cache_share) + running_blocks(args)
    machine = machine_info()
    results = run_all(args, strategies, Path(tempfile.mkdtemp(prefix="herd-bench-routing-")))
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    document = {
        "benchmark": "routing_strategies",
        "command": shlex.join(
            ["python", "bench/routing_strategies.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": machine,
        "settings": {**settings, "prefix_blocks_per_tenant": prefix_blocks, "block_size": BLOCK_SIZE},
        "strategies": results,
        **verdict(results),
    }
    write_json(args.out, document)
    print(markdown_table(results))
    print(json.dumps(document.get("targets", {})))
    return 0 if all(row["num_completed"] for row in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
