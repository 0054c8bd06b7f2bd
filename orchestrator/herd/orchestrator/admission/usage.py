"""How many tokens an answer used, read from the bytes the gateway relays (no extra parse per chunk).

A whole answer carries ``usage``. A stream carries it in its last event only when the client asked
(``stream_options.include_usage``); otherwise each ``data:`` event that holds a choice counts as one
output token, which is what a herd or vLLM worker sends (one event per decoded token, fewer when a
stop string held text back, so the count errs low by at most the tokens held at once).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["StreamTally", "Usage", "usage_of"]

_EVENT = b"data: {"
_USAGE = b'"completion_tokens"'


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def usage_of(content: bytes) -> Usage | None:
    """The ``usage`` of a JSON answer (or of one SSE event's JSON), when it has one."""
    try:
        usage = json.loads(content).get("usage")
        return Usage(int(usage["prompt_tokens"]), int(usage["completion_tokens"]))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


class StreamTally:
    """Counts a stream's events as they pass and keeps the usage event when one comes."""

    def __init__(self) -> None:
        self.num_events = 0
        self.usage: Usage | None = None

    def observe(self, chunk: bytes) -> None:
        self.num_events += chunk.count(_EVENT)
        if _USAGE in chunk:
            for line in chunk.split(b"\n"):
                if _USAGE in line and line.startswith(b"data: "):
                    self.usage = usage_of(line[len(b"data: ") :]) or self.usage

    def total(self, num_prompt_tokens: int) -> Usage:
        """The stream's usage event, else ``num_prompt_tokens`` and the events seen less the first
        (a chat stream's role event)."""
        if self.usage is not None:
            return self.usage
        return Usage(num_prompt_tokens, max(self.num_events - 1, 0))
