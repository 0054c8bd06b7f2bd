"""``herd orchestrator``: the OpenAI gateway in front of the workers of one or more models."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from herd.api.logs import configure_logging
from herd.api.manifest import ManifestError, load_manifest
from herd.api.protocol import TOKEN_ENV, Role
from herd.api.tracing import configure_tracing
from herd.cli._args import at_least_zero, port, positive, share
from herd.orchestrator.access_log import enable_access_log
from herd.orchestrator.admission.waiting import QueueSettings
from herd.orchestrator.app import AppSettings, build_app
from herd.orchestrator.auth import ADMIN_API_KEYS_ENV, load_api_keys
from herd.orchestrator.discovery import ModelConfig, StaticSource, WorkerEndpoint, WorkerSource
from herd.orchestrator.gateway import GatewaySettings
from herd.orchestrator.registry import RegistrySettings
from herd.orchestrator.routing.headroom import IdleHeadroom
from herd.orchestrator.routing.reserve import SlotReserve
from herd.orchestrator.server import ServerLimits, run_server
from herd.orchestrator.state import REDIS_TIMEOUT_S, build_state

__all__ = [
    "add_admission_arguments",
    "add_source_arguments",
    "load_source",
    "local_model_path",
    "model_configs",
    "parse_worker",
    "queue_settings",
    "register",
    "worker_source",
]

_ROLES: tuple[Role, ...] = ("unified", "prefill", "decode")


def local_model_path(source: str, *, cwd: Path | None = None) -> Path | None:
    """The folder of a ``file://`` source (relative paths from ``cwd``); ``None`` for other schemes."""
    if not source.startswith("file://"):
        return None
    return ((cwd or Path.cwd()) / source.removeprefix("file://")).resolve()


def model_configs(manifests: Sequence[Path]) -> list[ModelConfig]:
    """Every ModelDeployment in the files, as model configs; raises ``ManifestError``."""
    return [
        ModelConfig.from_deployment(deployment, model_path=local_model_path(deployment.spec.model.source))
        for path in manifests
        for deployment in load_manifest(path)
    ]


def parse_worker(value: str, models: Sequence[ModelConfig], number: int) -> WorkerEndpoint:
    """``[MODEL=]URL,INTERNAL_URL[,ROLE[,ID]]``; MODEL may be left out when one model is served.

    ID names the worker in routing headers, metrics and the dashboard (default ``worker-NUMBER``).
    """
    model, _, rest = value.rpartition("=") if "=" in value.split(",")[0] else ("", "", value)
    parts = rest.split(",")
    if len(parts) not in (2, 3, 4) or (len(parts) >= 3 and parts[2] not in _ROLES) or "" in parts:
        raise ValueError(f"--worker {value!r}: expected [MODEL=]URL,INTERNAL_URL[,{'|'.join(_ROLES)}[,ID]]")
    if not model:
        if len(models) != 1:
            raise ValueError(f"--worker {value!r}: name its model (MODEL=URL,...) when several are served")
        model = models[0].served_name
    role: Role = parts[2] if len(parts) >= 3 else "unified"  # type: ignore[assignment]
    name = parts[3] if len(parts) == 4 else f"worker-{number}"
    return WorkerEndpoint(name, model, parts[0].rstrip("/"), parts[1].rstrip("/"), role)


def worker_source(args: argparse.Namespace, models: list[ModelConfig]) -> WorkerSource:
    """The workers ``add_source_arguments`` name: discovered on Kubernetes, else the static list."""
    if args.kubernetes:
        # Imported only when asked for: static and local runs never touch the Kubernetes API.
        from herd.orchestrator.kube_discovery import KubeSource

        return KubeSource(namespace=args.namespace, kubeconfig=args.kubeconfig)
    endpoints = [parse_worker(value, models, number) for number, value in enumerate(args.worker)]
    return StaticSource(models, endpoints)


def load_source(args: argparse.Namespace) -> WorkerSource:
    """The source ``add_source_arguments`` describe; ``ValueError``, ``ManifestError`` or ``OSError``
    say what is wrong with them."""
    if args.poll_interval <= 0:
        raise ValueError(f"--poll-interval must be above 0 seconds, got {args.poll_interval}")
    source = worker_source(args, model_configs(args.manifest))
    if not args.kubernetes and not args.worker:
        raise ValueError("give --worker URL,INTERNAL_URL (repeatable) or --kubernetes")
    return source


def run(args: argparse.Namespace) -> int:
    try:
        source = load_source(args)
        api_keys = load_api_keys(args.api_keys_file)
        admin_keys = load_api_keys(args.admin_api_keys_file, ADMIN_API_KEYS_ENV)
    except (ManifestError, ValueError, OSError) as error:
        print(f"herd orchestrator: {error}", file=sys.stderr)
        return 2
    configure_logging("orchestrator", args.log_level)
    configure_tracing("herd-orchestrator", args.otlp_traces_endpoint)
    enable_access_log(args.access_log)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    settings = AppSettings(
        internal_token=args.internal_token or os.environ.get(TOKEN_ENV),
        max_body_bytes=args.max_body_bytes,
        body_timeout=args.body_timeout,
        gateway=GatewaySettings(
            request_timeout=args.request_timeout,
            max_resumes=args.max_resumes,
            access_log_prompts=args.access_log_prompts,
            queue=queue_settings(args),
            slot_reserve=SlotReserve(share=args.slot_reserve),
            idle_headroom=idle_headroom(args),
        ),
        registry=RegistrySettings(poll_interval=args.poll_interval),
        ready_when_synced=args.kubernetes,
        batch_dir=args.batch_dir,
        batch_concurrency=args.batch_concurrency,
    )
    app = build_app(
        source,
        settings=settings,
        state=build_state(args.redis, timeout_seconds=args.redis_timeout),
        api_keys=api_keys,
        admin_keys=admin_keys,
    )
    limits = ServerLimits(max_header_bytes=args.max_header_bytes, keep_alive_timeout=args.keep_alive_timeout)
    run_server(app, host=args.host, port=args.port, limits=limits)
    return 0


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the models and their workers come from, and how they are polled (the orchestrator's and
    the endpoint picker's flags)."""
    parser.add_argument(
        "--manifest", type=Path, action="append", default=[], help="ModelDeployment YAML (repeatable)"
    )
    parser.add_argument(
        "--worker",
        action="append",
        default=[],
        help="a static worker: [MODEL=]URL,INTERNAL_URL[,ROLE[,ID]] (repeatable)",
    )
    parser.add_argument("--kubernetes", action="store_true", help="discover workers from Kubernetes pods")
    parser.add_argument(
        "--namespace", default=None, help="with --kubernetes: watch one namespace (default: all)"
    )
    parser.add_argument(
        "--kubeconfig", default=None, help="with --kubernetes, outside a cluster: this kubeconfig"
    )
    parser.add_argument("--redis", default=None, help="redis://HOST:PORT/DB to share sessions and KV events")
    parser.add_argument(
        "--redis-timeout",
        type=positive(float),
        default=REDIS_TIMEOUT_S,
        help="seconds a Redis call may take before this replica routes on local state until Redis answers",
    )
    parser.add_argument(
        "--admin-api-keys-file",
        type=Path,
        default=None,
        help=f"admin API keys for runtime LoRA loading, one per line (or {ADMIN_API_KEYS_ENV})",
    )
    parser.add_argument(
        "--internal-token", default=None, help=f"the workers' shared internal token (or {TOKEN_ENV})"
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=RegistrySettings().poll_interval,
        help="least seconds between a worker's status lines (its load and KV events go out at most this "
        "often; readiness changes and heartbeats come regardless), and the first retry delay",
    )


def add_admission_arguments(parser: argparse.ArgumentParser) -> None:
    """The tenants, the wait queue's bounds, the slot reserve and the idle headroom (the orchestrator's
    and the endpoint picker's flags, read back with ``load_api_keys``, ``queue_settings``,
    ``SlotReserve(share=args.slot_reserve)`` and ``idle_headroom``)."""
    parser.add_argument(
        "--api-keys-file",
        type=Path,
        default=None,
        help="accepted API keys: one per line, or a tenants YAML document with their priorities, "
        "weights, models and quotas (docs/admission.md)",
    )
    queue = QueueSettings()
    parser.add_argument(
        "--queue-max-size",
        type=positive(int),
        default=queue.max_size,
        help="requests that may wait per model while every worker is full (one more: 429)",
    )
    parser.add_argument(
        "--queue-max-wait",
        type=positive(float),
        default=queue.max_wait_seconds,
        help="seconds a request waits for a worker before its 429",
    )
    parser.add_argument(
        "--slot-reserve",
        type=share,
        default=SlotReserve().share,
        help="the part of each worker's slots (maxBatchSize + maxQueueLen) that batch lines and other "
        "requests at the lowest priority leave to more urgent ones, in [0, 1)",
    )
    headroom = IdleHeadroom()
    parser.add_argument(
        "--batch-idle-max-share",
        type=share,
        default=headroom.max_share,
        help="the most of a model's workers (rounded up, never all) that batch lines leave free of batch "
        "work while interactive requests are recent: as many as the recent peak of interactive requests "
        "in flight; in [0, 1), 0 turns it off (docs/batch.md)",
    )
    parser.add_argument(
        "--batch-idle-window",
        type=positive(float),
        default=headroom.window_s,
        help="seconds the peak of interactive requests in flight is remembered for --batch-idle-max-share",
    )
    parser.add_argument(
        "--batch-idle-min-workers",
        type=at_least_zero(int),
        default=headroom.min_workers,
        help="workers of each model that batch lines leave free of batch work even without interactive "
        "traffic (never all of them): a standing reserve that costs batch throughput all the time "
        "(docs/batch.md)",
    )


def queue_settings(args: argparse.Namespace) -> QueueSettings:
    """The wait queue ``add_admission_arguments`` describe."""
    return QueueSettings(max_size=args.queue_max_size, max_wait_seconds=args.queue_max_wait)


def idle_headroom(args: argparse.Namespace) -> IdleHeadroom:
    """The idle headroom ``add_admission_arguments`` describe."""
    return IdleHeadroom(
        max_share=args.batch_idle_max_share,
        window_s=args.batch_idle_window,
        min_workers=args.batch_idle_min_workers,
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("orchestrator", help="run the OpenAI gateway and router")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=8000)
    add_source_arguments(parser)
    parser.add_argument(
        "--batch-dir",
        type=Path,
        default=None,
        help="serve the Batch API (/v1/files, /v1/batches), keeping its state in this folder",
    )
    parser.add_argument(
        "--batch-concurrency",
        type=positive(int),
        default=8,
        help="lines of one batch in flight at once (at least 1)",
    )
    parser.add_argument(
        "--request-timeout",
        type=positive(float),
        default=600.0,
        help="seconds to wait for a worker's next byte",
    )
    parser.add_argument(
        "--max-resumes",
        type=at_least_zero(int),
        default=2,
        help="times a stream whose worker failed mid-answer goes on from another worker (0: never)",
    )
    add_admission_arguments(parser)
    parser.add_argument("--max-body-bytes", type=positive(int), default=4 * 1024 * 1024)
    parser.add_argument(
        "--body-timeout",
        type=positive(float),
        default=30.0,
        help="seconds a client may take to send a body (then 408)",
    )
    limits = ServerLimits()
    parser.add_argument(
        "--max-header-bytes",
        type=positive(int),
        default=limits.max_header_bytes,
        help="request line plus headers (more: 431)",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=positive(int),
        default=limits.keep_alive_timeout,
        help="seconds an idle client connection stays open (longer than clients keep one)",
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="export OpenTelemetry spans over OTLP/HTTP to this URL (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; "
        "none: tracing off)",
    )
    parser.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one JSON line per request on the herd.access logger (tenant, model, worker, tokens, TTFT, status)",
    )
    parser.add_argument(
        "--access-log-prompts",
        action="store_true",
        help="put each request's messages or prompt in its access line",
    )
    parser.set_defaults(func=run)
