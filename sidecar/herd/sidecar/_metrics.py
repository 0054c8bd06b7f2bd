"""vLLM's Prometheus ``/metrics`` read as herd's load report and vLLM's cache geometry.

vLLM labels each sample with its engine (one per data-parallel rank): counts are summed over the
engines, KV usage averaged. ``vllm:cache_config_info`` carries the cache settings as labels, among
them ``block_size`` and ``num_gpu_blocks`` (the pool's size, on a CPU too). vLLM does not say how many
prompt tokens wait for prefill, so ``num_waiting_prefill_tokens`` stays 0: the gateway's own
in-flight counts and ``num_waiting`` carry that load. With LoRA on, ``vllm:lora_requests_info`` (the
newest sample: its value is the time of the reading) gives ``max_loras`` and the running and waiting
adapters; vLLM names no other loaded adapter there, so the report's loaded adapters are those two
(a lower bound: routing then prefers a vLLM worker that runs the adapter already).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from herd.api.metrics import (
    CACHE_CONFIG_INFO,
    KV_CACHE_USAGE_PERC,
    LORA_REQUESTS_INFO,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
)
from herd.api.protocol import LoadReport

__all__ = ["CacheGeometry", "MetricsError", "cache_geometry", "load_report"]


class MetricsError(ValueError):
    """vLLM's metrics lack what the sidecar reads."""


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    block_size: int
    num_blocks: int


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> (labels, value) of every sample."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    except ValueError as error:
        raise MetricsError(f"vLLM's /metrics is not Prometheus text ({error})") from None
    return samples


def cache_geometry(text: str) -> CacheGeometry:
    """The KV pool's block size and number of blocks, from ``vllm:cache_config_info``."""
    infos = _samples(text).get(CACHE_CONFIG_INFO, [])
    for labels, _ in infos:
        if labels.get("block_size", "None") != "None" and labels.get("num_gpu_blocks", "None") != "None":
            return CacheGeometry(int(labels["block_size"]), int(labels["num_gpu_blocks"]))
    raise MetricsError(
        f"vLLM's /metrics has no {CACHE_CONFIG_INFO} with block_size and num_gpu_blocks yet; "
        "it publishes them once its KV cache is allocated"
    )


def load_report(text: str, num_blocks: int, *, is_draining: bool = False) -> LoadReport:
    """The load report of a vLLM server whose pool holds ``num_blocks`` blocks."""
    samples = _samples(text)

    def values(name: str) -> list[float]:
        found = [value for _, value in samples.get(name, [])]
        if not all(math.isfinite(value) for value in found):
            raise MetricsError(
                f"vLLM's /metrics gives {name} = {found}; the load report takes finite numbers"
            )
        return found

    usage = values(KV_CACHE_USAGE_PERC)
    kv_usage = min(max(sum(usage) / len(usage), 0.0), 1.0) if usage else 0.0
    return LoadReport(
        **_lora_fields(samples.get(LORA_REQUESTS_INFO, [])),
        num_running=round(sum(values(NUM_REQUESTS_RUNNING))),
        num_waiting=round(sum(values(NUM_REQUESTS_WAITING))),
        kv_usage=kv_usage,
        num_free_blocks=round(num_blocks * (1.0 - kv_usage)),
        num_total_blocks=num_blocks,
        is_draining=is_draining,
    )


def _lora_fields(infos: list[tuple[dict[str, str], float]]) -> dict[str, object]:
    """``max_loras`` and the adapters of the newest ``vllm:lora_requests_info`` sample (none: LoRA off)."""
    if not infos:
        return {}
    labels, _ = max(infos, key=lambda info: info[1])
    running = [name for name in labels.get("running_lora_adapters", "").split(",") if name]
    waiting = [name for name in labels.get("waiting_lora_adapters", "").split(",") if name]
    return {
        "max_loras": int(labels.get("max_lora", "0") or 0),
        "lora_adapters": list(dict.fromkeys([*running, *waiting])),
        "running_lora_adapters": running,
        "waiting_lora_adapters": waiting,
    }
