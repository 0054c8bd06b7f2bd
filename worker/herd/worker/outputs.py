"""What the engine reports after each step, per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["FinishReason", "RequestOutput", "TokenLogprob"]

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability and the ``k`` most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """Progress of one request in one engine step.

    ``new_text`` is the detokenized delta of ``new_token_ids`` with stop strings removed; it may lag
    the tokens by a few bytes while a multi-byte character is incomplete.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] | None = None
    held_block_ids: list[int] | None = None
    """On the last output of a ``hold_prompt_blocks`` request: the prompt blocks still held."""
    is_resumed: bool = False
    """The output tokens of a resumed stream (``herd.api.resume``), which its client already has:
    parsers take their text, nothing is streamed for them."""
    embedding: list[float] | None = None
    """An embedding model's pooled vector, on its only (finished) output."""
    error: str | None = None
    """Set on the last output of a request the engine failed (``finished``, reason ``abort``): what
    went wrong, for its client. Other requests are unaffected."""
    error_param: str | None = None
    """With ``error``, when the request's own field failed (a grammar past its resource limits): the
    field, for a 400 that names it rather than a 500."""
