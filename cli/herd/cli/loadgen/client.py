"""Sending one streaming OpenAI request and timing it.

TTFT is the time to the first chunk that carries text; ITL the gaps between text chunks (one
token each on OpenAI-style servers); token counts come from the final ``usage`` chunk
(``stream_options.include_usage``), falling back to the number of text chunks when a server omits it.
A chunk that does not have the shape of OpenAI's fails its request, never the run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import BaseModel, Field, ValidationError

from herd.api.protocol import WORKER_HEADER
from herd.cli.loadgen.config import BenchConfig
from herd.cli.loadgen.problems import first_problem
from herd.cli.loadgen.workloads import RequestSpec

__all__ = ["RequestResult", "build_body", "path_for", "send"]


@dataclass(slots=True)
class RequestResult:
    """One request's outcome; times in seconds from when it was sent."""

    start: float
    e2e: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    worker: str | None = None
    error: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def num_output_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_times)


def path_for(config: BenchConfig) -> str:
    return "/v1/chat/completions" if config.api == "chat" else "/v1/completions"


def build_body(spec: RequestSpec, config: BenchConfig, model: str) -> dict[str, Any]:
    """The JSON body; ``ignore_eos``, ``stream_options`` and extra fields only when configured."""
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "stream": True}
    if config.api == "chat":
        body["messages"] = spec.messages
    else:
        body["prompt"] = "\n\n".join(message["content"] for message in spec.messages)
    if config.include_usage:
        body["stream_options"] = {"include_usage": True}
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body | config.extra_body


async def send(
    client: httpx.AsyncClient, spec: RequestSpec, config: BenchConfig, model: str
) -> RequestResult:
    result = RequestResult(start=time.perf_counter())
    try:
        body = build_body(spec, config, model)
        async with client.stream("POST", path_for(config), json=body, headers=spec.headers) as response:
            result.worker = response.headers.get(WORKER_HEADER)
            if response.status_code != 200:
                result.error = _http_error(response.status_code, await response.aread())
            else:
                await _read_stream(response, result)
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    except ValueError as error:
        result.error = f"malformed stream chunk: {error}"
    result.e2e = time.perf_counter() - result.start
    return result


class _Delta(BaseModel):
    content: str | None = None


class _Choice(BaseModel):
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None


class _TokenDetails(BaseModel):
    cached_tokens: int | None = Field(default=None, ge=0)


class _Usage(BaseModel):
    prompt_tokens: int | None = Field(default=None, ge=0)
    completion_tokens: int | None = Field(default=None, ge=0)
    prompt_tokens_details: _TokenDetails | None = None


class _Chunk(BaseModel):
    """The fields of a chat or text completion chunk that a run reads; servers add others."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


async def _read_stream(response: httpx.Response, result: RequestResult) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        try:
            chunk = _Chunk.model_validate_json(data)
        except ValidationError as error:
            raise ValueError(first_problem(error)) from None  # never the value: like failures count as one
        _apply_chunk(chunk, result)
        if result.error is not None:
            return
    # Some servers (transformers serve) end a complete answer without the [DONE] line.
    if result.finish_reason is None:
        result.error = "the stream closed before [DONE]: the server or the connection failed mid-answer"


def _apply_chunk(chunk: _Chunk, result: RequestResult) -> None:
    if "error" in chunk.model_fields_set:
        error = chunk.error
        result.error = f"stream error: {error.get('message', error) if isinstance(error, dict) else error}"
        return
    for choice in chunk.choices or ():
        text = (choice.delta.content if choice.delta else None) or choice.text or ""
        if text:
            result.chunk_times.append(time.perf_counter() - result.start)
            result.text += text
        result.finish_reason = choice.finish_reason or result.finish_reason
    usage = chunk.usage
    if usage is not None and usage.model_fields_set:  # an empty usage object keeps the counts read
        result.prompt_tokens = usage.prompt_tokens
        result.output_tokens = usage.completion_tokens
        # A server that reports no cache details has an unknown hit rate, not a zero one.
        details = usage.prompt_tokens_details
        result.cached_tokens = details.cached_tokens if details else None


def _http_error(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:200]
    return f"HTTP {status}: {message}"
