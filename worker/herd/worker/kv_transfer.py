"""Moving KV blocks between workers: the transfer interface and its HTTP implementation.

A decode worker pulls the blocks it lacks from the prefill worker that holds them under a lease; a
worker routed a prompt whose leading blocks a peer's device caches asks that peer to hold them
under a lease first (``hold``), then pulls them the same way. ``KVTransfer`` is the interface (a
NIXL/UCX or RDMA transport can implement it later); ``HttpKVTransfer`` speaks the internal
protocol's ``kv_hold``, ``kv_blocks`` and ``kv_release`` paths, and ``kv_probe``, which times the
transport before any real pull has (a worker's first pull bandwidth). A block
frame is ``MAGIC | uint32 header length | JSON header | raw tensor bytes``: the header names the
layout, the block hashes and the tensor shape, the bytes are the KV as the pool stores it, so no
tensor ever goes through JSON. Both sides compare layouts (model, dtype, block size, layers, KV
heads, head dim) and refuse a mismatch with ``KVLayoutError``.
"""

from __future__ import annotations

import asyncio
import struct
import time
from dataclasses import asdict, dataclass, fields
from typing import Protocol

import httpx
import torch
from pydantic import BaseModel, Field, ValidationError

from herd.api.kv_hash import BlockHash
from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER, KVTransferParams, WorkerInfo

__all__ = [
    "FRAME_MEDIA_TYPE",
    "PROBE_BLOCKS",
    "BlockRequest",
    "HoldRequest",
    "HttpKVTransfer",
    "KVLayout",
    "KVLayoutError",
    "KVSource",
    "KVTransfer",
    "KVTransferError",
    "ProbeRequest",
    "ReleaseRequest",
    "check_layout",
    "decode_frame",
    "encode_frame",
    "lease_run",
    "lent_blocks",
]

FRAME_MEDIA_TYPE = "application/x-herd-kv-blocks"
_MAGIC = b"HKV1"
_LENGTH = struct.Struct("<I")

PROBE_BLOCKS = 16
"""Blocks in the transport probe's frame: a few MB for a small model, enough to time more than latency."""


def lease_run(block_hashes: list[BlockHash], missing: list[int]) -> list[BlockHash]:
    """What a puller asks a peer to hold for the blocks it lacks (``missing``, ascending indexes of
    ``block_hashes``): the leading run up to the last of them, since a peer lends leading runs only
    (a block's hash names its whole prefix)."""
    return block_hashes[: missing[-1] + 1]


def lent_blocks(missing: list[int], num_lent: int) -> list[int]:
    """The ``missing`` indexes a lease of ``num_lent`` leading blocks brings: the peer may hold a
    shorter run than was asked (evicted since it reported, or lent only what its device holds)."""
    return [index for index in missing if index < num_lent]


class KVTransferError(RuntimeError):
    """The blocks could not be fetched (peer gone, lease expired); the caller prefills locally."""


class KVLayoutError(ValueError):
    """Two workers store KV blocks differently; moving blocks between them would corrupt outputs."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What must agree between two workers for a block to mean the same on both."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, info: WorkerInfo) -> KVLayout:
        return cls(**{field.name: getattr(info, field.name) for field in fields(cls)})

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise KVLayoutError(f"unknown KV dtype {self.dtype!r} in a block frame")
        return dtype


def check_layout(local: KVLayout, remote: KVLayout, *, peer: str) -> None:
    """Raise ``KVLayoutError`` naming every field where ``remote`` differs from ``local``."""
    ours, theirs = asdict(local), asdict(remote)
    diffs = [f"{name} {theirs[name]!r} != {ours[name]!r}" for name in ours if ours[name] != theirs[name]]
    if diffs:
        raise KVLayoutError(
            f"KV layout of {peer} differs from this worker's ({'; '.join(diffs)}): prefill and decode "
            "pools must run the same model with the same engine.dtype and kvCache.blockSize"
        )


class BlockRequest(BaseModel):
    """Body of ``POST kv_blocks``: which leased blocks to send, and the asking worker's layout."""

    remote_request_id: str
    block_hashes: list[BlockHash]
    layout: KVLayout


class ReleaseRequest(BaseModel):
    remote_request_id: str


class HoldRequest(BaseModel):
    """Body of ``POST kv_hold``: hold the leading run of these blocks the device caches, for a pull."""

    block_hashes: list[BlockHash] = Field(max_length=65_536)
    layout: KVLayout
    lease_seconds: float | None = Field(default=None, gt=0.0)


class ProbeRequest(BaseModel):
    """Body of ``POST kv_probe``: send a frame of this many blocks of zeros in the asker's layout."""

    num_blocks: int = Field(ge=1, le=64)
    layout: KVLayout


class _FrameHeader(BaseModel):
    layout: KVLayout
    block_hashes: list[BlockHash]
    shape: list[int]


def encode_frame(layout: KVLayout, block_hashes: list[BlockHash], kv: torch.Tensor) -> bytes:
    """One block frame; ``kv`` is ``[layers, 2, blocks, block_size, kv_heads, head_dim]``."""
    kv = kv.contiguous()
    header = _FrameHeader(layout=layout, block_hashes=block_hashes, shape=list(kv.shape))
    encoded = header.model_dump_json().encode()
    raw = kv.view(torch.uint8).numpy().data.cast("B")  # joined without an extra copy
    return b"".join((_MAGIC, _LENGTH.pack(len(encoded)), encoded, raw))


def decode_frame(payload: bytes) -> tuple[KVLayout, list[BlockHash], torch.Tensor]:
    """The layout, block hashes and KV tensor of a frame; ``KVTransferError`` if it is malformed."""
    start = len(_MAGIC) + _LENGTH.size
    if len(payload) < start or not payload.startswith(_MAGIC):
        raise KVTransferError("the peer sent no herd KV block frame (bad magic): is it a herd worker?")
    (length,) = _LENGTH.unpack_from(payload, len(_MAGIC))
    try:
        header = _FrameHeader.model_validate_json(payload[start : start + length])
    except ValidationError as error:
        raise KVTransferError(f"the block frame's header is malformed: {error}") from None
    layout = header.layout
    num_blocks = header.shape[2] if len(header.shape) == 6 else 0  # a probe's zero blocks have no hashes
    shape = [layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim]
    if header.shape != shape or min(shape) < 1 or len(header.block_hashes) not in (0, num_blocks):
        # Its bytes may still add up: written into the pool they would be the wrong blocks' KV.
        raise KVTransferError(
            f"the block frame's shape {header.shape} is not its layout's {shape} for its "
            f"{len(header.block_hashes)} blocks"
        )
    raw = bytearray(memoryview(payload)[start + length :])  # one copy: torch wants a writable buffer
    expected = layout.torch_dtype.itemsize * _product(shape)
    if len(raw) != expected:
        raise KVTransferError(f"the block frame holds {len(raw)} tensor bytes, its header says {expected}")
    kv = torch.frombuffer(raw, dtype=torch.uint8).view(layout.torch_dtype).reshape(shape)
    return layout, header.block_hashes, kv


def _product(values: list[int]) -> int:
    result = 1
    for value in values:
        result *= value
    return result


@dataclass(frozen=True, slots=True)
class KVSource:
    """Where leased blocks are: the holding worker's internal address, its lease id and, for a
    peer's hold, the hashes the lease holds."""

    host: str
    port: int
    request_id: str
    block_hashes: tuple[BlockHash, ...] = ()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


class KVTransfer(Protocol):
    """Holds blocks on a peer, fetches leased blocks and ends the lease; any transport may implement it."""

    async def hold(self, peer_url: str, block_hashes: list[BlockHash], layout: KVLayout) -> KVSource | None:
        """Lease the leading run of ``block_hashes`` the peer at ``peer_url`` caches; the lease and
        the hashes it holds (``KVSource.block_hashes``), ``None`` when it holds none of them; raises
        ``KVTransferError``."""
        ...

    async def fetch(
        self, source: KVSource, block_hashes: list[BlockHash], layout: KVLayout
    ) -> tuple[KVLayout, torch.Tensor]:
        """The KV of ``block_hashes`` (in order) and the peer's layout; raises ``KVTransferError``."""
        ...

    async def release(self, source: KVSource) -> None:
        """End the lease (best effort: an unreleased lease expires on its own)."""
        ...

    async def probe(self, url: str, layout: KVLayout, num_blocks: int) -> tuple[int, float]:
        """Bytes and seconds of fetching ``num_blocks`` zero blocks from ``url``; raises ``KVTransferError``."""
        ...


class HttpKVTransfer:
    """``KVTransfer`` over the internal HTTP port, in block frames."""

    def __init__(self, http: httpx.AsyncClient, token: str, *, timeout_s: float = 30.0) -> None:
        self.http = http
        self.headers = {TOKEN_HEADER: token}
        self.timeout = httpx.Timeout(timeout_s, connect=2.0)

    async def hold(self, peer_url: str, block_hashes: list[BlockHash], layout: KVLayout) -> KVSource | None:
        body = HoldRequest(block_hashes=block_hashes, layout=layout)
        response = await self._post(peer_url, INTERNAL_PATHS.kv_hold, body.model_dump_json(), "peer worker")
        try:
            params = KVTransferParams.model_validate_json(response.content)
        except ValidationError as error:
            raise KVTransferError(f"peer worker {peer_url} answered no lease: {error}") from error
        held = params.remote_block_hashes or []
        if not held or params.remote_request_id is None:
            return None
        if params.remote_host is None or params.remote_port is None or held != block_hashes[: len(held)]:
            raise KVTransferError(f"peer worker {peer_url} leased other blocks than asked for")
        return KVSource(params.remote_host, params.remote_port, params.remote_request_id, tuple(held))

    async def probe(self, url: str, layout: KVLayout, num_blocks: int) -> tuple[int, float]:
        """Fetch a frame of ``num_blocks`` zero blocks from ``url`` (this worker's own internal
        port): the bytes and seconds of the transport, frames included, before any real pull."""
        started = time.perf_counter()
        body = ProbeRequest(num_blocks=num_blocks, layout=layout).model_dump_json()
        response = await self._post(url, INTERNAL_PATHS.kv_probe, body, "this worker's internal port")
        try:
            _, _, kv = await asyncio.to_thread(decode_frame, response.content)
        except ValidationError as error:
            raise KVTransferError(f"the probe frame from {url} is malformed: {error}") from error
        return kv.nbytes, time.perf_counter() - started

    async def _post(self, url: str, path: str, body: str, what: str) -> httpx.Response:
        """POST ``body`` to ``url + path``: the 200 answer; ``KVLayoutError`` on 409 and
        ``KVTransferError`` on any other failure."""
        try:
            response = await self.http.post(
                url + path,
                content=body,
                headers={**self.headers, "content-type": "application/json"},
                timeout=self.timeout,
            )
        except (httpx.HTTPError, httpx.InvalidURL, OSError, ExceptionGroup) as error:
            # A peer's answer names the host and port of the next call: a bad one fails the pull only.
            raise KVTransferError(f"{what} {url} unreachable: {error}") from error
        if response.status_code == httpx.codes.CONFLICT:
            raise KVLayoutError(_error_message(response))
        if response.status_code != httpx.codes.OK:
            raise KVTransferError(f"{what} {url} answered {response.status_code}: {_error_message(response)}")
        return response

    async def fetch(
        self, source: KVSource, block_hashes: list[BlockHash], layout: KVLayout
    ) -> tuple[KVLayout, torch.Tensor]:
        body = BlockRequest(remote_request_id=source.request_id, block_hashes=block_hashes, layout=layout)
        response = await self._post(
            source.base_url, INTERNAL_PATHS.kv_blocks, body.model_dump_json(), "KV holder"
        )
        try:
            remote, hashes, kv = await asyncio.to_thread(decode_frame, response.content)  # copies MBs
        except ValidationError as error:
            raise KVTransferError(f"KV holder {source.base_url} sent a malformed frame: {error}") from error
        check_layout(layout, remote, peer=f"KV holder {source.base_url}")
        if hashes != block_hashes:
            raise KVTransferError(f"KV holder {source.base_url} sent other blocks than asked for")
        return remote, kv

    async def release(self, source: KVSource) -> None:
        body = ReleaseRequest(remote_request_id=source.request_id)
        try:
            await self.http.post(
                source.base_url + INTERNAL_PATHS.kv_release,
                content=body.model_dump_json(),
                headers={**self.headers, "content-type": "application/json"},
                timeout=self.timeout,
            )
        except (httpx.HTTPError, httpx.InvalidURL, OSError, ExceptionGroup):
            return  # the lease expires on its own and is counted there


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
