"""``herd bench``: a load generator for any OpenAI-compatible endpoint (herd's gateway, a worker,
or a peer server). Thin: it turns arguments into a ``BenchConfig`` and runs ``herd.cli.loadgen``.
``herd bench trace`` writes a request trace, ``herd bench oracle`` the best hit rate on one."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from herd.api.openai import ChatCompletionRequest
from herd.api.prompt import PromptRenderer
from herd.cli import calibrate
from herd.cli.loadgen import BenchConfig, Progress, format_table, run_benchmark
from herd.cli.loadgen.config import describe_errors, parse_extra_body
from herd.cli.loadgen.oracle import OracleRequest, oracle_report, oracle_request
from herd.cli.loadgen.output import cannot_write, check_writable
from herd.cli.loadgen.problems import problem_message
from herd.cli.loadgen.traces import (
    TRACE_KINDS,
    TRACE_SPEC,
    TraceError,
    TraceRequest,
    dump_trace,
    generate,
    load_trace,
)

__all__ = ["register", "run"]

_API_KEY_ENV = ("HERD_API_KEY", "OPENAI_API_KEY")


def build_config(args: argparse.Namespace) -> BenchConfig:
    """The validated config; raises ``ValueError`` naming the option to fix."""
    uses_defaults = args.concurrency is None and args.request_rate is None
    bounded = args.num_requests is not None or args.duration is not None
    num_requests = _trace_requests(args.trace, args.num_requests) if args.trace else args.num_requests
    return BenchConfig(
        url=args.url,
        model=args.model,
        api=args.api,
        workload=args.workload,
        trace=args.trace,
        input_len=args.input_len,
        output_len=args.output_len,
        num_tenants=args.num_tenants,
        prefix_len=args.prefix_len,
        num_turns=args.num_turns,
        session_header=args.session_header,
        concurrency=8 if uses_defaults else args.concurrency,
        request_rate=args.request_rate,
        num_requests=num_requests if bounded or args.trace else 100,
        duration_s=args.duration,
        ignore_eos=args.ignore_eos,
        include_usage=args.include_usage,
        extra_body=parse_extra_body(args.extra_body),
        api_key=args.api_key or next((os.environ[k] for k in _API_KEY_ENV if os.environ.get(k)), None),
        timeout_s=args.timeout,
        seed=args.seed,
    )


def _trace_requests(path: Path, num_requests: int | None) -> int:
    """How many of the trace's requests to replay: all by default (the file is read here, so a
    trace that cannot be replayed fails before the run starts)."""
    num_in_trace = len(load_trace(path))
    if (num_requests or 0) > num_in_trace:
        raise TraceError(
            f"--num-requests {num_requests} is more than the {num_in_trace} requests of {path}: "
            "ask for at most that many"
        )
    return num_requests or num_in_trace


def run(args: argparse.Namespace) -> int:
    json_out = Path(args.json_out) if args.json_out else None
    try:
        config = build_config(args)
        if json_out:
            check_writable(json_out, "--json-out")
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
    if json_out:
        try:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as error:  # checked before the run, but the disk may have filled since
            print(f"herd bench: {cannot_write(json_out, '--json-out', error)}", file=sys.stderr)
            return 1
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
    commands = parser.add_subparsers(dest="bench_command", metavar="{calibrate,trace,oracle}")
    calibrate.register(commands)
    _register_trace(commands)
    _register_oracle(commands)


def _add_workload_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload", choices=["synthetic", "shared-prefix", "multi-turn", "trace"], default="synthetic"
    )
    parser.add_argument(
        "--trace",
        type=Path,
        help="trace: the JSONL file to replay in order, a conversation's next turn after its previous "
        "one's answer (herd bench trace); with --request-rate its arrival gaps are kept, scaled to that mean rate",
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


def _register_trace(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("trace", help="write a deterministic request trace as JSONL")
    kinds = [str(kind.model_fields["kind"].default) for kind in TRACE_KINDS]
    parser.add_argument("--kind", choices=kinds, required=True)
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    parser.add_argument("--seed", type=int, default=0, help="the same seed writes the same bytes")
    for name, uses in _trace_options().items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, help=uses)
    parser.set_defaults(func=run_trace)


def _trace_options() -> dict[str, str]:
    """Every kind's settings: option name -> what it means for each kind that has it, with its default."""
    uses: dict[str, dict[str, list[str]]] = {}
    for kind in TRACE_KINDS:
        kind_name = kind.model_fields["kind"].default
        for name, field in kind.model_fields.items():
            if name != "kind":
                meanings = uses.setdefault(name, {})
                meanings.setdefault(field.description or name, []).append(f"{kind_name} {field.default}")
    return {
        name: "; ".join(f"{meaning} ({', '.join(kinds)})" for meaning, kinds in meanings.items())
        for name, meanings in uses.items()
    }


def run_trace(args: argparse.Namespace) -> int:
    given = {name: getattr(args, name) for name in _trace_options() if getattr(args, name) is not None}
    try:
        spec = TRACE_SPEC.validate_python({"kind": args.kind, **given})
    except ValidationError as error:
        for problem in error.errors(include_input=False, include_url=False):
            message = problem_message(problem)
            if problem["type"] == "extra_forbidden":
                message = f"not a setting of --kind {args.kind}; see herd bench trace --help"
            # The location is (kind, field), or just (kind,) for a problem of several settings.
            if len(problem["loc"]) > 1:
                message = "--" + str(problem["loc"][-1]).replace("_", "-") + f": {message}"
            print(f"herd bench trace: {message}", file=sys.stderr)
        return 2
    try:
        check_writable(args.out, "--out")
        requests = generate(spec, args.seed)
    except ValueError as error:
        print(f"herd bench trace: {error}", file=sys.stderr)
        return 2
    try:
        dump_trace(requests, args.out)
    except OSError as error:
        print(f"herd bench trace: {cannot_write(args.out, '--out', error)}", file=sys.stderr)
        return 1
    sessions = len({request.session_id for request in requests})
    print(f"wrote {len(requests)} requests of {sessions} sessions to {args.out}")
    return 0


def _register_oracle(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "oracle", help="the hit rate of an ideal router on a trace, and the trace's infinite-cache ceiling"
    )
    parser.add_argument("--trace", type=Path, required=True, help="a JSONL trace (herd bench trace)")
    parser.add_argument("--workers", type=int, required=True, help="fleet size")
    parser.add_argument("--blocks-per-worker", type=int, required=True, help="KV blocks of each worker")
    parser.add_argument("--model", type=Path, required=True, help="model folder (tokenizer, chat template)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    parser.set_defaults(func=run_oracle)


def run_oracle(args: argparse.Namespace) -> int:
    try:
        requests = _oracle_requests(load_trace(args.trace), args.model, args.block_size)
        report = oracle_report(
            requests,
            num_workers=args.workers,
            blocks_per_worker=args.blocks_per_worker,
            block_size=args.block_size,
        )
    except ValueError as error:  # a malformed trace, a model folder without a tokenizer, a pool too small
        print(f"herd bench oracle: {error}", file=sys.stderr)
        return 2
    print(json.dumps({"trace": str(args.trace), **report}, indent=2))
    return 0


def _oracle_requests(trace: list[TraceRequest], model: Path, block_size: int) -> list[OracleRequest]:
    """The trace's prompts as token ids, through the very call a worker makes on a chat request."""
    renderer = PromptRenderer.from_pretrained(model)
    requests = []
    for request in trace:
        body = {
            "model": model.name,
            "max_tokens": request.output_length,
            **request.model_dump(include={"messages"}),
        }
        token_ids = renderer.chat_request_ids(ChatCompletionRequest.model_validate(body))
        requests.append(
            oracle_request(token_ids, request.output_length, block_size=block_size, model_id=model.name)
        )
    return requests
