"""The decode side of disaggregation: pull a request's prefilled KV blocks before it runs.

An ASGI middleware on the public app. A chat or completion request whose body carries
``kv_transfer_params.do_remote_prefill`` first has its prompt tokenized and hashed as the handler
will; the hashes must equal the prefill worker's (else the two serve different models: 409). The
blocks this worker's prefix cache lacks are fetched through a ``KVTransfer`` while the engine keeps
stepping, their import into the cache is queued to the engine thread, and the lease is released in
the background; then the request goes to the ordinary handler, whose request is queued right after
the import and finds the prompt cached. With the first token the prefill worker handed over
(``first_token_ids``) it streams that token at once and computes only the prompt's partial last
block with it; a seeded or logprobs request recomputes the last prompt token and samples again.
A failed fetch (prefill worker gone, lease expired) is logged and the handler prefills locally; a
layout mismatch is refused with 409.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from herd.api.body import BodyError, json_object
from herd.api.kv_hash import BlockHash, block_hashes
from herd.api.protocol import KVTransferParams
from herd.worker.engine_protocol import ServingEngine
from herd.worker.kv_transfer import KVLayout, KVLayoutError, KVSource, KVTransfer, KVTransferError
from herd.worker.server._disagg import DisaggMetrics, request_prompt
from herd.worker.server._errors import ApiError, invalid_request

__all__ = ["RemotePrefill"]

log = logging.getLogger(__name__)

_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_MAX_BODY_BYTES = 64 * 1024 * 1024


class RemotePrefill:
    """Pulls leased KV blocks for flagged requests, then hands every request to ``app``."""

    def __init__(
        self, app: ASGIApp, *, engine: ServingEngine, transfer: KVTransfer, metrics: DisaggMetrics
    ) -> None:
        self.app = app
        self.engine = engine
        self.transfer = transfer
        self.metrics = metrics
        self._releases: set[asyncio.Task[None]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in _PATHS:
            await self.app(scope, receive, send)
            return
        body, more = await _read_body(receive)
        try:
            await self._pull_if_asked(body)
        except (KVLayoutError, ApiError) as error:
            status = error.status if isinstance(error, ApiError) else 409
            await ApiError(status, str(error)).response()(scope, receive, send)
            return
        await self.app(scope, _replay(body, more, receive), send)

    async def _pull_if_asked(self, body: bytes) -> None:
        payload = _flagged_payload(body)
        if payload is None or not self.engine.is_ready:
            return
        try:
            params = KVTransferParams.model_validate(payload["kv_transfer_params"])
        except ValidationError as error:
            raise invalid_request(error.errors(include_url=False), within="kv_transfer_params") from None
        source = _source(params)
        if source is None:
            log.warning("do_remote_prefill without remote_host/port/request_id; prefilling locally")
            return
        try:
            prompt = request_prompt(self.engine, payload)
            hashes = self._checked_hashes(prompt, payload.get("cache_salt"), params.remote_block_hashes or [])
            await self._pull(source, prompt, hashes)
        except ApiError:
            return  # the handler answers the same error
        finally:
            self._release_later(source)

    def _release_later(self, source: KVSource) -> None:
        """End the lease without making the request wait: the prefill worker frees the blocks
        between its own steps, which can be a whole prefill chunk away."""
        task = asyncio.create_task(self.transfer.release(source), name="herd-kv-release")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def _checked_hashes(self, prompt: list[int], salt: Any, remote: list[BlockHash]) -> list[BlockHash]:
        """Our hashes of the blocks the prefill side leased; they must be the same as theirs."""
        info = self.engine.info
        ours = block_hashes(prompt, info.block_size, model_id=info.model, cache_salt=salt)
        # Every full block moves: a handler continuing from the handed-over first token computes
        # none of them, one sampling the first token again recomputes the last (the cache keeps one).
        usable = min(len(remote), len(prompt) // info.block_size)
        if ours[:usable] != remote[:usable]:
            raise KVLayoutError(
                "the prefill worker's block hashes for this prompt differ from this worker's: the two "
                "pools serve different models, tokenizers or served names"
            )
        return ours[:usable]

    async def _pull(self, source: KVSource, prompt: list[int], hashes: list[BlockHash]) -> None:
        """Fetch the blocks this worker lacks and queue their import; the engine keeps stepping.

        Only the import's copy into the pool runs between steps, and it is queued just before the
        handler queues the request, so both usually run in the same pause.
        """
        started = time.perf_counter()
        missing = await self.engine.run_beside(lambda core: core.missing_blocks(hashes))
        if not missing:
            return
        wanted = [hashes[index] for index in missing]
        try:
            _, kv = await self.transfer.fetch(source, wanted, KVLayout.of(self.engine.info))
        except KVTransferError as error:
            log.warning("KV pull failed; prefilling locally", extra={"error": str(error)})
            return
        size = self.engine.info.block_size
        tokens = [prompt[index * size : (index + 1) * size] for index in missing]
        imported = self.engine.submit(lambda core: core.write_blocks(wanted, tokens, kv))
        self.metrics.moved("received", len(wanted), kv.nbytes)
        imported.add_done_callback(lambda done: self._record(done, started, len(hashes), kv.nbytes))

    def _record(self, imported: asyncio.Future[int], started: float, num_blocks: int, num_bytes: int) -> None:
        """Transfer time and log line of one finished import (a failed one leaves a local prefill)."""
        error = "cancelled" if imported.cancelled() else imported.exception()
        if error is not None:  # exception() itself raises on a cancelled future
            log.warning("KV import failed; prefilling locally", extra={"error": str(error)})
            return
        seconds = time.perf_counter() - started
        self.metrics.seconds.labels(self.metrics.model_name).observe(seconds)
        log.info(
            "KV blocks pulled",
            extra={
                "num_blocks": imported.result(),
                "num_cached_blocks": num_blocks - imported.result(),
                "num_bytes": num_bytes,
                "seconds": round(seconds, 6),
            },
        )


def _flagged_payload(body: bytes) -> dict[str, Any] | None:
    """The parsed body when it asks for a remote prefill; ``None`` for every other request."""
    if b"do_remote_prefill" not in body:  # most requests: no JSON parse here
        return None
    try:
        payload = json_object(body)
    except BodyError:  # the handler refuses the body in the same words
        return None
    params = payload.get("kv_transfer_params")
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    return payload


def _source(params: KVTransferParams) -> KVSource | None:
    if params.remote_host is None or params.remote_port is None or params.remote_request_id is None:
        return None
    return KVSource(params.remote_host, params.remote_port, params.remote_request_id)


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    """The body up to ``_MAX_BODY_BYTES`` (the handler enforces its own, smaller limit); more left?"""
    chunks: list[bytes] = []
    size = 0
    while size <= _MAX_BODY_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if not message.get("more_body", False):
            return b"".join(chunks), False
    return b"".join(chunks), True


def _replay(body: bytes, more: bool, receive: Receive) -> Receive:
    """A ``receive`` that first gives back the body already read, then the real messages."""
    is_sent = False

    async def replayed() -> Message:
        nonlocal is_sent
        if is_sent:
            return await receive()
        is_sent = True
        return {"type": "http.request", "body": body, "more_body": more}

    return replayed
