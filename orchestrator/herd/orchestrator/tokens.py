"""Prompt token ids for routing, rendered exactly as the worker renders them (``herd.api.prompt``)."""

from __future__ import annotations

from herd.api.openai import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from herd.api.prompt import PromptRenderer

__all__ = ["prompt_token_ids"]


def prompt_token_ids(
    renderer: PromptRenderer,
    request: ChatCompletionRequest | CompletionRequest | EmbeddingRequest,
    *,
    max_model_len: int | None = None,
) -> list[int]:
    """The token ids of a chat or text completion request (the first prompt of a batch), or of an
    embeddings request's first input.

    Raises ``PromptError`` for a prompt the template cannot render or ids outside the vocabulary, and
    with ``max_model_len`` ``LengthError`` for a prompt that leaves no room for output.
    """
    if isinstance(request, ChatCompletionRequest):
        return renderer.chat_request_ids(request, max_model_len=max_model_len)
    if isinstance(request, EmbeddingRequest):
        return renderer.prompt_ids(request.input, param="input")[0]
    return renderer.completion_request_ids(request, max_model_len=max_model_len)[0]
