"""``herd worker``: serve one model over the OpenAI API (and the internal protocol port).

``engine.backend`` picks the engine: herd's torch engine or the simulated one (cost model, no
weights); ``--replicas N`` runs N simulated workers in this one process.

A model split over several pods (a LeaderWorkerSet group) runs a ``herd worker`` in each: the leader
(``--group-index 0``) serves HTTP and runs rank 0; each follower runs its pod's ranks, joined to the
leader's rendezvous port, and serves nothing. The group flags default to the env vars
LeaderWorkerSet gives its pods (``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``, ``LWS_LEADER_ADDRESS``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from herd.api.crd import EngineSpec
from herd.api.logs import configure_logging
from herd.api.protocol import RENDEZVOUS_PORT, TOKEN_ENV
from herd.api.tracing import configure_tracing
from herd.cli._args import at_least_zero, port, positive

if TYPE_CHECKING:
    from herd.api.prompt import PromptRenderer
    from herd.worker.config import EngineConfig, PodGroup
    from herd.worker.server import ServeOptions

__all__ = ["engine_spec", "lora_modules", "pod_group", "register"]

# flag -> where it lands in the camelCase EngineSpec document
_OVERRIDES: dict[str, tuple[str, ...]] = {
    "max_model_len": ("maxModelLen",),
    "max_batch_size": ("maxBatchSize",),
    "max_batch_tokens": ("maxBatchTokens",),
    "max_queue_len": ("maxQueueLen",),
    "dtype": ("dtype",),
    "device": ("device",),
    "block_size": ("kvCache", "blockSize"),
    "kv_memory_gib": ("kvCache", "memoryGiB"),
    "tensor_parallel_size": ("tensorParallelSize",),
}


def engine_spec(engine_json: str | None, overrides: dict[str, Any]) -> EngineSpec:
    """The manifest's engine block (camelCase JSON) with the convenience flags laid over it."""
    document: dict[str, Any] = json.loads(engine_json) if engine_json else {}
    for flag, path in _OVERRIDES.items():
        if overrides.get(flag) is not None:
            target = document
            for key in path[:-1]:
                target = target.setdefault(key, {})
            target[path[-1]] = overrides[flag]
    return EngineSpec.model_validate(document)


def pod_group(args: argparse.Namespace, environ: Mapping[str, str]) -> PodGroup:
    """The pod group from the flags, each unset one from LeaderWorkerSet's env var (one pod without)."""
    from herd.worker.config import PodGroup

    def pick(flag: Any, env: str, default: Any) -> Any:
        return flag if flag is not None else environ.get(env, default)

    try:
        return PodGroup(
            size=pick(args.group_size, "LWS_GROUP_SIZE", 1),
            index=pick(args.group_index, "LWS_WORKER_INDEX", 0),
            leader_host=pick(args.leader_address, "LWS_LEADER_ADDRESS", "127.0.0.1"),
            port=args.rendezvous_port,
            join_timeout_s=args.join_timeout,
        )
    except ValidationError as error:
        raise ValueError(
            f"the pod group (--group-size/LWS_GROUP_SIZE, --group-index/LWS_WORKER_INDEX, "
            f"--rendezvous-port, --join-timeout) is invalid: {error}"
        ) from error


def run(args: argparse.Namespace) -> int:
    from herd.worker.config import EngineConfig
    from herd.worker.server import serve_many

    token = args.internal_token or os.environ.get(TOKEN_ENV, "")
    if not token:
        print(
            f"herd worker: pass --internal-token or set {TOKEN_ENV} (the orchestrator sends it)",
            file=sys.stderr,
        )
        return 2
    try:
        spec = engine_spec(args.engine_json, vars(args))
        _check_backend(spec, args.replicas)
        group = pod_group(args, os.environ)
        if group.size > 1 and (spec.backend != "herd" or args.replicas > 1):
            raise ValueError(
                "a model over several pods (--group-size > 1) needs engine.backend herd, one replica"
            )
        config = EngineConfig(
            model_path=args.model,
            served_name=args.served_name or args.model.name,
            role=args.role,
            engine=spec,
            seed=args.seed,
            lora_modules=lora_modules(args.lora_modules or []),
            group=group,
        )
    except (ValidationError, ValueError) as error:
        print(f"herd worker: invalid settings: {error}", file=sys.stderr)
        return 2
    configure_logging("worker", args.log_level)
    configure_tracing("herd-worker", args.otlp_traces_endpoint)
    if not config.group.is_leader:
        return _follow_leader(config)
    return serve_many(
        [(config, _options(args, token, number)) for number in range(args.replicas)], _renderer(config)
    )


def _follow_leader(config: EngineConfig) -> int:
    """A follower pod: run this pod's ranks until the leader's worker stops (0) or fails them (1)."""
    import logging

    from herd.worker.model_runner import follow_leader

    try:
        follow_leader(config)
    except Exception:
        logging.getLogger(__name__).exception(
            "this pod's ranks left the leader's group; exiting so that the group restarts"
        )
        return 1
    return 0


def lora_modules(values: list[str]) -> dict[str, Path]:
    """``--lora-modules``' ``NAME=PATH`` pairs (vLLM's form) as a name -> folder map."""
    modules: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(
                f"--lora-modules {value!r} is not NAME=PATH: name the adapter and its PEFT folder"
            )
        modules[name] = Path(path)
    return modules


def _check_backend(spec: EngineSpec, replicas: int) -> None:
    if spec.backend == "vllm":
        raise ValueError(
            "engine.backend vllm runs vLLM's own server behind `herd sidecar`, not `herd worker`; "
            "use backend herd or simulated here"
        )
    if replicas > 1 and spec.backend != "simulated":
        raise ValueError(f"--replicas {replicas} needs engine.backend simulated (one real engine a process)")


def _options(args: argparse.Namespace, token: str, number: int) -> ServeOptions:
    """Worker ``number`` of the process listens on ``--port + number`` and ``--internal-port + number``."""
    from herd.worker.server import ServeOptions

    return ServeOptions(
        host=args.host,
        port=args.port + number,
        internal_port=(args.internal_port or args.port + 1000) + number,
        internal_token=token,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout,
    )


def _renderer(config: EngineConfig) -> PromptRenderer | None:
    """One tokenizer for a fleet of simulated engines (the torch engine loads its own)."""
    if config.engine.backend != "simulated":
        return None
    from herd.api.prompt import PromptRenderer

    return PromptRenderer.from_pretrained(config.model_path)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("worker", help="serve a model over the OpenAI API")
    parser.add_argument("--model", type=Path, required=True, help="HF-format model folder")
    parser.add_argument("--served-name", help="the OpenAI model name (default: the folder's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=8001, help="public OpenAI port (default 8001)")
    parser.add_argument("--internal-port", type=port, help="internal protocol port (default: port + 1000)")
    parser.add_argument("--internal-token", help=f"shared internal token (default: ${TOKEN_ENV})")
    parser.add_argument("--role", choices=["unified", "prefill", "decode"], default="unified")
    parser.add_argument("--engine-json", help="the manifest's engine block as camelCase JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) to load at start, each served as the model NAME",
    )
    parser.add_argument(
        "--replicas",
        type=positive(int),
        default=1,
        help="simulated backend: this many workers in one process, on consecutive ports from --port "
        "and --internal-port (a fleet on one event loop)",
    )
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-batch-size", type=int)
    parser.add_argument("--max-batch-tokens", type=int)
    parser.add_argument("--max-queue-len", type=int)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--kv-memory-gib", type=float)
    parser.add_argument("--tensor-parallel-size", type=int, help="ranks (processes) that split the model")
    group = parser.add_argument_group("a model over several pods (LeaderWorkerSet)")
    group.add_argument(
        "--group-size", type=int, help="pods the model's ranks span (default: $LWS_GROUP_SIZE, else 1)"
    )
    group.add_argument(
        "--group-index", type=int, help="this pod's index, 0 the leader (default: $LWS_WORKER_INDEX, else 0)"
    )
    group.add_argument(
        "--leader-address", help="the leader pod's host, for followers (default: $LWS_LEADER_ADDRESS)"
    )
    group.add_argument(
        "--rendezvous-port",
        type=int,
        default=RENDEZVOUS_PORT,
        help=f"the leader's rank rendezvous port (default {RENDEZVOUS_PORT})",
    )
    group.add_argument(
        "--join-timeout", type=float, default=300.0, help="seconds for every rank to join (default 300)"
    )
    parser.add_argument(
        "--max-body-bytes", type=positive(int), default=4 * 1024 * 1024, help="larger bodies get 413"
    )
    parser.add_argument(
        "--drain-timeout",
        type=at_least_zero(float),
        default=30.0,
        help="seconds to finish in-flight work on SIGTERM",
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="export OpenTelemetry spans over OTLP/HTTP to this URL (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; "
        "none: tracing off)",
    )
    parser.set_defaults(func=run)
