"""OpenAI wire models: requests, responses, stream chunks and the error envelope.

Requests are tolerant (``extra="allow"``): real clients (the openai SDK, guidellm, aiperf) send
fields herd does not use, and rejecting them would break those clients. Values herd does use are
validated strictly, so a bad one is a 400 that names the field.

Nothing the OpenAI API defines is dropped silently: every field of its chat and text completion
requests is declared here and either honoured, refused with a 400 naming it unless it holds its
neutral value (``REFUSED_FIELDS``), or, when OpenAI defines it as a hint about billing, caching,
latency or identity that never changes the output, accepted with its type checked (``HINT_FIELDS``).
Fields the API does not define are ignored, as before.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

__all__ = [
    "HINT_FIELDS",
    "REFUSED_FIELDS",
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
    "FunctionCall",
    "FunctionCallDelta",
    "FunctionDefinition",
    "JsonSchemaFormat",
    "LengthError",
    "LoadLoraAdapterRequest",
    "Logprobs",
    "ModelCard",
    "ModelList",
    "NamedToolChoice",
    "PromptTokensDetails",
    "ResponseFormat",
    "SamplingFields",
    "StreamOptions",
    "StructuredOutputs",
    "TextPart",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
    "UnloadLoraAdapterRequest",
    "Usage",
    "new_request_id",
    "now",
    "prompt_too_long",
]


def new_request_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


_TOKEN_ID = re.compile(r"-?[0-9]{1,19}")
"""A token id as a ``logit_bias`` key: an integer a 64-bit id holds (the vocabulary bounds it later)."""
_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
        *("range", "dict", "lipsum", "cycler", "joiner", "namespace"),
    }
)
"""What the chat template is rendered with already (a second value for one would be a TypeError) and
the functions it may call (herd's and Jinja's own globals): a request's value would replace one."""


def _is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (a lone surrogate does not)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class _Tolerant(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class _Prioritized(_Tolerant):
    priority: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)
    """vLLM's field: smaller is served first. herd's gateway never lets it above the tenant's."""


class StreamOptions(_Tolerant):
    include_usage: bool = False
    continuous_usage_stats: bool = False


MAX_CHOICES = 1024
"""Strings in a ``structured_outputs.choice`` list."""
MAX_TOOLS = 128
"""Tools in one request (OpenAI's own limit)."""


class JsonSchemaFormat(_Tolerant):
    """``response_format.json_schema``: the schema the output must validate against."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Tolerant):
    """OpenAI's ``response_format``: free ``text``, any ``json_object``, or one ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object ({name, schema, strict})")
        return self


class StructuredOutputs(BaseModel):
    """herd's extension, in vLLM's shape: exactly one constraint on the output's text.

    ``json`` is a JSON schema, ``regex`` a regular expression (Rust ``regex`` syntax), ``choice``
    a list of strings the output must equal one of, ``grammar`` a Lark grammar (llguidance's
    dialect; GBNF is converted).
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _check_one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("set exactly one of json, regex, choice or grammar")
        return self


class SamplingFields(_Prioritized):
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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("structured_outputs")
    @classmethod
    def _check_one_constraint(
        cls, value: StructuredOutputs | None, info: ValidationInfo
    ) -> StructuredOutputs | None:
        response_format = info.data.get("response_format")
        if value is not None and response_format is not None and response_format.type != "text":
            raise ValueError("send either response_format or structured_outputs, not both")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"logit_bias keys must be token ids (decimal integers), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must lie in [-100, 100], got {bias}")
        return value

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, value: str | None) -> str | None:
        if value is not None and not _is_utf8(value):
            raise ValueError(
                "cache_salt holds a lone UTF-16 surrogate (a JSON \\ud800 escape); send UTF-8 text"
            )
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


REFUSED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "audio": ((None,), "herd generates text only"),
    "functions": ((None, []), "functions is deprecated: send tools"),
    "function_call": ((None,), "function_call is deprecated: send tool_choice"),
    "modalities": ((None, ["text"]), 'herd generates text only: send modalities ["text"] or leave it out'),
    "moderation": ((None,), "herd runs no moderation"),
    "reasoning_effort": ((None,), "herd's models have no reasoning-effort setting"),
    "verbosity": ((None,), "herd's models have no verbosity setting"),
    "web_search_options": ((None,), "herd has no web search"),
    "store": ((None, False), "herd stores no completions"),
    "best_of": ((None, 1), "herd returns every sequence it generates: use n"),
    "echo": ((None, False), "herd does not echo the prompt"),
    "suffix": ((None,), "herd has no insertion (suffix) mode"),
}
"""OpenAI request fields herd refuses (HTTP 400 naming the field) unless they hold one of the
neutral values listed, with the reason the message gives."""

HINT_FIELDS = frozenset(
    {
        "metadata",
        "prediction",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "safety_identifier",
        "service_tier",
        "user",
    }
)
"""OpenAI request fields that OpenAI defines as hints: identity, billing tier, caching, latency or
stored-completion tags. None changes the output, so herd accepts them with their types checked and
acts on none (its prefix cache needs no key, it has one tier, stores nothing)."""


def _refuse_unless_neutral(cls: Any, value: Any, info: ValidationInfo) -> Any:
    field = info.field_name or ""
    neutral, reason = REFUSED_FIELDS[field]
    if value not in neutral:
        raise ValueError(f"{reason}; leave {field} out")
    return value


class _Hints(_Tolerant):
    """The hint fields both routes share (``HINT_FIELDS``)."""

    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None


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


class FunctionDefinition(_Tolerant):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Tolerant):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Tolerant):
    name: str


class NamedToolChoice(_Tolerant):
    type: Literal["function"]
    function: _FunctionName


class FunctionCall(_Tolerant):
    name: str
    arguments: str
    """The arguments as a JSON text (an object), as OpenAI sends them."""


class ToolCall(_Tolerant):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatMessage(_Tolerant):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        """The content as one string; list-of-parts content is joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields, _Hints):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    moderation: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None

    _refuse = field_validator(
        "audio",
        "functions",
        "function_call",
        "modalities",
        "moderation",
        "reasoning_effort",
        "verbosity",
        "web_search_options",
        "store",
    )(_refuse_unless_neutral)

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(
        cls, value: str | NamedToolChoice | None, info: ValidationInfo
    ) -> str | NamedToolChoice | None:
        tools: list[Tool] = info.data.get("tools") or []
        if value in (None, "none"):
            return value
        if not tools:
            raise ValueError("tool_choice needs tools: send the tools the model may call")
        if isinstance(value, NamedToolChoice) and value.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"tool_choice names {value.function.name!r}, which is not among the tools")
        constrained = info.data.get("response_format") or info.data.get("structured_outputs")
        if value != "auto" and constrained is not None and getattr(constrained, "type", "") != "text":
            raise ValueError(
                "a required or named tool_choice fixes the output's form; leave response_format out"
            )
        return value

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice`` with OpenAI's default: ``auto`` when there are tools, else ``none``."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

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
            raise ValueError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: the chat template's own names"
            )
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


class CompletionRequest(SamplingFields, _Hints):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    _refuse = field_validator("echo", "suffix", "best_of")(_refuse_unless_neutral)

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


class EmbeddingRequest(_Prioritized):
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
    tool_calls: list[ToolCallDelta] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: Logprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Logprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None


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
    """A served model; a LoRA adapter names its base model in ``parent`` and its folder in ``root``
    (vLLM's fields)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "herd"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$"
"""A LoRA adapter's name, which requests send as their ``model``."""


class LoadLoraAdapterRequest(_Tolerant):
    """vLLM's ``POST /v1/load_lora_adapter`` body: the adapter's name and its PEFT folder on the worker."""

    lora_name: str = Field(pattern=LORA_NAME_PATTERN)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(_Tolerant):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: str = Field(pattern=LORA_NAME_PATTERN)


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
        return cls(error=ErrorBody(message=message, type=_error_type(status), param=param, code=status))


_ERROR_TYPES: dict[int, ErrorType] = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def _error_type(status: int) -> ErrorType:
    """OpenAI's error type for a status: any other 4xx (a 409 conflict) is the request's fault."""
    return _ERROR_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "server_error")
