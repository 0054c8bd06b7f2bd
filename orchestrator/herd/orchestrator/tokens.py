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
        chat = ChatCompletionRequest.model_validate(payload)
        messages = [{"role": message.role, "content": message.text} for message in chat.messages]
        return renderer.encode_chat(
            messages,
            add_generation_prompt=chat.add_generation_prompt,
            template_kwargs=chat.chat_template_kwargs,
        )
    prompt = CompletionRequest.model_validate(payload).prompt
    first: Any = prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], str | list) else prompt
    if isinstance(first, str):
        return renderer.encode(first)
    return [int(token) for token in first]
