"""Statistics of a run: latency summaries, throughput, prefix-cache hit rate, worker shares, errors.

Latencies are pooled as in vLLM's and guidellm's benchmarks: TTFT and E2E once per successful
request; ITL once per gap between consecutive text chunks, over all requests; TPOT once per request
with more than one output token, ``(E2E - TTFT) / (output tokens - 1)``. Percentiles interpolate
linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from herd.cli.loadgen.client import RequestResult

__all__ = ["build_report", "percentile", "summarize"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between order statistics."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(seconds: Sequence[float]) -> dict[str, float] | None:
    """Mean, p50, p90, p99 in milliseconds; ``None`` when there is nothing to summarize."""
    if not seconds:
        return None
    millis = [value * 1000 for value in seconds]
    summary = {"mean": sum(millis) / len(millis)}
    summary.update({f"p{q}": percentile(millis, q) for q in (50, 90, 99)})
    return {name: round(value, 3) for name, value in summary.items()}


def _latencies(results: Sequence[RequestResult]) -> dict[str, dict[str, float] | None]:
    ttfts = [r.ttft for r in results if r.ttft is not None]
    itls = [b - a for r in results for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    tpots = [
        (r.e2e - r.ttft) / (r.num_output_tokens - 1)
        for r in results
        if r.ttft is not None and r.num_output_tokens > 1
    ]
    return {
        "ttft_ms": summarize(ttfts),
        "itl_ms": summarize(itls),
        "tpot_ms": summarize(tpots),
        "e2e_ms": summarize([r.e2e for r in results]),
    }


def _cache_hit_rate(results: Sequence[RequestResult]) -> float | None:
    """Cached prompt tokens over prompt tokens, over the requests whose usage reported both."""
    reported = [r for r in results if r.prompt_tokens and r.cached_tokens is not None]
    if not reported:
        return None
    return round(sum(r.cached_tokens or 0 for r in reported) / sum(r.prompt_tokens or 0 for r in reported), 4)


def _worker_share(results: Sequence[RequestResult]) -> dict[str, float]:
    counts = Counter(r.worker for r in results if r.worker)
    total = sum(counts.values())
    return {worker: round(count / total, 4) for worker, count in sorted(counts.items())}


def build_report(results: Sequence[RequestResult], elapsed_s: float) -> dict[str, Any]:
    """Every figure of a run as one JSON-ready dict (``herd bench --json-out`` writes it)."""
    ok = [r for r in results if r.is_ok]
    errors = Counter(r.error for r in results if r.error is not None)
    output_tokens = sum(r.num_output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    return {
        "duration_s": round(elapsed_s, 3),
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_errors": len(results) - len(ok),
        "errors": dict(errors.most_common()),
        "request_throughput": round(len(ok) / elapsed_s, 3) if elapsed_s > 0 else 0.0,
        "output_token_throughput": round(output_tokens / elapsed_s, 3) if elapsed_s > 0 else 0.0,
        "input_token_throughput": round(input_tokens / elapsed_s, 3) if elapsed_s > 0 else 0.0,
        "total_output_tokens": output_tokens,
        "total_input_tokens": input_tokens,
        "prefix_cache_hit_rate": _cache_hit_rate(ok),
        "worker_share": _worker_share(ok),
        **_latencies(ok),
    }
