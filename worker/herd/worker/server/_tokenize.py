"""``/tokenize`` and ``/detokenize`` bodies (vLLM's shapes)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

from herd.api.openai import ChatMessage

__all__ = ["DetokenizeRequest", "DetokenizeResponse", "TokenizeRequest", "TokenizeResponse"]


class _Tolerant(BaseModel):
    model_config = ConfigDict(extra="allow")


class TokenizeRequest(_Tolerant):
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Tolerant):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
