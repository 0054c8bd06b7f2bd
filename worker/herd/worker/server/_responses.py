"""What every response of one request shares: its id, model name, timestamp and options."""

from __future__ import annotations

from dataclasses import dataclass, field

from herd.api.openai import NamedToolChoice, now
from herd.api.prompt import PromptRenderer
from herd.worker.server._generation import Generation

__all__ = ["ResponseContext"]


@dataclass(frozen=True)
class ResponseContext:
    id: str
    model: str
    renderer: PromptRenderer
    generation: Generation
    include_usage: bool = False
    created: int = field(default_factory=now)
    tool_choice: str | NamedToolChoice = "none"
    """Chat only: how the text becomes tool calls (``_tool_calls``)."""
    has_marks: bool = False
    """Close each output's events with a resume mark (``herd.api.resume``): herd's gateway asked."""
    is_opened: bool = False
    """A resumed stream whose opening events (chat's role chunks) its client already has."""
