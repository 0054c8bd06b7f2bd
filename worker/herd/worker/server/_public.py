"""The public port: the OpenAI API, tokenization, health, readiness, metrics, and what peer routers
ask (``_peer_routes``).

A completion request is parsed once, its ``kv_transfer_params`` validated once (``handoff_params``),
and its prompt rendered and tokenized here only when the request does not carry the ids the
orchestrator rendered (``kv_transfer_params.prompt_token_ids``); handed ids are checked against the
vocabulary and the context length like any others. A request prefilled on another worker has its
KV blocks pulled (``RemotePrefill``, set by ``attach_disaggregation``) before it is queued, and so has
one the orchestrator routed with a peer to pull its cached prefix from (``kv_transfer_params.peer_url``).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry.trace import Span, SpanKind, StatusCode, set_span_in_context
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from herd.api.errors import HttpError
from herd.api.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    SamplingFields,
)
from herd.api.prompt import PromptRenderer, PromptThreads, prompt_count
from herd.api.protocol import TOKEN_HEADER, KVTransferParams
from herd.api.resume import RESUMABLE_HEADER, RESUME_FIELD, ResumeParams
from herd.api.tracing import context_from, tracer
from herd.worker.engine_protocol import ServingEngine
from herd.worker.outputs import RequestOutput
from herd.worker.sampling_params import InvalidParamError, check_token_ids
from herd.worker.server._body import read_body
from herd.worker.server._chat import chat_chunks, chat_response
from herd.worker.server._completions import completion_chunks, completion_response
from herd.worker.server._embeddings import (
    check_dimensions,
    check_generates,
    embed,
    embedding_inputs,
)
from herd.worker.server._errors import as_api_error, error_response, install_error_handlers, respond
from herd.worker.server._generation import Generation
from herd.worker.server._lora import lora_routes
from herd.worker.server._metrics import WorkerMetrics
from herd.worker.server._openapi import build_openapi, route_docs
from herd.worker.server._params import (
    HANDED_PROMPT_PARAM,
    Choice,
    chat_prompt,
    completion_prompts,
    handed_prompt,
    handoff_params,
    plan_choices,
    prompt_errors,
    resume_params,
)
from herd.worker.server._peer_routes import RenderedPrompt, RenderedPrompts, Route, peer_routes
from herd.worker.server._remote_prefill import RemotePrefill
from herd.worker.server._request_id import RequestIdMiddleware, request_id
from herd.worker.server._responses import ResponseContext
from herd.worker.server._sse import primed, with_error_event
from herd.worker.server._structured import Grammars
from herd.worker.server._tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

__all__ = ["PublicOptions", "build_public_app"]

R = TypeVar("R", bound=ChatCompletionRequest | CompletionRequest | EmbeddingRequest)

_Chunks = Callable[
    [ResponseContext, AsyncGenerator[tuple[Choice, RequestOutput], None]], AsyncGenerator[str, None]
]


@dataclass(frozen=True)
class _Endpoint:
    """How chat and text completions differ once their prompts are token ids."""

    id_prefix: str
    prompt_param: str
    chunks: _Chunks
    whole: Callable[[ResponseContext], Coroutine[Any, Any, BaseModel]]


_CHAT = _Endpoint("chatcmpl", "messages", chat_chunks, chat_response)
_COMPLETIONS = _Endpoint("cmpl", "prompt", completion_chunks, completion_response)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""Keep proxies (nginx, ingress controllers) from buffering a token stream."""

_tracer = tracer(__name__)

CLIENT_CLOSED = 499
"""nginx's status for a request whose client went away; nobody reads it, the logs do."""


@dataclass(frozen=True)
class PublicOptions:
    served_name: str
    max_body_bytes: int = 4 * 1024 * 1024
    internal_token: str = ""
    """The token herd's gateway presents (``X-Herd-Token``): it guards the runtime LoRA routes
    (``_lora``; without one they refuse), and only a request carrying it may resume a stream."""
    max_queue_len: int | None = None
    """The engine's ``maxQueueLen``: a request of more sequences (inputs, prompts x ``n``) could never
    be queued whole, so it is refused with a 400 rather than a 429 that no retry would pass."""


def build_public_app(engine: ServingEngine, options: PublicOptions) -> FastAPI:
    app = FastAPI(title="herd worker", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.add_middleware(RequestIdMiddleware)
    metrics = WorkerMetrics(engine, options.served_name)
    app.state.metrics = metrics  # disaggregation registers its transfer metrics here
    app.state.remote_prefill = None  # and its KV puller (attach_disaggregation)
    app.state.prompt_threads = PromptThreads("herd-prompt")  # the prefill route renders there too
    app.state.grammars = Grammars(engine, app.state.prompt_threads)  # and compiles there too
    install_error_handlers(app, metrics.observe_rejected)
    routes = _PublicRoutes(engine, options, metrics, app.state.prompt_threads, app.state.grammars)
    table: list[Route] = [
        ("/v1/chat/completions", "POST", routes.chat),
        ("/v1/completions", "POST", routes.completions),
        ("/v1/embeddings", "POST", routes.embeddings),
        ("/v1/chat/completions/render", "POST", routes.render_chat),
        ("/v1/completions/render", "POST", routes.render_completions),
        ("/v1/models", "GET", routes.models),
        ("/tokenize", "POST", routes.tokenize),
        ("/detokenize", "POST", routes.detokenize),
        ("/health", "GET", routes.health),
        ("/ready", "GET", routes.ready),
        ("/metrics", "GET", routes.metrics),
        *peer_routes(engine),
        *lora_routes(
            engine,
            options.internal_token,
            max_body_bytes=options.max_body_bytes,
            threads=app.state.prompt_threads,
        ),
    ]
    for path, method, endpoint in table:
        app.add_api_route(path, endpoint, methods=[method], openapi_extra=route_docs(path))
    app.openapi = lambda: build_openapi(app, options.served_name)  # type: ignore[method-assign]
    return app


class _PublicRoutes:
    def __init__(
        self,
        engine: ServingEngine,
        options: PublicOptions,
        metrics: WorkerMetrics,
        threads: PromptThreads,
        grammars: Grammars,
    ) -> None:
        self.engine = engine
        self.options = options
        self._metrics = metrics
        self._threads = threads
        self._grammars = grammars

    async def chat(self, request: Request) -> Response:
        body = await self._read(request, ChatCompletionRequest)
        check_generates(self.engine.info)
        self._check_fits_queue(body.n, "n")
        handoff = handoff_params(body)
        renderer, max_model_len = self.engine.renderer, self.engine.info.max_model_len
        prompts = await self._prompts(handoff, lambda: [chat_prompt(renderer, body, max_model_len)])
        return await self._generate(request, body, prompts, _CHAT, handoff)

    async def completions(self, request: Request) -> Response:
        body = await self._read(request, CompletionRequest)
        check_generates(self.engine.info)
        self._check_fits_queue(prompt_count(body.prompt) * body.n, "prompt")
        handoff = handoff_params(body)
        renderer, max_model_len = self.engine.renderer, self.engine.info.max_model_len
        prompts = await self._prompts(handoff, lambda: completion_prompts(renderer, body, max_model_len))
        return await self._generate(request, body, prompts, _COMPLETIONS, handoff)

    async def embeddings(self, request: Request) -> Response:
        body = await self._read(request, EmbeddingRequest)
        info, renderer = self.engine.info, self.engine.renderer
        dimensions = check_dimensions(body.dimensions, info)
        self._check_fits_queue(prompt_count(body.input), "input")
        inputs = await self._threads.run(embedding_inputs, renderer, body, info)
        work = embed(
            self.engine,
            request_id(request),
            body,
            inputs,
            dimensions=dimensions,
            served_name=self.options.served_name,
        )
        return await _json_unless_disconnected(request, work)

    def _check_fits_queue(self, num_sequences: int, param: str) -> None:
        """400 for a request of more sequences than the engine ever queues (a 429 would never pass)."""
        limit = self.options.max_queue_len
        if limit is not None and num_sequences > limit:
            raise HttpError(
                400,
                f"the request makes {num_sequences} sequences but this worker queues at most {limit} "
                f"(engine.maxQueueLen): send at most {limit} in one request",
                param=param,
            )

    async def render_chat(self, request: Request) -> RenderedPrompt:
        body = await self._read(request, ChatCompletionRequest)
        renderer, max_model_len = self.engine.renderer, self.engine.info.max_model_len
        prompt = await self._threads.run(lambda: chat_prompt(renderer, body, max_model_len))
        return RenderedPrompt(request_id=request_id(request), token_ids=prompt, model=body.model)

    async def render_completions(self, request: Request) -> RenderedPrompts:
        body = await self._read(request, CompletionRequest)
        renderer, max_model_len = self.engine.renderer, self.engine.info.max_model_len
        prompts = await self._threads.run(lambda: completion_prompts(renderer, body, max_model_len))
        rid = request_id(request)
        return RenderedPrompts(
            [RenderedPrompt(request_id=rid, token_ids=ids, model=body.model) for ids in prompts]
        )

    async def _generate(
        self,
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        endpoint: _Endpoint,
        handoff: KVTransferParams | None,
    ) -> Response:
        span = _tracer.start_span(
            "herd.worker.request",
            context=context_from(request.headers),
            kind=SpanKind.SERVER,
            attributes={"http.route": request.url.path, "herd.request_id": request_id(request)},
        )
        try:
            return await self._traced_generate(request, body, prompts, endpoint, handoff, span)
        except BaseException as error:
            if span.is_recording():  # else the generation ended it already
                span.set_status(StatusCode.ERROR, f"{type(error).__name__}: {error}")
                span.end()
            raise

    async def _traced_generate(
        self,
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        endpoint: _Endpoint,
        handoff: KVTransferParams | None,
        span: Span,
    ) -> Response:
        """``_generate`` under the request's ``span``, which the generation ends when it does."""
        is_handed = handed_prompt(handoff) is not None
        resume = self._resume(request, body)
        grammar = await self._grammars.compile_for(body)
        choices = plan_choices(
            body,
            prompts,
            max_model_len=self.engine.info.max_model_len,
            vocab_size=self.engine.info.vocab_size,
            num_logprobs=body.num_logprobs,
            prompt_param=HANDED_PROMPT_PARAM if is_handed else endpoint.prompt_param,
            handoff=handoff,
            grammar=grammar,
            resume=resume,
        )
        if handoff is not None and (handoff.do_remote_prefill or handoff.peer_url is not None):
            with _tracer.start_as_current_span("herd.worker.kv_transfer", context=set_span_in_context(span)):
                await self._pull(request, handoff, prompts, body)
        context = self._context(request, body, choices, prefix=endpoint.id_prefix, span=span)
        if body.stream:
            has_marks = self._is_internal(request) and RESUMABLE_HEADER in request.headers
            if resume is not None and resume.created is not None:
                context = replace(context, created=resume.created, is_opened=True)
            return await _stream(replace(context, has_marks=has_marks), endpoint.chunks)
        return await _json_unless_disconnected(request, endpoint.whole(context))

    def _is_internal(self, request: Request) -> bool:
        """Whether ``request`` carries the internal token (herd's gateway sent it)."""
        presented = request.headers.get(TOKEN_HEADER, "").encode()
        return secrets.compare_digest(presented, self.options.internal_token.encode())

    def _resume(self, request: Request, body: SamplingFields) -> ResumeParams | None:
        """The request's ``herd_resume``; 403 unless herd's gateway sent it."""
        resume = resume_params(body)
        if resume is not None and not self._is_internal(request):
            raise HttpError(
                403,
                f"{RESUME_FIELD} continues a stream with tokens as this model's own output, which only "
                f"herd's orchestrator may do (it sends the {TOKEN_HEADER} header); leave {RESUME_FIELD} out",
                param=RESUME_FIELD,
            )
        return resume

    async def _pull(
        self,
        request: Request,
        handoff: KVTransferParams | None,
        prompts: list[list[int]],
        body: SamplingFields,
    ) -> None:
        """The KV blocks of a prompt prefilled on another worker, once its ids passed every check."""
        remote_prefill: RemotePrefill | None = request.app.state.remote_prefill
        if remote_prefill is None or handoff is None or len(prompts) != 1:
            return
        token, lora_name = request.headers.get(TOKEN_HEADER, ""), self._lora_name(body)
        if handoff.do_remote_prefill:
            await remote_prefill.pull(
                handoff, prompts[0], body.cache_salt, presented_token=token, lora_name=lora_name
            )
        elif handoff.peer_url is not None:
            await remote_prefill.pull_from_peer(
                handoff.peer_url, prompts[0], body.cache_salt, presented_token=token, lora_name=lora_name
            )

    async def _read(self, request: Request, model: type[R]) -> R:
        """Parse the body, refuse other models' requests (404) and requests while not accepting (503).

        ``model`` is the served name (the base model) or a loaded LoRA adapter's name."""
        body = await read_body(request, model, max_bytes=self.options.max_body_bytes, threads=self._threads)
        self.engine.check_accepting()
        if body.model != self.options.served_name and body.model not in self.engine.lora_adapters:
            adapters = "".join(f", {name!r}" for name in self.engine.lora_adapters)
            message = (
                f"model {body.model!r} is not served here; this worker serves {self.options.served_name!r}"
                + (f" and the LoRA adapters{adapters[1:]}" if adapters else "")
            )
            raise HttpError(404, message, param="model")
        return body

    def _lora_name(self, body: SamplingFields) -> str | None:
        return None if body.model == self.options.served_name else body.model

    def _context(
        self, request: Request, body: SamplingFields, choices: list[Choice], *, prefix: str, span: Span
    ) -> ResponseContext:
        rid = request_id(request)
        generation = Generation(
            self.engine,
            self._metrics,
            rid,
            choices,
            body.cache_salt,
            span,
            lora_name=self._lora_name(body),
        )
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        tool_choice = body.effective_tool_choice if isinstance(body, ChatCompletionRequest) else "none"
        return ResponseContext(
            id=f"{prefix}-{rid}",
            model=self.options.served_name,
            renderer=self.engine.renderer,
            generation=generation,
            include_usage=include_usage,
            tool_choice=tool_choice,
        )

    async def models(self) -> ModelList:
        """The base model, then each loaded LoRA adapter with the base as its ``parent``."""
        base = self.options.served_name
        if not self.engine.is_loaded:
            return ModelList(data=[ModelCard(id=base)])
        max_model_len = self.engine.info.max_model_len
        adapters = [
            ModelCard(id=name, root=str(path), parent=base, max_model_len=max_model_len)
            for name, path in self.engine.lora_adapters.items()
        ]
        return ModelList(data=[ModelCard(id=base, max_model_len=max_model_len), *adapters])

    async def tokenize(self, request: Request) -> TokenizeResponse:
        body = await read_body(
            request, TokenizeRequest, max_bytes=self.options.max_body_bytes, threads=self._threads
        )
        self.engine.check_accepting()
        tokens = await self._threads.run(_tokenize, self.engine.renderer, body)
        return TokenizeResponse(
            count=len(tokens), max_model_len=self.engine.info.max_model_len, tokens=tokens
        )

    async def detokenize(self, request: Request) -> DetokenizeResponse:
        body = await read_body(
            request, DetokenizeRequest, max_bytes=self.options.max_body_bytes, threads=self._threads
        )
        self.engine.check_accepting()
        renderer = self.engine.renderer
        vocab_size = self.engine.info.vocab_size or renderer.vocab_size
        try:
            check_token_ids(body.tokens, vocab_size, param="tokens")
        except InvalidParamError as error:
            raise HttpError(400, str(error), param=error.param) from None
        return DetokenizeResponse(prompt=await self._threads.run(renderer.decode, body.tokens))

    async def health(self) -> Response:
        """Unhealthy only when the process cannot serve: its engine failed to load or to recover."""
        if self.engine.error is not None:
            return error_response(
                500, f"this worker cannot serve: its engine failed ({self.engine.error}); restart it"
            )
        return JSONResponse({"status": "ok"})

    async def ready(self) -> Response:
        try:
            self.engine.check_accepting()
        except Exception as error:
            return respond(as_api_error(error))
        return JSONResponse({"status": "ready"})

    async def metrics(self) -> Response:
        return Response(self._metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def _prompts(
        self, handoff: KVTransferParams | None, render: Callable[[], list[list[int]]]
    ) -> list[list[int]]:
        """The prompt ids the orchestrator handed over, else the request's own, rendered and tokenized
        on the prompt threads (a long prompt takes milliseconds to seconds)."""
        if (handed := handed_prompt(handoff)) is not None:
            return [handed]
        return await self._threads.run(render)


def _tokenize(renderer: PromptRenderer, body: TokenizeRequest) -> list[int]:
    if body.messages is not None:
        messages = [{"role": message.role, "content": message.text} for message in body.messages]
        with prompt_errors("messages"):
            return renderer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt)
    with prompt_errors("prompt"):
        return renderer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)


async def _stream(context: ResponseContext, chunks: _Chunks) -> StreamingResponse:
    outputs = await primed(context.generation.outputs())
    headers = {**_SSE_HEADERS, RESUMABLE_HEADER: "1"} if context.has_marks else _SSE_HEADERS
    return StreamingResponse(
        with_error_event(chunks(context, outputs)), media_type="text/event-stream", headers=headers
    )


async def _json_unless_disconnected(request: Request, work: Coroutine[Any, Any, BaseModel]) -> Response:
    """Run ``work``; if the client disconnects first, cancel it (aborting its sequences)."""
    task = asyncio.create_task(work)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if not task.done() or task.cancelled():
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(task.result().model_dump())


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        continue
