"""Prompt token ids for routing, rendered exactly as the worker renders them (``herd.api.prompt``)."""

from __future__ import annotations

from herd.api.openai import ChatCompletionRequest, CompletionRequest
from herd.api.prompt import PromptRenderer

__all__ = ["prompt_token_ids"]


def prompt_token_ids(
    renderer: PromptRenderer,
    request: ChatCompletionRequest | CompletionRequest,
    *,
    max_model_len: int | None = None,
) -> list[int]:
    """The token ids of a chat or text completion request (the first prompt of a batch).

    Raises ``PromptError`` for a prompt the template cannot render or ids outside the vocabulary, and
    with ``max_model_len`` ``LengthError`` for a prompt that leaves no room for output.
    """
    if isinstance(request, ChatCompletionRequest):
        return renderer.chat_request_ids(request, max_model_len=max_model_len)
    return renderer.completion_request_ids(request, max_model_len=max_model_len)[0]
