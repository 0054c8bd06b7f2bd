"""The human-readable table of a report (the JSON is the report itself)."""

from __future__ import annotations

from typing import Any

__all__ = ["format_table"]

_LATENCIES = [("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms")]


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"model {report['model']}  duration {report['duration_s']:.1f}s  "
        f"requests {report['num_completed']}/{report['num_requests']} ok, {report['num_errors']} errors",
        f"throughput  {report['request_throughput']:.2f} req/s  "
        f"{report['output_token_throughput']:.1f} output tok/s  {report['input_token_throughput']:.1f} input tok/s",
        f"prefix cache hit rate  {_percent(report['prefix_cache_hit_rate'])}",
        "",
        f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for label, key in _LATENCIES:
        summary = report[key]
        cells = (
            [f"{summary[k]:>10.1f}" for k in ("mean", "p50", "p90", "p99")] if summary else [f"{'-':>10}"] * 4
        )
        lines.append(f"{label:<14}" + "".join(cells))
    lines += _shares(report["worker_share"]) + _errors(report["errors"])
    return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "n/a (no usage.prompt_tokens_details)" if value is None else f"{value:.1%}"


def _shares(shares: dict[str, float]) -> list[str]:
    if not shares:
        return []
    return ["", "worker share"] + [f"  {worker:<40}{share:>8.1%}" for worker, share in shares.items()]


def _errors(errors: dict[str, int]) -> list[str]:
    if not errors:
        return []
    return ["", "errors"] + [f"  {count:>6}  {message}" for message, count in errors.items()]
