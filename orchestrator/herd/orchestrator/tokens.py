"""Prompt token ids for routing, rendered exactly as the worker renders them (``herd.api.prompt``)."""

from __future__ import annotations

from typing import Any

from herd.api.openai import ChatCompletionRequest, CompletionRequest
from herd.api.prompt import PromptRenderer

__all__ = ["prompt_token_ids"]


def prompt_token_ids(renderer: PromptRenderer, payload: dict[str, Any]) -> list[int]:
    """The token ids of a chat or text completion request (the first prompt of a batch).

    Raises ``ValueError`` (pydantic's ``ValidationError`` or ``PromptError``) for a malformed request.
    """
    if "messages" in payload:
        return renderer.chat_request_ids(ChatCompletionRequest.model_validate(payload))
    return renderer.completion_request_ids(CompletionRequest.model_validate(payload))[0]
