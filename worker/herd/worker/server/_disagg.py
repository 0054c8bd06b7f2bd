"""Disaggregation on the internal port: prefill for a remote decode, leased block export, release.

``POST prefill`` takes an OpenAI chat or completion body flagged ``kv_transfer_params.do_remote_decode``,
computes the prompt's KV and its first token (with the request's own sampling settings), holds the prompt's full blocks under a lease and answers
the ``kv_transfer_params`` a decode worker needs (vLLM's field names). The prompt is the orchestrator's
``kv_transfer_params.prompt_token_ids`` (checked against the vocabulary and the context like any ids)
and the lease is labelled with its ``prompt_block_hashes``: the internal port trusts its caller, and a
wrong label only makes the decode side, which hashes the ids itself, refuse the blocks. A body
without ids (the orchestrator has no tokenizer yet) is rendered here, off the event loop. ``POST kv_blocks`` sends
leased blocks in a block frame (``herd.worker.kv_transfer``), refusing a foreign layout with 409.
``POST kv_release`` ends a lease. ``POST kv_hold`` leases the leading run of a peer's prompt blocks
this worker's device caches or its host tier restores (a peer pull, which the orchestrator chose:
the blocks go out through ``kv_blocks`` like a prefill's; ``herd_kv_leases_total`` counts why each
run ended, and whether it held any), and ``POST kv_probe`` sends a frame of zero blocks so that a worker
can time the transport before its first pull. Leases that nobody releases expire: a sweep task releases their
blocks and counts them in ``herd_kv_leases_expired_total``. A prefill counts in the worker's request
metrics as a one-token request (TTFT = E2E), as a vLLM prefill instance's does: its TTFT is the
prefill pool's latency, which dashboards and the autoscaler read.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, TypeVar

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import BaseModel, ValidationError

from herd.api import metrics as names
from herd.api.body import BodyError, json_object
from herd.api.errors import HttpError, invalid_request
from herd.api.kv_hash import BlockHash, block_hashes
from herd.api.openai import ChatCompletionRequest, CompletionRequest
from herd.api.prompt import PromptThreads
from herd.api.protocol import INTERNAL_PATHS, KVTransferParams
from herd.worker.block_manager import HeldRun
from herd.worker.engine_protocol import EngineCore, ServingEngine
from herd.worker.kv_lease import DEFAULT_LEASE_SECONDS, MAX_LEASE_SECONDS, Lease, LeaseTable
from herd.worker.kv_transfer import (
    FRAME_MEDIA_TYPE,
    BlockRequest,
    HoldRequest,
    KVLayout,
    KVLayoutError,
    ProbeRequest,
    ReleaseRequest,
    check_layout,
    encode_frame,
)
from herd.worker.server._metrics import RequestTiming, WorkerMetrics
from herd.worker.server._params import (
    HANDED_PROMPT_PARAM,
    chat_prompt,
    completion_prompts,
    first_token_params,
    handed_prompt,
    handoff_params,
    plan_choices,
)
from herd.worker.server._structured import Grammars

__all__ = ["DisaggMetrics", "PrefillService"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

_MAX_SWEEP_WAIT_S = 0.5
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class DisaggMetrics:
    """KV transfer counters, registered on the worker's ``/metrics`` registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ("model_name", "direction")
        self.bytes = Counter(names.HERD_KV_TRANSFER_BYTES_TOTAL, "KV bytes moved.", labels, registry=registry)
        self.blocks = Counter(
            names.HERD_KV_TRANSFER_BLOCKS_TOTAL, "KV blocks moved.", labels, registry=registry
        )
        self.seconds = Histogram(
            names.HERD_KV_TRANSFER_SECONDS,
            "Time to pull and import one request's KV blocks.",
            ("model_name",),
            buckets=_TRANSFER_BUCKETS,
            registry=registry,
        )
        self.peer_pulls = Counter(
            names.HERD_KV_PEER_PULLS_TOTAL,
            "Pulls of a prompt's blocks from a peer worker, by outcome.",
            ("model_name", "outcome"),
            registry=registry,
        )
        self.leases = Counter(
            names.HERD_KV_LEASES_TOTAL,
            "Leases of prompt blocks given to peers, by whether any block was held and why the run ended.",
            ("model_name", "held", "end"),
            registry=registry,
        )
        self.leases_expired = Counter(
            names.HERD_KV_LEASES_EXPIRED_TOTAL,
            "KV leases freed unclaimed.",
            ("model_name",),
            registry=registry,
        )

    def pulled(self, outcome: str) -> None:
        """One peer pull ended: ``pulled``, ``empty`` (the peer held none of the blocks) or ``failed``."""
        self.peer_pulls.labels(self.model_name, outcome).inc()

    def lent(self, run: HeldRun) -> None:
        """A peer asked to lease a run: ``held`` ``some`` or ``none``, and the run's ``end``."""
        self.leases.labels(self.model_name, "some" if run.block_ids else "none", run.end).inc()

    def moved(self, direction: str, num_blocks: int, num_bytes: int) -> None:
        self.blocks.labels(self.model_name, direction).inc(num_blocks)
        self.bytes.labels(self.model_name, direction).inc(num_bytes)


def _parse_request(payload: dict[str, Any]) -> ChatCompletionRequest | CompletionRequest:
    """A body with ``prompt`` is a text completion; any other is judged as a chat request."""
    try:
        if "prompt" in payload:
            return CompletionRequest.model_validate(payload)
        return ChatCompletionRequest.model_validate(payload)
    except ValidationError as error:
        raise invalid_request(error.errors(include_url=False)) from None


def _prompt_param(request: ChatCompletionRequest | CompletionRequest, *, is_handed: bool) -> str:
    if is_handed:
        return HANDED_PROMPT_PARAM
    return "messages" if isinstance(request, ChatCompletionRequest) else "prompt"


def _prompt(engine: ServingEngine, request: ChatCompletionRequest | CompletionRequest) -> list[int]:
    if isinstance(request, ChatCompletionRequest):
        return chat_prompt(engine.renderer, request, engine.info.max_model_len)
    prompts = completion_prompts(engine.renderer, request, engine.info.max_model_len)
    if len(prompts) != 1:
        raise HttpError(400, "a disaggregated request carries exactly one prompt", param="prompt")
    return prompts[0]


class PrefillService:
    """The prefill side: the lease table, its expiry sweep and the three internal routes."""

    def __init__(
        self,
        engine: ServingEngine,
        metrics: DisaggMetrics,
        requests: WorkerMetrics,
        threads: PromptThreads,
        grammars: Grammars,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.requests = requests
        self._threads = threads
        self._grammars = grammars
        self.leases = LeaseTable()
        self._sweeper: asyncio.Task[None] | None = None

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route(INTERNAL_PATHS.prefill, self.prefill, methods=["POST"])
        router.add_api_route(INTERNAL_PATHS.kv_blocks, self.blocks, methods=["POST"])
        router.add_api_route(INTERNAL_PATHS.kv_release, self.release, methods=["POST"])
        router.add_api_route(INTERNAL_PATHS.kv_hold, self.hold, methods=["POST"])
        router.add_api_route(INTERNAL_PATHS.kv_probe, self.probe, methods=["POST"])
        return router

    async def prefill(self, request: Request) -> KVTransferParams:
        payload = _json_object(await request.body())
        lora_name = self._lora_name(payload)
        body = _parse_request(payload)
        asked = handoff_params(body) or KVTransferParams()
        prompt, salt = handed_prompt(asked), body.cache_salt
        if prompt is None:
            prompt = await self._threads.run(_prompt, self.engine, body)
        is_handed = asked.prompt_token_ids is not None
        grammar = await self._grammars.compile_for(body)  # the first token obeys it too
        choice = plan_choices(
            body,
            [prompt],
            max_model_len=self.engine.info.max_model_len,
            vocab_size=self.engine.info.vocab_size,
            num_logprobs=None,
            prompt_param=_prompt_param(body, is_handed=is_handed),
            handoff=asked,
            grammar=grammar,
        )[0]
        request_id = f"prefill-{uuid.uuid4().hex}"
        params = first_token_params(choice.params)
        timing = RequestTiming()
        outputs = self.engine.generate(request_id, prompt, params, salt, lora_name=lora_name)
        first = [output async for output in outputs][-1]
        timing.on_tokens()
        self.requests.observe_finished(timing, first.finish_reason or "length")
        hashes = self._lease_hashes(prompt, salt, lora_name, asked.prompt_block_hashes)
        leased = self._lease(request, request_id, hashes, first.held_block_ids or [], asked.lease_seconds)
        return leased.model_copy(
            update={
                "do_remote_prefill": True,
                "first_token_ids": first.new_token_ids,
                "num_prompt_tokens": first.num_prompt_tokens,
                "num_cached_tokens": first.num_cached_tokens,
            }
        )

    def _lease_hashes(
        self, prompt: list[int], salt: str | None, lora_name: str | None, handed: list[int] | None
    ) -> list[BlockHash]:
        """The orchestrator's hashes of the prompt's full blocks when it sent them, else our own."""
        info = self.engine.info
        if handed is not None and len(handed) == len(prompt) // info.block_size:
            return handed
        return block_hashes(
            prompt, info.block_size, model_id=info.model, cache_salt=salt, lora_name=lora_name
        )

    def _lease(
        self,
        request: Request,
        request_id: str,
        hashes: list[BlockHash],
        held: list[int],
        lease_seconds: float | None,
    ) -> KVTransferParams:
        """Lease the blocks the engine holds for ``request_id`` (the leading run of ``hashes``: a
        prefill's full blocks, or the cached blocks a peer asked to hold) to the puller, and tell it
        where to fetch them."""
        seconds = min(lease_seconds or DEFAULT_LEASE_SECONDS, MAX_LEASE_SECONDS)
        lease = self.leases.add(request_id, held, hashes[: len(held)], seconds)
        self._ensure_sweeper()
        return KVTransferParams(
            remote_engine_id=self.engine.info.epoch,
            remote_block_ids=lease.block_ids,
            remote_block_hashes=lease.block_hashes,
            remote_host=request.url.hostname,
            remote_port=request.url.port or 80,
            remote_request_id=request_id,
            lease_seconds=seconds,
        )

    def _lora_name(self, payload: dict[str, Any]) -> str | None:
        """The LoRA adapter the body's ``model`` names (``None``: the base model); 404 for another model."""
        served, model = self.engine.info.model, payload.get("model")
        if model == served:
            return None
        if isinstance(model, str) and model in self.engine.lora_adapters:
            return model
        raise HttpError(404, f"model {model!r} is not served here; this worker serves {served!r}")

    async def hold(self, request: Request) -> KVTransferParams:
        """Lease the leading run of the asked blocks this device caches; none held: no lease."""
        body = _parse(HoldRequest, await request.body())
        self._check_layout(body.layout)
        request_id = f"pull-{uuid.uuid4().hex}"
        run = await self.engine.call(lambda core: core.hold_cached(request_id, body.block_hashes))
        self.metrics.lent(run)
        if not run.block_ids:
            return KVTransferParams(remote_block_hashes=[])
        return self._lease(request, request_id, body.block_hashes, run.block_ids, body.lease_seconds)

    async def probe(self, request: Request) -> Response:
        body = _parse(ProbeRequest, await request.body())
        local = self._check_layout(body.layout)
        frame = await asyncio.to_thread(_zero_frame, local, body.num_blocks)
        return Response(frame, media_type=FRAME_MEDIA_TYPE)

    def _check_layout(self, layout: KVLayout) -> KVLayout:
        """This worker's layout; 409 when the asking worker's differs."""
        local = KVLayout.of(self.engine.info)
        try:
            check_layout(local, layout, peer="the asking worker")
        except KVLayoutError as error:
            raise HttpError(409, str(error)) from None
        return local

    async def blocks(self, request: Request) -> Response:
        body = _parse(BlockRequest, await request.body())
        local = self._check_layout(body.layout)
        block_ids = self._leased_ids(body)

        def read_frame(core: EngineCore) -> tuple[bytes, int]:
            kv = core.read_blocks(block_ids)
            return encode_frame(local, body.block_hashes, kv), kv.nbytes

        # Leased blocks are immutable, so they are read beside the engine's steps: waiting for a
        # pause between steps would cost up to a whole prefill chunk (seconds on a busy worker).
        frame, num_bytes = await self.engine.run_beside(read_frame)
        self.metrics.moved("sent", len(block_ids), num_bytes)
        return Response(frame, media_type=FRAME_MEDIA_TYPE)

    def _leased_ids(self, body: BlockRequest) -> list[int]:
        lease = self.leases.get(body.remote_request_id)
        block_ids = None if lease is None else lease.block_ids_for(body.block_hashes)
        if block_ids is None:
            raise HttpError(
                404,
                f"no live lease holds those blocks of request {body.remote_request_id!r} (expired or "
                "released); prefill the request locally",
            )
        return block_ids

    async def release(self, request: Request) -> dict[str, int]:
        body = _parse(ReleaseRequest, await request.body())
        lease = self.leases.pop(body.remote_request_id)
        if lease is not None:
            await self._free(lease)
        return {"num_released_blocks": 0 if lease is None else len(lease.block_ids)}

    async def _free(self, lease: Lease) -> None:
        await self.engine.call(lambda core: core.release_held(lease.request_id))

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep(), name="herd-kv-lease-sweep")

    async def _sweep(self) -> None:
        """Release expired leases until none is left (a new lease restarts the sweep)."""
        while (expiry := self.leases.next_expiry()) is not None:
            await asyncio.sleep(min(_MAX_SWEEP_WAIT_S, max(0.0, expiry - self.leases.clock())))
            for lease in self.leases.pop_expired():
                log.warning(
                    "KV lease expired unclaimed; its blocks are freed",
                    extra={"request_id": lease.request_id, "num_blocks": len(lease.block_ids)},
                )
                self.metrics.leases_expired.labels(self.metrics.model_name).inc()
                await self._free(lease)


def _zero_frame(layout: KVLayout, num_blocks: int) -> bytes:
    shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return encode_frame(layout, [], torch.zeros(shape, dtype=layout.torch_dtype))


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        return json_object(raw)
    except BodyError as error:
        raise HttpError(error.status, str(error)) from None


def _parse(model: type[M], raw: bytes) -> M:
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        raise invalid_request(error.errors(include_url=False)) from None
