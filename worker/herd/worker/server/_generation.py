"""Running a request's choices on the engine: one task per choice, outputs merged as they come.

Closing the merged iteration (the response ended, the client went away) cancels every choice's
task, which aborts its sequence in the engine. Latencies are recorded per choice as vLLM does.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing

from opentelemetry.trace import INVALID_SPAN, Span, StatusCode, set_span_in_context

from herd.api.openai import PromptTokensDetails, Usage
from herd.api.tracing import tracer
from herd.worker.engine_protocol import ServingEngine
from herd.worker.outputs import RequestOutput
from herd.worker.server._metrics import RequestTiming, WorkerMetrics
from herd.worker.server._params import Choice

__all__ = ["Generation"]

_tracer = tracer(__name__)


class Generation:
    """The choices of one request, run concurrently; ``usage()`` totals what they reported."""

    def __init__(
        self,
        engine: ServingEngine,
        metrics: WorkerMetrics,
        request_id: str,
        choices: list[Choice],
        cache_salt: str | None,
        span: Span = INVALID_SPAN,
        *,
        lora_name: str | None = None,
    ) -> None:
        self.engine = engine
        self.lora_name = lora_name
        self.metrics = metrics
        self.request_id = request_id
        self.choices = choices
        self.cache_salt = cache_salt
        self.span = span
        """The request's span: its choices' prefill and decode spans are children of it, and it ends
        with the last of them."""
        self.last: dict[int, RequestOutput] = {}

    async def outputs(self) -> AsyncGenerator[tuple[Choice, RequestOutput], None]:
        """Every choice's outputs, merged in arrival order, until all choices finish."""
        merged: asyncio.Queue[tuple[Choice, RequestOutput] | BaseException] = asyncio.Queue()
        for choice in self.choices:
            if choice.is_finished:
                self.last[choice.index] = _finished_before(choice)
        running = [choice for choice in self.choices if not choice.is_finished]
        tasks = [asyncio.create_task(self._pump(choice, merged)) for choice in running]
        try:
            num_running = len(tasks)
            while num_running:
                item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                self.last[item[0].index] = item[1]
                num_running -= item[1].finished
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.span.is_recording():
                self.span.set_attribute("herd.completion_tokens", self.usage().completion_tokens)
                self.span.end()

    async def _pump(
        self, choice: Choice, merged: asyncio.Queue[tuple[Choice, RequestOutput] | BaseException]
    ) -> None:
        # A unique engine id per attempt: clients may reuse X-Request-Id values.
        engine_id = f"{self.request_id}-{choice.index}-{uuid.uuid4().hex[:8]}"
        timing = RequestTiming()
        spans = _ChoiceSpans(self.span, choice)
        stream = self.engine.generate(
            engine_id,
            choice.prompt_token_ids,
            choice.params,
            self.cache_salt,
            choice.first_token_id,
            resumed_token_ids=choice.resumed_token_ids,
            lora_name=self.lora_name,
        )
        try:
            async with aclosing(stream):
                async for output in stream:
                    if output.new_token_ids and not output.is_resumed:
                        timing.on_tokens()
                        spans.on_tokens()
                    if output.finished:
                        self.metrics.observe_finished(timing, output.finish_reason or "stop")
                        spans.end(output.finish_reason, output.num_output_tokens)
                    merged.put_nowait((choice, output))
        except Exception as error:
            spans.end("error", None)
            merged.put_nowait(error)
        finally:
            spans.end("abort", None)  # cancelled: the client went away

    def usage(self) -> Usage:
        """Prompt tokens count once per prompt (not once per choice), output tokens per choice."""
        firsts = {choice.prompt_index: self.last.get(choice.index) for choice in reversed(self.choices)}
        prompts = [output for output in firsts.values() if output is not None]
        num_prompt = sum(output.num_prompt_tokens for output in prompts)
        num_output = sum(output.num_output_tokens for output in self.last.values())
        return Usage(
            prompt_tokens=num_prompt,
            completion_tokens=num_output,
            total_tokens=num_prompt + num_output,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(output.num_cached_tokens for output in prompts)
            ),
        )


def _finished_before(choice: Choice) -> RequestOutput:
    """What a choice that finished on the worker that began the stream counts in the usage."""
    return RequestOutput(
        request_id="",
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason=None,
        num_prompt_tokens=len(choice.prompt_token_ids),
        num_cached_tokens=0,
        num_output_tokens=len(choice.resumed_token_ids),
    )


class _ChoiceSpans:
    """One choice's ``herd.worker.prefill`` span (queued and prefilled, up to its first token on this
    worker) and ``herd.worker.decode`` span (the tokens after it), children of the request's span."""

    def __init__(self, parent: Span, choice: Choice) -> None:
        self._context = set_span_in_context(parent)
        attributes = {"herd.choice": choice.index, "herd.prompt_tokens": len(choice.prompt_token_ids)}
        if choice.resumed_token_ids:
            attributes["herd.resumed_tokens"] = len(choice.resumed_token_ids)
        self._current: Span | None = _tracer.start_span(
            "herd.worker.prefill", context=self._context, attributes=attributes
        )
        self._is_decoding = False

    def on_tokens(self) -> None:
        if not self._is_decoding and self._current is not None:
            self._is_decoding = True
            self._current.end()
            self._current = _tracer.start_span("herd.worker.decode", context=self._context)

    def end(self, reason: str | None, num_output_tokens: int | None) -> None:
        span, self._current = self._current, None
        if span is None:
            return
        span.set_attribute("herd.finish_reason", reason or "stop")
        if num_output_tokens is not None:
            span.set_attribute("herd.output_tokens", num_output_tokens)
        if reason == "error":
            span.set_status(StatusCode.ERROR)
        span.end()
