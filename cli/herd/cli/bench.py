"""``herd bench``: a load generator for any OpenAI-compatible endpoint (herd's gateway, a worker,
or a peer server). Thin: it turns arguments into a ``BenchConfig`` and runs ``herd.cli.loadgen``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from herd.cli import calibrate
from herd.cli.loadgen import BenchConfig, Progress, format_table, run_benchmark
from herd.cli.loadgen.config import describe_errors, parse_extra_body

__all__ = ["register", "run"]

_API_KEY_ENV = ("HERD_API_KEY", "OPENAI_API_KEY")


def build_config(args: argparse.Namespace) -> BenchConfig:
    """The validated config; raises ``ValueError`` naming the option to fix."""
    uses_defaults = args.concurrency is None and args.request_rate is None
    bounded = args.num_requests is not None or args.duration is not None
    return BenchConfig(
        url=args.url,
        model=args.model,
        api=args.api,
        workload=args.workload,
        input_len=args.input_len,
        output_len=args.output_len,
        num_tenants=args.num_tenants,
        prefix_len=args.prefix_len,
        num_turns=args.num_turns,
        session_header=args.session_header,
        concurrency=8 if uses_defaults else args.concurrency,
        request_rate=args.request_rate,
        num_requests=args.num_requests if bounded else 100,
        duration_s=args.duration,
        ignore_eos=args.ignore_eos,
        include_usage=args.include_usage,
        extra_body=parse_extra_body(args.extra_body),
        api_key=args.api_key or next((os.environ[k] for k in _API_KEY_ENV if os.environ.get(k)), None),
        timeout_s=args.timeout,
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except ValidationError as error:
        for line in describe_errors(error):
            print(f"herd bench: {line}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"herd bench: {error}", file=sys.stderr)
        return 2
    progress = Progress(total=config.num_requests, duration_s=config.duration_s, enabled=not args.quiet)
    try:
        report = asyncio.run(run_benchmark(config, progress=progress))
    except RuntimeError as error:
        print(f"herd bench: {error}", file=sys.stderr)
        return 1
    print(format_table(report))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["num_completed"] else 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench", help="send OpenAI load and report TTFT, ITL, throughput, cache hits"
    )
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="OpenAI API base URL (with or without /v1)"
    )
    parser.add_argument("--model", help="model name (default: the first one /v1/models lists)")
    parser.add_argument("--api", choices=["chat", "completions"], default="chat")
    _add_workload_options(parser)
    _add_load_options(parser)
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos so every answer has --output-len tokens (default: on)",
    )
    parser.add_argument(
        "--include-usage",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send stream_options.include_usage (token counts, cache hits; default: on)",
    )
    parser.add_argument("--extra-body", help="JSON object merged into every request body")
    parser.add_argument("--api-key", help="Bearer key (default: $HERD_API_KEY or $OPENAI_API_KEY)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", help="also write the report as JSON to this file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)
    calibrate.register(parser.add_subparsers(dest="bench_command", metavar="calibrate"))


def _add_workload_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload", choices=["synthetic", "shared-prefix", "multi-turn"], default="synthetic"
    )
    parser.add_argument("--input-len", default="256", help="prompt words per request: N or LOW:HIGH")
    parser.add_argument("--output-len", default="64", help="max_tokens per request: N or LOW:HIGH")
    parser.add_argument("--num-tenants", type=int, default=8, help="shared-prefix: tenants")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt words")
    parser.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per session")
    parser.add_argument("--session-header", default="X-Session-ID", help="multi-turn: session id header")


def _add_load_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, help="requests kept in flight (default 8 without a rate)")
    parser.add_argument("--request-rate", type=float, help="Poisson arrivals per second")
    parser.add_argument("--num-requests", type=int, help="requests to send (default 100 without a duration)")
    parser.add_argument("--duration", type=float, help="seconds to keep sending")
