"""The gateway's access log: one structured line per request on the ``herd.access`` logger.

Each line names who asked (tenant, request id), what (model, route, stream or not), who served it
(the worker, how many times the stream was resumed on another one), what it cost (prompt and output
tokens) and how it went (status, time to first token, total time); a stream the SLO-aware choice
routed adds what it predicted against what followed (``slo_note``). The prompt's text is left out
unless the orchestrator runs with ``--access-log-prompts``: prompts hold what users typed. The
logger writes at INFO even when the process logs at WARNING (``enable_access_log``); it is a record
of traffic, not a diagnostic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from herd.orchestrator.admission.usage import Usage
from herd.orchestrator.routing.latency import LatencyFeatures

__all__ = ["ACCESS_LOGGER", "AccessEntry", "enable_access_log", "slo_note"]

ACCESS_LOGGER = "herd.access"
_log = logging.getLogger(ACCESS_LOGGER)


def enable_access_log(is_enabled: bool = True) -> None:
    """Write access lines whatever the process's log level (or none at all)."""
    _log.setLevel(logging.INFO if is_enabled else logging.CRITICAL + 1)


def slo_note(features: LatencyFeatures, predicted_ttft: float, observed_ttft: float) -> dict[str, float]:
    """The ``slo`` field: the features the choice saw on its worker, the TTFT it predicted there and
    the TTFT that followed (from sending to the first chunk, what the latency fit learns from)."""
    return {
        "queued_prefill_tokens": features.queued_prefill_tokens,
        "batch": features.batch,
        "uncached_prompt_tokens": features.uncached_prompt_tokens,
        "predicted_ttft_ms": round(predicted_ttft * 1000, 3),
        "observed_ttft_ms": round(observed_ttft * 1000, 3),
    }


@dataclass(frozen=True, slots=True)
class AccessEntry:
    """One request as it ended."""

    request_id: str | None
    tenant: str
    model: str | None
    """None when the request was refused before its model was known (a bad body, say)."""
    route: str
    status: int
    seconds: float
    worker: str | None = None
    is_stream: bool = False
    usage: Usage | None = None
    ttft: float | None = None
    num_resumes: int = 0
    slo: dict[str, float] | None = None
    """``slo_note`` of a stream the SLO-aware choice routed."""
    prompt: Any = None
    """The messages or prompt, only when asked for (``--access-log-prompts``)."""

    def fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "model": self.model,
            "route": self.route,
            "stream": self.is_stream,
            "worker": self.worker,
            "status": self.status,
            "prompt_tokens": None if self.usage is None else self.usage.prompt_tokens,
            "completion_tokens": None if self.usage is None else self.usage.completion_tokens,
            "ttft_ms": None if self.ttft is None else round(self.ttft * 1000, 3),
            "duration_ms": round(self.seconds * 1000, 3),
            "resumes": self.num_resumes,
        }
        if self.slo is not None:
            fields["slo"] = self.slo
        if self.prompt is not None:
            fields["prompt"] = self.prompt
        return fields

    def log(self) -> None:
        if _log.isEnabledFor(logging.INFO):
            _log.info("request", extra=self.fields())
