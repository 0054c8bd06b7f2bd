"""``/v1/chat/completions`` bodies: the whole response, or the stream of chunks.

Each choice's text goes through a ``ToolCallParser`` (``_tool_calls``): content and tool calls
come out of it, and a choice that called a tool and stopped ends with ``finish_reason`` ``tool_calls``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Literal

from herd.api.openai import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessage,
    ChunkChoice,
    DeltaMessage,
    FunctionCall,
    Logprobs,
    ToolCall,
    ToolCallDelta,
)
from herd.api.resume import mark
from herd.worker.outputs import FinishReason, RequestOutput, TokenLogprob
from herd.worker.server._logprobs import chat_logprobs
from herd.worker.server._params import Choice
from herd.worker.server._responses import ResponseContext
from herd.worker.server._sse import DONE, event
from herd.worker.server._tool_calls import Event, ToolCallParser

__all__ = ["chat_chunks", "chat_response"]

ChatFinish = Literal["stop", "length", "abort", "tool_calls"]


def _parser(context: ResponseContext) -> ToolCallParser:
    return ToolCallParser.for_choice(context.tool_choice, context.renderer.tool_format)


def _events(parser: ToolCallParser, output: RequestOutput) -> list[Event]:
    events = parser.feed(output.new_text)
    return [*events, *parser.close()] if output.finished else events


def _finish(parser: ToolCallParser, reason: FinishReason | None) -> ChatFinish | None:
    return "tool_calls" if reason == "stop" and parser.num_calls else reason


@dataclass
class _Collected:
    parser: ToolCallParser
    parts: list[str] = field(default_factory=list)
    calls: dict[int, ToolCall] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: ChatFinish | None = None

    def add(self, output: RequestOutput) -> None:
        for item in _events(self.parser, output):
            if isinstance(item, str):
                self.parts.append(item)
            else:
                self._merge(item)
        if output.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *output.logprobs]
        self.finish_reason = _finish(self.parser, output.finish_reason)

    def _merge(self, delta: ToolCallDelta) -> None:
        call = self.calls.get(delta.index)
        if call is None:
            self.calls[delta.index] = ToolCall(
                id=delta.id or "",
                function=FunctionCall(
                    name=delta.function.name or "", arguments=delta.function.arguments or ""
                ),
            )
        else:
            call.function.arguments += delta.function.arguments or ""

    def message(self) -> ChatMessage:
        content = "".join(self.parts)
        if not self.calls:
            return ChatMessage(role="assistant", content=content)
        calls = [self.calls[index] for index in sorted(self.calls)]
        return ChatMessage(role="assistant", content=content.strip() or None, tool_calls=calls)


async def chat_response(context: ResponseContext) -> ChatCompletionResponse:
    generation = context.generation
    collected = {choice.index: _Collected(_parser(context)) for choice in generation.choices}
    async with aclosing(generation.outputs()) as outputs:
        async for choice, output in outputs:
            collected[choice.index].add(output)
    choices = [
        ChatChoice(
            index=index,
            message=item.message(),
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
    """A role chunk per choice, content and tool-call chunks, a finish chunk per choice, the usage,
    ``[DONE]``."""
    parsers = {choice.index: _parser(context) for choice in context.generation.choices}
    async with aclosing(outputs):
        if not context.is_opened:
            for choice in context.generation.choices:
                yield _chunk(context, choice.index, DeltaMessage(role="assistant", content=""))
        async for choice, output in outputs:
            parser = parsers[choice.index]
            if output.is_resumed:
                _events(parser, output)  # its client has these: the parser only catches up
                continue
            logprobs = chat_logprobs(context.renderer, output.logprobs) if output.logprobs else None
            deltas = [_delta(item) for item in _events(parser, output)]
            if logprobs is not None and not deltas:
                deltas = [DeltaMessage(content="")]
            for number, delta in enumerate(deltas):
                yield _chunk(context, choice.index, delta, logprobs=logprobs if number == 0 else None)
            if output.finished:
                reason = _finish(parser, output.finish_reason)
                yield _chunk(context, choice.index, DeltaMessage(), finish_reason=reason)
            if context.has_marks:
                yield mark(choice.index, output.new_token_ids, is_finished=output.finished)
    if context.include_usage:
        usage = context.generation.usage()
        yield event(
            ChatCompletionChunk(
                id=context.id, created=context.created, model=context.model, choices=[], usage=usage
            )
        )
    yield DONE


def _delta(item: Event) -> DeltaMessage:
    return DeltaMessage(content=item) if isinstance(item, str) else DeltaMessage(tool_calls=[item])


def _chunk(
    context: ResponseContext,
    index: int,
    delta: DeltaMessage,
    *,
    logprobs: Logprobs | None = None,
    finish_reason: ChatFinish | None = None,
) -> str:
    choice = ChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
    return event(
        ChatCompletionChunk(id=context.id, created=context.created, model=context.model, choices=[choice])
    )
