"""Resuming a stream on another worker: the marks a worker streams and the continuation it takes.

herd's gateway asks a worker for a resumable stream with ``RESUMABLE_HEADER`` (and the internal
token). A worker that can resume answers with the same header and, after the SSE events it wrote for
each engine output, one comment event (``mark``) naming the choice, the output token ids that output
consumed and whether the choice finished. SSE clients ignore comment lines, and the gateway takes
them out anyway. The events before a mark and the mark form one unit: the gateway sends the client
the events only once their mark has come, so what the client has seen is always exactly the text of
whole token runs.

When the worker's connection breaks mid-stream, the gateway sends the same request to another worker
with ``RESUME_FIELD`` (``ResumeParams``): per choice the output token ids already sent and whether it
finished, plus the stream's ``created`` time; with the same ``X-Request-Id`` the response id is the
same too. That worker appends the tokens to the sequence without streaming them again (its penalties,
``min_tokens`` and ``max_tokens`` budgets, stop-string window, seeded generator and grammar matcher
advance over them as over tokens it sampled itself), skips the stream's opening events, and goes on.
Only a request carrying the internal token may resume: the tokens become the model's own output.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MARK_PREFIX",
    "RESUMABLE_HEADER",
    "RESUME_FIELD",
    "Mark",
    "ResumeChoice",
    "ResumeParams",
    "mark",
    "parse_mark",
]

RESUMABLE_HEADER = "X-Herd-Resumable"
"""On a request from the gateway: stream with marks. On the worker's answer: the marks are there."""
RESUME_FIELD = "herd_resume"
"""The request body field of a continuation (``ResumeParams``)."""
MARK_PREFIX = b": herd-mark "


@dataclass(frozen=True, slots=True)
class Mark:
    """One engine output of one choice: the token ids it consumed; ``is_finished`` on its last."""

    index: int
    token_ids: tuple[int, ...]
    is_finished: bool


def mark(index: int, token_ids: Sequence[int], *, is_finished: bool) -> str:
    """The SSE comment event that closes one output's events (``Mark``)."""
    payload = json.dumps([index, list(token_ids), int(is_finished)], separators=(",", ":"))
    return f"{MARK_PREFIX.decode()}{payload}\n\n"


def parse_mark(event: bytes) -> Mark | None:
    """The mark in one SSE event (without its blank line), or None when it is not one."""
    if not event.startswith(MARK_PREFIX):
        return None
    try:
        index, token_ids, finished = json.loads(event[len(MARK_PREFIX) :])
        return Mark(int(index), tuple(int(token) for token in token_ids), bool(finished))
    except (ValueError, TypeError):
        return None


class ResumeChoice(BaseModel):
    """Where one choice of the stream stands: the output token ids its client has, finished or not."""

    model_config = ConfigDict(extra="forbid")
    index: int = Field(ge=0)
    token_ids: list[int] = Field(default_factory=list)
    is_finished: bool = False


class ResumeParams(BaseModel):
    """``herd_resume``: continue a stream another worker started (the internal token required)."""

    model_config = ConfigDict(extra="forbid")
    created: int | None = None
    """The stream's ``created`` time, kept on every chunk; None when no chunk reached the client."""
    choices: list[ResumeChoice] = Field(default_factory=list)
    """Choices with tokens sent or finished; a choice not listed starts from its prompt."""
