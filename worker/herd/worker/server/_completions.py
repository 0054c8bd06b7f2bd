"""``/v1/completions`` bodies: the whole response, or the stream of chunks."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from herd.api.openai import CompletionChoice, CompletionLogprobs, CompletionResponse
from herd.api.resume import mark
from herd.worker.outputs import FinishReason, RequestOutput
from herd.worker.server._logprobs import completion_logprobs
from herd.worker.server._params import Choice
from herd.worker.server._responses import ResponseContext
from herd.worker.server._sse import DONE, event

__all__ = ["completion_chunks", "completion_response"]


@dataclass
class _Collected:
    parts: list[str] = field(default_factory=list)
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    offset: int = 0

    def add(self, context: ResponseContext, output: RequestOutput) -> CompletionLogprobs | None:
        """Take one output; return the logprobs of its tokens (None when not asked for)."""
        self.parts.append(output.new_text)
        self.finish_reason = output.finish_reason
        if output.logprobs is None:
            return None
        delta, self.offset = completion_logprobs(context.renderer, output.logprobs, offset=self.offset)
        self.logprobs = _joined(self.logprobs, delta)
        return delta


def _joined(before: CompletionLogprobs | None, after: CompletionLogprobs) -> CompletionLogprobs:
    if before is None:
        return after
    return CompletionLogprobs(
        tokens=before.tokens + after.tokens,
        token_logprobs=before.token_logprobs + after.token_logprobs,
        top_logprobs=before.top_logprobs + after.top_logprobs,
        text_offset=before.text_offset + after.text_offset,
    )


async def completion_response(context: ResponseContext) -> CompletionResponse:
    generation = context.generation
    collected = {choice.index: _Collected() for choice in generation.choices}
    async with aclosing(generation.outputs()) as outputs:
        async for choice, output in outputs:
            collected[choice.index].add(context, output)
    choices = [
        CompletionChoice(
            index=index, text="".join(item.parts), logprobs=item.logprobs, finish_reason=item.finish_reason
        )
        for index, item in collected.items()
    ]
    return CompletionResponse(
        id=context.id, created=context.created, model=context.model, choices=choices, usage=generation.usage()
    )


async def completion_chunks(
    context: ResponseContext, outputs: AsyncGenerator[tuple[Choice, RequestOutput], None]
) -> AsyncGenerator[str, None]:
    """Text chunks (the finish reason on a choice's last one), the usage, ``[DONE]``."""
    collected = {choice.index: _Collected() for choice in context.generation.choices}
    async with aclosing(outputs):
        async for choice, output in outputs:
            if output.is_resumed:  # its client has these: only the logprobs' text offset moves on
                strings = context.renderer.token_strings(output.new_token_ids)
                collected[choice.index].offset += sum(len(text) for text in strings)
                continue
            logprobs = collected[choice.index].add(context, output)
            if output.new_text or output.finished or logprobs is not None:
                yield _chunk(
                    context,
                    CompletionChoice(
                        index=choice.index,
                        text=output.new_text,
                        logprobs=logprobs,
                        finish_reason=output.finish_reason,
                    ),
                )
            if context.has_marks:
                yield mark(choice.index, output.new_token_ids, is_finished=output.finished)
    if context.include_usage:
        usage = context.generation.usage()
        yield event(
            CompletionResponse(
                id=context.id, created=context.created, model=context.model, choices=[], usage=usage
            )
        )
    yield DONE


def _chunk(context: ResponseContext, choice: CompletionChoice) -> str:
    return event(
        CompletionResponse(id=context.id, created=context.created, model=context.model, choices=[choice])
    )
