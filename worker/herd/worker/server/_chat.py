"""``/v1/chat/completions`` bodies: the whole response, or the stream of chunks."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from herd.api.openai import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessage,
    ChunkChoice,
    DeltaMessage,
    Logprobs,
)
from herd.worker.outputs import FinishReason, RequestOutput, TokenLogprob
from herd.worker.server._logprobs import chat_logprobs
from herd.worker.server._params import Choice
from herd.worker.server._responses import ResponseContext
from herd.worker.server._sse import DONE, event

__all__ = ["chat_chunks", "chat_response"]


@dataclass
class _Collected:
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None

    def add(self, output: RequestOutput) -> None:
        self.parts.append(output.new_text)
        if output.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *output.logprobs]
        self.finish_reason = output.finish_reason


async def chat_response(context: ResponseContext) -> ChatCompletionResponse:
    generation = context.generation
    collected = {choice.index: _Collected() for choice in generation.choices}
    async with aclosing(generation.outputs()) as outputs:
        async for choice, output in outputs:
            collected[choice.index].add(output)
    choices = [
        ChatChoice(
            index=index,
            message=ChatMessage(role="assistant", content="".join(item.parts)),
            logprobs=None if item.logprobs is None else chat_logprobs(context.renderer, item.logprobs),
            finish_reason=item.finish_reason,
        )
        for index, item in collected.items()
    ]
    return ChatCompletionResponse(
        id=context.id, created=context.created, model=context.model, choices=choices, usage=generation.usage()
    )


async def chat_chunks(
    context: ResponseContext, outputs: AsyncGenerator[tuple[Choice, RequestOutput], None]
) -> AsyncGenerator[str, None]:
    """A role chunk per choice, content chunks, a finish chunk per choice, the usage, ``[DONE]``."""
    async with aclosing(outputs):
        for choice in context.generation.choices:
            yield _chunk(context, choice.index, DeltaMessage(role="assistant", content=""))
        async for choice, output in outputs:
            if output.new_text or output.logprobs:
                logprobs = chat_logprobs(context.renderer, output.logprobs) if output.logprobs else None
                yield _chunk(context, choice.index, DeltaMessage(content=output.new_text), logprobs=logprobs)
            if output.finished:
                yield _chunk(context, choice.index, DeltaMessage(), finish_reason=output.finish_reason)
    if context.include_usage:
        usage = context.generation.usage()
        yield event(
            ChatCompletionChunk(
                id=context.id, created=context.created, model=context.model, choices=[], usage=usage
            )
        )
    yield DONE


def _chunk(
    context: ResponseContext,
    index: int,
    delta: DeltaMessage,
    *,
    logprobs: Logprobs | None = None,
    finish_reason: FinishReason | None = None,
) -> str:
    choice = ChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
    return event(
        ChatCompletionChunk(id=context.id, created=context.created, model=context.model, choices=[choice])
    )
