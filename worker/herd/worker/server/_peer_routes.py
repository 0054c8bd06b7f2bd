"""What the peer routers ask a worker, so that they route to herd's workers as herd's orchestrator does.

SGLang's router (``sglang-router``), the SGLang model gateway (``smg``) and vLLM's router
(``vllm-router``) probe a worker's settings (``/server_info``, ``/model_info``, each also under its
older ``/get_`` name), ask for a request's token ids (vLLM's ``render`` routes, served beside the
completions in ``_public``), poll its load (SGLang's ``/get_load`` list, the gateway's ``/v1/loads``) and
fan ``/flush_cache`` out to every worker. Every answer is the engine's own: loads from its load report
(taken between two steps) and counters, settings from what the engine announces; ``/flush_cache``
forgets the prefix cache on the engine thread between steps, or answers 409 while a request holds
KV blocks (SGLang's and vLLM's engines refuse the same way). A worker still loading answers 503.
Field names are SGLang's, which the three read.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, RootModel

from herd.api.errors import HttpError
from herd.api.protocol import LoadReport
from herd.worker.engine_protocol import ServingEngine

__all__ = [
    "FlushCacheRequest",
    "FlushCacheResponse",
    "ModelInfo",
    "RankLoad",
    "RenderedPrompt",
    "RenderedPrompts",
    "Route",
    "SchedulerLoad",
    "ServerInfo",
    "WorkerLoads",
    "peer_routes",
]


class RankLoad(BaseModel):
    """One data-parallel rank in SGLang's ``/get_load`` list; a herd worker is one rank.

    ``num_tokens`` is SGLang's token load: KV tokens held plus the uncached prompt tokens queued
    (SGLang's router sums it over ranks for its power-of-two policy).
    """

    dp_rank: int = 0
    num_reqs: int
    num_waiting_reqs: int
    num_tokens: int


class SchedulerLoad(BaseModel):
    """One rank of the model gateway's ``/v1/loads`` (SGLang's load schema)."""

    dp_rank: int = 0
    num_running_reqs: int
    num_waiting_reqs: int
    num_waiting_uncached_tokens: int
    num_total_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    token_usage: float
    cache_hit_rate: float


class WorkerLoads(BaseModel):
    timestamp: str
    dp_rank_count: int = 1
    loads: list[SchedulerLoad]


class ServerInfo(BaseModel):
    """The engine's settings under SGLang's ``/server_info`` names (``page_size`` is the block size)."""

    model_path: str
    served_model_name: str
    tp_size: int = 1
    dp_size: int = 1
    disaggregation_mode: str
    context_length: int
    page_size: int
    max_total_num_tokens: int
    dtype: str


class RenderedPrompt(BaseModel):
    """A prompt as vLLM's ``/v1/chat/completions/render`` and ``/v1/completions/render`` give it:
    the token ids the worker would run, rendered and tokenized as for generation. vLLM's router
    asks every worker for them before it routes a request by cache affinity (then ``/tokenize``
    if this route is missing). vLLM's sampling parameters are not echoed."""

    request_id: str
    token_ids: list[int]
    model: str


class RenderedPrompts(RootModel[list[RenderedPrompt]]):
    """``/v1/completions/render``'s answer: one rendered prompt per prompt of the request."""


class FlushCacheRequest(BaseModel):
    """``/flush_cache`` takes no fields; the routers send no body, and any body is ignored."""

    model_config = ConfigDict(extra="allow")


class FlushCacheResponse(BaseModel):
    message: str


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str
    is_generation: bool = True


_DISAGGREGATION_MODES = {"unified": "null", "prefill": "prefill", "decode": "decode"}
"""herd's worker roles as SGLang names its disaggregation modes."""


Route = tuple[str, str, Callable[..., Coroutine[Any, Any, Any]]]
"""A path, its method and its handler."""


def peer_routes(engine: ServingEngine) -> list[Route]:
    """This module's routes (the render routes are ``_public``'s); a peer knows the worker by its
    served name (``info.model``), which stands for its model and tokenizer paths too."""
    routes = _PeerRoutes(engine)
    return [
        ("/get_load", "GET", routes.get_load),
        ("/v1/loads", "GET", routes.loads),
        ("/server_info", "GET", routes.server_info),
        ("/get_server_info", "GET", routes.server_info),
        ("/model_info", "GET", routes.model_info),
        ("/get_model_info", "GET", routes.model_info),
        ("/flush_cache", "POST", routes.flush_cache),
    ]


class _PeerRoutes:
    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine

    async def get_load(self) -> list[RankLoad]:
        load = await self._load()
        used = _used_tokens(load, self.engine.info.block_size)
        num_tokens = used + load.num_waiting_prefill_tokens
        return [RankLoad(num_reqs=_num_reqs(load), num_waiting_reqs=load.num_waiting, num_tokens=num_tokens)]

    async def loads(self) -> WorkerLoads:
        """The gateway asks for sections (``?include=core,disagg,...``); a herd worker has the core
        one only, and the gateway reads the sections it gets."""
        load, stats = await self._load(), self.engine.stats
        block_size = self.engine.info.block_size
        queries = stats.prefix_cache_queries
        rank = SchedulerLoad(
            num_running_reqs=load.num_running,
            num_waiting_reqs=load.num_waiting,
            num_waiting_uncached_tokens=load.num_waiting_prefill_tokens,
            num_total_reqs=_num_reqs(load),
            num_used_tokens=_used_tokens(load, block_size),
            max_total_num_tokens=load.num_total_blocks * block_size,
            token_usage=load.kv_usage,
            cache_hit_rate=stats.prefix_cache_hits / queries if queries else 0.0,
        )
        return WorkerLoads(timestamp=datetime.now(UTC).isoformat(), loads=[rank])

    async def server_info(self) -> ServerInfo:
        info, load = self.engine.info, await self._load()
        return ServerInfo(
            model_path=info.model,
            served_model_name=info.model,
            disaggregation_mode=_DISAGGREGATION_MODES[info.role],
            context_length=info.max_model_len,
            page_size=info.block_size,
            max_total_num_tokens=load.num_total_blocks * info.block_size,
            dtype=info.dtype,
        )

    async def model_info(self) -> ModelInfo:
        name = self.engine.info.model
        return ModelInfo(model_path=name, tokenizer_path=name)

    async def flush_cache(self) -> FlushCacheResponse:
        self._check_loaded()
        if not await self.engine.call(lambda core: core.reset_prefix_cache()):
            raise HttpError(
                409,
                "the prefix cache was not flushed: requests are running or hold KV blocks; "
                "flush it again when the worker is idle",
            )
        return FlushCacheResponse(message="the prefix cache was flushed")

    async def _load(self) -> LoadReport:
        """The engine's load now, between two steps: the last step's report is empty until the
        first step, and a router reads the pool size from it at startup."""
        self._check_loaded()
        return await self.engine.call(lambda core: core.load_report())

    def _check_loaded(self) -> None:
        """Commands queued before the model is loaded would wait for it; a peer is told to retry."""
        if not self.engine.is_loaded:
            raise HttpError(503, "the model is still loading; retry when /ready answers 200")


def _num_reqs(load: LoadReport) -> int:
    return load.num_running + load.num_waiting


def _used_tokens(load: LoadReport, block_size: int) -> int:
    """KV tokens held by running requests (cached free blocks count as free, as in ``kv_usage``)."""
    return (load.num_total_blocks - load.num_free_blocks) * block_size
