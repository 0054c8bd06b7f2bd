"""Prometheus metrics under vLLM's names, in a registry owned by one app (not the global one).

Engine-side figures (queue lengths, KV usage, token and cache counters) are read at scrape time
from the engine's last load report and counters; per-request latencies are observed as requests run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from herd.api import metrics as names
from herd.api.heap import GC_PAUSES
from herd.api.protocol import LoadReport, Medium
from herd.worker.engine_protocol import ServingEngine
from herd.worker.stats import EngineStats

__all__ = ["RequestTiming", "WorkerMetrics"]

_LABELS = ("model_name",)
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


@dataclass
class RequestTiming:
    """One request's (or choice's) clock: started now, ``on_tokens`` at every output with tokens."""

    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)

    def on_tokens(self) -> None:
        at = time.monotonic()
        if self.last_token is None:
            self.first_token = at
        else:
            self.gaps.append(at - self.last_token)
        self.last_token = at


class WorkerMetrics:
    """The worker's metrics; ``render()`` is the ``/metrics`` body."""

    def __init__(self, engine: ServingEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.ttft = self._histogram(names.TIME_TO_FIRST_TOKEN_SECONDS, "Time to first token.", _TTFT_BUCKETS)
        self.itl = self._histogram(
            names.INTER_TOKEN_LATENCY_SECONDS, "Time between output tokens.", _ITL_BUCKETS
        )
        self.e2e = self._histogram(names.E2E_REQUEST_LATENCY_SECONDS, "Request latency.", _E2E_BUCKETS)
        self.step = Histogram(
            names.HERD_ENGINE_STEP_SECONDS, "Duration of one engine step.", registry=self.registry
        )
        self.success = Counter(
            names.REQUEST_SUCCESS_TOTAL,
            "Finished sequences by finish reason.",
            [*_LABELS, "finished_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            names.HERD_REQUESTS_REJECTED_TOTAL,
            "Requests refused before generation, by HTTP status.",
            [*_LABELS, "status"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine, model_name))
        self.registry.register(GC_PAUSES)
        engine.step_observers.append(self.step.observe)

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, documentation, _LABELS, buckets=buckets, registry=self.registry)

    def observe_finished(self, timing: RequestTiming, reason: str) -> None:
        """A finished request's latencies (TTFT, each inter-token gap, E2E until now) and reason."""
        label = self.model_name
        self.success.labels(label, reason).inc()
        self.e2e.labels(label).observe(time.monotonic() - timing.started)
        if timing.first_token is not None:
            self.ttft.labels(label).observe(timing.first_token - timing.started)
        histogram = self.itl.labels(label)
        for gap in timing.gaps:
            histogram.observe(gap)

    def observe_rejected(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


def _lora_info(load: LoadReport) -> GaugeMetricFamily:
    """vLLM's ``vllm:lora_requests_info``, as the Gateway API Inference Extension reads it: the
    adapters as comma-separated labels, the value the time of the reading (a reader keeps the newest)."""
    family = GaugeMetricFamily(
        names.LORA_REQUESTS_INFO,
        "Running and waiting LoRA adapters, and the most one step runs.",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    running, waiting = ",".join(load.running_lora_adapters), ",".join(load.waiting_lora_adapters)
    family.add_metric([str(load.max_loras), running, waiting], time.time())
    return family


class _EngineCollector(Collector):
    """Reads the engine's own counters and load at scrape time."""

    def __init__(self, engine: ServingEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        load = self.engine.load_report()
        labels = [self.model_name]
        yield self._gauge(names.NUM_REQUESTS_RUNNING, "Sequences running.", load.num_running)
        yield self._gauge(names.NUM_REQUESTS_WAITING, "Sequences waiting.", load.num_waiting)
        yield self._gauge(names.KV_CACHE_USAGE_PERC, "KV cache usage (1 = full).", load.kv_usage)
        yield self._counter(names.HERD_KV_EVENTS_TOTAL, "KV events published.", self.engine.num_kv_events)
        if self.engine.error is not None or not self.engine.is_loaded:
            return
        stats = self.engine.stats
        yield self._counter(
            names.PREFIX_CACHE_QUERIES,
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        yield self._counter(
            names.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits
        )
        yield self._counter(names.NUM_PREEMPTIONS_TOTAL, "Preemptions.", stats.num_preemptions)
        yield self._counter(names.PROMPT_TOKENS_TOTAL, "Prefilled prompt tokens.", stats.prompt_tokens)
        yield self._counter(names.GENERATION_TOKENS_TOTAL, "Generated tokens.", stats.generation_tokens)
        if stats.spec_accepted_per_pos:
            yield from self._speculation(stats)
        yield from self._tiers(stats, load)
        info = self.engine.info
        config = GaugeMetricFamily(
            names.CACHE_CONFIG_INFO,
            "KV cache configuration.",
            labels=[*_LABELS, "block_size", "num_gpu_blocks", "max_model_len", "cache_dtype"],
        )
        config.add_metric(
            [*labels, str(info.block_size), str(load.num_total_blocks), str(info.max_model_len), info.dtype],
            1.0,
        )
        yield config
        if load.max_loras:
            yield _lora_info(load)

    def _tiers(self, stats: EngineStats, load: LoadReport) -> Iterator[Metric]:
        """Per tier (``medium``): usage, size, blocks stored / restored (its hits) / evicted, and the
        restore bandwidth the worker measured; and the prefill rate the router weighs it against."""
        tiers = stats.kv_tiers
        per_medium: list[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, Mapping[Medium, float]]] = [
            (GaugeMetricFamily, names.HERD_KV_TIER_USAGE_PERC, "Share of a KV tier's blocks in use.",
             {m: used / total for m, (used, total) in stats.kv_tier_blocks.items() if total}),
            (GaugeMetricFamily, names.HERD_KV_TIER_BLOCKS, "Blocks a KV tier holds.",
             {m: total for m, (_, total) in stats.kv_tier_blocks.items()}),
            (CounterMetricFamily, names.HERD_KV_TIER_STORED_TOTAL, "Blocks stored into a KV tier.", tiers.stored),
            (CounterMetricFamily, names.HERD_KV_TIER_RESTORED_TOTAL,
             "Blocks restored from a KV tier onto the device (its hits).", tiers.restored),
            (CounterMetricFamily, names.HERD_KV_TIER_EVICTED_TOTAL, "Blocks evicted from a KV tier.", tiers.evicted),
            (GaugeMetricFamily, names.HERD_KV_TIER_RESTORE_BYTES_PER_SECOND,
             "Measured restore bandwidth from a KV tier.", load.restore_bytes_per_s),
        ]  # fmt: skip
        for kind, name, documentation, values in per_medium:
            family = kind(name, documentation, labels=[*_LABELS, "medium"])
            for medium, value in sorted(values.items()):
                family.add_metric([self.model_name, medium], value)
            yield family
        if load.prefill_tokens_per_s is not None:
            yield self._gauge(
                names.HERD_PREFILL_TOKENS_PER_SECOND, "Measured prefill rate.", load.prefill_tokens_per_s
            )

    def _speculation(self, stats: EngineStats) -> Iterator[Metric]:
        """Speculative decoding's counters, under vLLM's names (only when the engine speculates)."""
        yield self._counter(names.SPEC_DECODE_NUM_DRAFTS, "Proposals verified.", stats.spec_num_drafts)
        yield self._counter(
            names.SPEC_DECODE_NUM_DRAFT_TOKENS, "Tokens proposed.", stats.spec_num_draft_tokens
        )
        yield self._counter(
            names.SPEC_DECODE_NUM_ACCEPTED_TOKENS, "Proposed tokens accepted.", stats.spec_num_accepted_tokens
        )
        per_pos = CounterMetricFamily(
            names.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
            "Proposed tokens accepted at each position of a proposal.",
            labels=[*_LABELS, "position"],
        )
        for position, count in enumerate(stats.spec_accepted_per_pos):
            per_pos.add_metric([self.model_name, str(position)], count)
        yield per_pos

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=list(_LABELS))
        family.add_metric([self.model_name], value)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=list(_LABELS))
        family.add_metric([self.model_name], value)
        return family
