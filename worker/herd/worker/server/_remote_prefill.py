"""The decode side of disaggregation: pull a request's prefilled KV blocks before it runs.

The public handlers call ``RemotePrefill.pull`` for a request whose ``kv_transfer_params`` (parsed
and validated once, by the handler) ask for a remote prefill, after its prompt ids are known and
checked: handed over by the orchestrator, which rendered them, or rendered here when a client sent
none. This worker hashes those ids itself, once, and they must equal the prefill worker's hashes
(else the two serve different models: 409). Only this hashing is repeated on purpose: the hashes
key the blocks imported into this worker's prefix cache, and the public port takes requests from
anyone, so they must come from the ids this worker runs, never from the request. The blocks the
prefix cache lacks are fetched through a ``KVTransfer`` while the engine keeps stepping, their
import into the cache is queued to the engine thread, and the lease is released in the background;
the handler's request is queued right after the import and finds the prompt cached. With the first
token the prefill worker handed over (``first_token_ids``) it streams that token at once and
computes only the prompt's partial last block with it; a seeded or logprobs request recomputes the
last prompt token and samples again. A failed fetch (prefill worker gone, lease expired) is logged
and the handler prefills locally; a layout mismatch is refused with 409.

A peer pull (``pull_from_peer``) is the same fetch without a prefill: the orchestrator routed a
prompt here whose leading blocks a peer's device caches (``kv_transfer_params.peer_url``), because its
measured cost said pulling them beats computing them. This worker asks the peer to hold the blocks it
lacks in every tier (``KVTransfer.hold``), fetches and imports them, and releases the lease. Whatever
fails (the peer gone before or during the fetch, its lease empty, a foreign layout), the request goes
on and computes what was not brought: a pull never fails a request. Every fetch, of either kind, is
timed into the worker's pull bandwidth (``record_pull``), which its load report carries to routing.

Only the orchestrator may name a worker to pull from: a pull sends the internal token to the
address in ``kv_transfer_params``, so a request that names one must carry that token itself
(``X-Herd-Token``, which the orchestrator sends on every request to a worker); any other is refused
with 403 before anything is dialled, so a client can neither learn the token nor plant KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from herd.api.errors import HttpError
from herd.api.kv_hash import BlockHash, block_hashes
from herd.api.protocol import TOKEN_HEADER, KVTransferParams
from herd.worker.engine_protocol import EngineCore, ServingEngine
from herd.worker.kv_transfer import (
    PROBE_BLOCKS,
    KVLayout,
    KVLayoutError,
    KVSource,
    KVTransfer,
    KVTransferError,
    lease_run,
    lent_blocks,
)
from herd.worker.server._disagg import DisaggMetrics

__all__ = ["RemotePrefill"]

log = logging.getLogger(__name__)


class RemotePrefill:
    """Pulls the leased KV blocks of requests that were prefilled on another worker."""

    def __init__(
        self, *, engine: ServingEngine, transfer: KVTransfer, metrics: DisaggMetrics, token: str
    ) -> None:
        self.engine = engine
        self.transfer = transfer
        self.metrics = metrics
        self._token = token.encode()
        self._releases: set[asyncio.Task[None]] = set()

    async def pull(
        self,
        params: KVTransferParams,
        prompt: list[int],
        cache_salt: str | None,
        *,
        presented_token: str,
        lora_name: str | None = None,
    ) -> None:
        """Bring ``prompt``'s blocks (computed with adapter ``lora_name``, which their hashes carry)
        over from the prefill worker ``params`` names, if it names one and the request presented the
        internal token (403 otherwise)."""
        source = _source(params)
        if source is None:
            log.warning("do_remote_prefill without remote_host/port/request_id; prefilling locally")
            return
        self._check_token(presented_token)
        try:
            hashes = self._checked_hashes(prompt, cache_salt, lora_name, params.remote_block_hashes or [])
            await self._pull(source, prompt, hashes, lora_name)
        except KVLayoutError as error:
            raise HttpError(409, str(error)) from None
        finally:
            self._release_later(source)

    async def pull_from_peer(
        self,
        peer_url: str,
        prompt: list[int],
        cache_salt: str | None,
        *,
        presented_token: str,
        lora_name: str | None = None,
    ) -> None:
        """Bring ``prompt``'s leading blocks that this worker lacks over from the peer at ``peer_url``
        (the orchestrator's choice) if the request presented the internal token (403 otherwise);
        what could not be brought is computed."""
        self._check_token(presented_token)
        started = time.perf_counter()
        info = self.engine.info
        hashes = block_hashes(
            prompt, info.block_size, model_id=info.model, cache_salt=cache_salt, lora_name=lora_name
        )[: len(prompt) // info.block_size]
        missing = await self.engine.run_beside(lambda core: core.missing_blocks(hashes))
        if not missing:
            return
        source = None
        try:
            source = await self.transfer.hold(peer_url, lease_run(hashes, missing), KVLayout.of(info))
            if source is None:
                self.metrics.pulled("empty")
                return
            held = lent_blocks(missing, len(source.block_hashes))
            if not held:
                self.metrics.pulled("empty")
                return
            await self._fetch(source, prompt, hashes, held, lora_name, started, is_peer=True)
        except (KVTransferError, KVLayoutError) as error:
            self.metrics.pulled("failed")
            log.warning(
                "KV peer pull failed; computing the blocks", extra={"peer": peer_url, "error": str(error)}
            )
        finally:
            if source is not None:
                self._release_later(source)

    async def probe(self, internal_url: str, num_blocks: int = PROBE_BLOCKS) -> None:
        """Time the transport on this worker's own internal port, so that routing can price a pull
        before the first one (each real fetch then updates the rate); a failed probe is logged."""
        try:
            num_bytes, seconds = await self.transfer.probe(
                internal_url, KVLayout.of(self.engine.info), num_blocks
            )
        except (KVTransferError, KVLayoutError) as error:
            log.warning(
                "KV transfer probe failed; no pull is priced until one is made", extra={"error": str(error)}
            )
            return
        await self.engine.call(lambda core: core.record_pull(num_bytes, seconds))
        log.info("KV transfer probed", extra={"num_bytes": num_bytes, "seconds": round(seconds, 6)})

    def _check_token(self, presented_token: str) -> None:
        if not secrets.compare_digest(presented_token.encode(), self._token):
            raise HttpError(
                403,
                f"kv_transfer_params names a worker to pull KV blocks from, which only herd's "
                f"orchestrator may do (it sends the {TOKEN_HEADER} header); leave kv_transfer_params out",
                param="kv_transfer_params",
            )

    def _release_later(self, source: KVSource) -> None:
        """End the lease without making the request wait: the prefill worker frees the blocks
        between its own steps, which can be a whole prefill chunk away."""
        task = asyncio.create_task(self.transfer.release(source), name="herd-kv-release")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def _checked_hashes(
        self, prompt: list[int], salt: str | None, lora_name: str | None, remote: list[BlockHash]
    ) -> list[BlockHash]:
        """Our hashes of the blocks the prefill side leased; they must be the same as theirs."""
        info = self.engine.info
        ours = block_hashes(
            prompt, info.block_size, model_id=info.model, cache_salt=salt, lora_name=lora_name
        )
        # Every full block moves: a handler continuing from the handed-over first token computes
        # none of them, one sampling the first token again recomputes the last (the cache keeps one).
        usable = min(len(remote), len(prompt) // info.block_size)
        if ours[:usable] != remote[:usable]:
            raise HttpError(
                409,
                "the prefill worker's block hashes for this prompt differ from this worker's: the two "
                "pools serve different models, tokenizers, served names or adapters",
            )
        return ours[:usable]

    async def _pull(
        self, source: KVSource, prompt: list[int], hashes: list[BlockHash], lora_name: str | None
    ) -> None:
        """Fetch the blocks this worker lacks and queue their import; the engine keeps stepping.

        Only the import's copy into the pool runs between steps, and it is queued just before the
        handler queues the request, so both usually run in the same pause.
        """
        started = time.perf_counter()
        missing = await self.engine.run_beside(lambda core: core.missing_blocks(hashes))
        if not missing:
            return
        try:
            await self._fetch(source, prompt, hashes, missing, lora_name, started, is_peer=False)
        except KVTransferError as error:
            log.warning("KV pull failed; prefilling locally", extra={"error": str(error)})

    async def _fetch(
        self,
        source: KVSource,
        prompt: list[int],
        hashes: list[BlockHash],
        missing: list[int],
        lora_name: str | None,
        started: float,
        *,
        is_peer: bool,
    ) -> None:
        """Fetch the ``missing`` blocks of ``hashes`` and queue their import with the fetch's timing
        (the pull bandwidth); raises ``KVTransferError`` or ``KVLayoutError`` having imported nothing."""
        wanted = [hashes[index] for index in missing]
        _, kv = await self.transfer.fetch(source, wanted, KVLayout.of(self.engine.info))
        fetched = time.perf_counter() - started
        size = self.engine.info.block_size
        tokens = [prompt[index * size : (index + 1) * size] for index in missing]

        def write(core: EngineCore) -> int:
            core.record_pull(kv.nbytes, fetched)
            return core.write_blocks(wanted, tokens, kv, lora_name)

        imported = self.engine.submit(write)
        self.metrics.moved("received", len(wanted), kv.nbytes)
        imported.add_done_callback(lambda done: self._record(done, started, len(hashes), kv.nbytes, is_peer))

    def _record(
        self, imported: asyncio.Future[int], started: float, num_blocks: int, num_bytes: int, is_peer: bool
    ) -> None:
        """Transfer time and log line of one finished import (a failed one leaves a local prefill)."""
        error = "cancelled" if imported.cancelled() else imported.exception()
        if error is not None:  # exception() itself raises on a cancelled future
            if is_peer:
                self.metrics.pulled("failed")
            log.warning("KV import failed; prefilling locally", extra={"error": str(error)})
            return
        if is_peer:
            self.metrics.pulled("pulled")
        seconds = time.perf_counter() - started
        self.metrics.seconds.labels(self.metrics.model_name).observe(seconds)
        log.info(
            "KV blocks pulled from a peer" if is_peer else "KV blocks pulled",
            extra={
                "num_blocks": imported.result(),
                "num_cached_blocks": num_blocks - imported.result(),
                "num_bytes": num_bytes,
                "seconds": round(seconds, 6),
            },
        )


def _source(params: KVTransferParams) -> KVSource | None:
    if params.remote_host is None or params.remote_port is None or params.remote_request_id is None:
        return None
    return KVSource(params.remote_host, params.remote_port, params.remote_request_id)
