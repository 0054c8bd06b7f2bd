"""A request's latency targets, from its headers (the names llm-d's SLO-aware routing reads).

``x-slo-ttft-ms`` and ``x-slo-tpot-ms`` set the time to first token and the time per output token
the request wants, in milliseconds; ``x-slo-policy`` says what happens when no worker is predicted
to meet them (``SloMiss``: ``route``, ``queue``, ``lower`` or ``refuse``; the gateway's default
otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import get_args

from herd.api.errors import HttpError
from herd.orchestrator.routing._types import SloMiss, SloTarget

__all__ = ["SLO_POLICY_HEADER", "SLO_TPOT_HEADER", "SLO_TTFT_HEADER", "has_slo_headers", "slo_target"]

SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"
SLO_POLICY_HEADER = "x-slo-policy"
_POLICIES: tuple[SloMiss, ...] = get_args(SloMiss)


def has_slo_headers(headers: Mapping[str, str]) -> bool:
    """The request sets a latency target (valid or not: ``slo_target`` judges the value)."""
    return SLO_TTFT_HEADER in headers or SLO_TPOT_HEADER in headers


def slo_target(headers: Mapping[str, str], default: SloMiss) -> SloTarget | None:
    """The request's targets, ``None`` when it sets none; 400 naming the header of a bad value."""
    ttft = _milliseconds(headers, SLO_TTFT_HEADER)
    tpot = _milliseconds(headers, SLO_TPOT_HEADER)
    if ttft is None and tpot is None:
        return None
    policy = headers.get(SLO_POLICY_HEADER, default).strip().lower()
    for known in _POLICIES:
        if policy == known:
            return SloTarget(ttft, tpot, known)
    raise HttpError(400, f"{SLO_POLICY_HEADER} must be one of {', '.join(_POLICIES)}, got {policy!r:.40}")


def _milliseconds(headers: Mapping[str, str], name: str) -> float | None:
    value = headers.get(name)
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise HttpError(400, f"{name} must be a positive number of milliseconds, got {value!r:.40}")
    return number / 1000.0
