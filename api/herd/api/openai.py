"""OpenAI wire models: requests, responses, stream chunks and the error envelope.

Requests are tolerant (``extra="allow"``): real clients (the openai SDK, guidellm, aiperf) send
fields herd does not use, and rejecting them would break those clients. Values herd does use are
validated strictly, so a bad one is a 400 that names the field.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "ChatChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "ChunkChoice",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionResponse",
    "DeltaMessage",
    "EmbeddingData",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "EmbeddingUsage",
    "ErrorBody",
    "ErrorResponse",
    "LengthError",
    "Logprobs",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "SamplingFields",
    "StreamOptions",
    "TextPart",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "new_request_id",
    "now",
    "prompt_too_long",
]


def new_request_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


_TOKEN_ID = re.compile(r"-?[0-9]+")
_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})
"""What the chat template is rendered with already; a second value for one would be a TypeError."""


class _Tolerant(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class StreamOptions(_Tolerant):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Tolerant):
    """The sampling and stopping fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"logit_bias keys must be token ids (decimal integers), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must lie in [-100, 100], got {bias}")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("stop accepts at most 16 strings")
        return value

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def output_limit(self) -> int | None:
        """``max_completion_tokens`` wins over the older ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def output_budget(self, num_prompt_tokens: int, max_model_len: int, *, prompt_param: str) -> int:
        """The tokens this request may generate: what it asks for, else all the room the context leaves.

        The gateway and the worker both apply this one rule; ``LengthError`` names the field to change.
        """
        room = max_model_len - num_prompt_tokens
        if room < 1:
            raise prompt_too_long(num_prompt_tokens, max_model_len, prompt_param=prompt_param)
        wanted = self.output_limit
        if wanted is None:
            return room
        if wanted > room:
            field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
            raise LengthError(
                f"{num_prompt_tokens} prompt tokens plus {field}={wanted} exceed this model's maxModelLen "
                f"of {max_model_len}; ask for at most {room} tokens",
                param=field,
            )
        return wanted


class LengthError(ValueError):
    """A request that does not fit the model's context; ``param`` names the field to change (HTTP 400)."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


def prompt_too_long(num_prompt_tokens: int, max_model_len: int, *, prompt_param: str) -> LengthError:
    return LengthError(
        f"the prompt has {num_prompt_tokens} tokens but this model's maxModelLen is {max_model_len} "
        "(prompt plus output); shorten the prompt",
        param=prompt_param,
    )


class TextPart(_Tolerant):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(_Tolerant):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        """The content as one string; list-of-parts content is joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must hold at least one message")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if reserved := sorted(_TEMPLATE_VARIABLES.intersection(value or {})):
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: herd sets them")
        return value

    @model_validator(mode="after")
    def _check_top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """How many alternatives to return per token, or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


MAX_EMBEDDING_INPUTS = 2048
"""Inputs one embeddings request may carry (OpenAI's limit)."""


class EmbeddingRequest(_Tolerant):
    """``/v1/embeddings``: one text or token list, or a batch of them; ``dimensions`` asks for a
    shorter vector where the model was trained for it (Matryoshka)."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _check_input(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if value == "" or (isinstance(value, list) and not value):
            raise ValueError("input must not be empty")
        if isinstance(value, list) and len(value) > MAX_EMBEDDING_INPUTS:
            raise ValueError(
                f"input holds {len(value)} items; send at most {MAX_EMBEDDING_INPUTS} per request"
            )
        if isinstance(value, list) and any(item == "" or item == [] for item in value):
            raise ValueError("input items must not be empty")
        return value

    @property
    def stream(self) -> bool:
        """Embeddings never stream (what a gateway asks of every request)."""
        return False

    @property
    def cache_salt(self) -> str | None:
        return None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str
    """The vector, or with ``encoding_format: base64`` its little-endian float32 bytes in base64."""


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class Logprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: Logprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Logprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "herd"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
    "service_unavailable",
]


class ErrorBody(BaseModel):
    message: str
    type: ErrorType
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody

    @classmethod
    def of(cls, status: int, message: str, *, param: str | None = None) -> ErrorResponse:
        return cls(
            error=ErrorBody(
                message=message, type=_ERROR_TYPES.get(status, "server_error"), param=param, code=status
            )
        )


_ERROR_TYPES: dict[int, ErrorType] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
