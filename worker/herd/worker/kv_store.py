"""The bytes of the KV tiers below the device pool, and the copies a plan's ``KVMove``s make.

The host tier is one tensor of contiguous slots (``[slots, layers, 2, block_size, kv_heads,
head_dim]``: a slot is one block's bytes, so a copy is one strided-to-contiguous copy per block, about
8x faster on a CPU than an indexed gather over the pool's layout, and a disk write needs no staging),
pinned on CUDA so that a restore is a ``non_blocking`` copy queued ahead of the forward on the same
stream: the host goes on preparing the step's inputs while the copy runs, and the forward reads the
restored blocks after it, in stream order. The disk tier is one preallocated file (unlinked
at once, so it vanishes with the process) of one block per slot, written and read with ``pwrite`` /
``preadv``. A step's moves run in three phases, which the pins of ``herd.worker.kv_tiers`` make
equal to running them in order: every disk write, then every disk read (into a staging tensor), both
before anything else changed, so a failing disk raises ``KVTierError`` with nothing moved; then the
device <-> host copies and the staged disk reads in plan order.

Restores are timed per tier (the router weighs a tier hit by it): a probe at start measures them, so
that the router can price a tier before its first restore; then, on the CPU, where each copy is
synchronous, every restore; on CUDA, where timing a copy would stall it, the probe alone.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

import torch

from herd.api.crd import KVDiskSpec
from herd.api.protocol import Medium
from herd.worker.kv_tiers import KVMove, KVTierError
from herd.worker.runner import Measured

__all__ = ["DiskFile", "TierStore"]

log = logging.getLogger(__name__)

_PROBE_BLOCKS = 8


class DiskFile:
    """``num_slots`` block-sized slots in one preallocated, already unlinked file."""

    def __init__(self, fd: int, num_slots: int, slot_bytes: int) -> None:
        self.fd, self.num_slots, self.slot_bytes = fd, num_slots, slot_bytes

    @classmethod
    def open(cls, spec: KVDiskSpec, slot_bytes: int) -> DiskFile | None:
        """The tier's file, or None (one log line) when it cannot be made: a full or unwritable disk
        degrades to no disk tier."""
        num_slots = int(spec.size_gib * 2**30) // slot_bytes
        try:
            folder = Path(spec.path)
            folder.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="herd-kv-", suffix=".bin", dir=folder)
            os.unlink(name)
            try:
                os.posix_fallocate(fd, 0, num_slots * slot_bytes)
            except OSError:
                os.close(fd)
                raise
        except OSError as error:
            log.error(
                "KV disk tier off: its file cannot be made",
                extra={"path": spec.path, "size_gib": spec.size_gib, "error": str(error)},
            )
            return None
        return cls(fd, num_slots, slot_bytes)

    def write(self, slot: int, data: memoryview) -> None:
        if os.pwrite(self.fd, data, slot * self.slot_bytes) != self.slot_bytes:
            raise OSError(f"short write to KV disk slot {slot}")

    def read_into(self, slot: int, buffer: memoryview) -> None:
        if os.preadv(self.fd, [buffer], slot * self.slot_bytes) != self.slot_bytes:
            raise OSError(f"short read from KV disk slot {slot}")

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class TierStore:
    """The host tier's tensor and the disk tier's file beside a device ``pool``."""

    pool: torch.Tensor
    host: torch.Tensor | None
    disk: DiskFile | None
    measured: Measured

    @classmethod
    def create(
        cls, pool: torch.Tensor, num_host_blocks: int, disk: KVDiskSpec | None, measured: Measured
    ) -> TierStore:
        host = None
        if num_host_blocks:
            shape = (num_host_blocks, *pool[:, :, 0].shape)
            host = torch.zeros(shape, dtype=pool.dtype, pin_memory=pool.is_cuda)
        slot_bytes = pool[:, :, 0].numel() * pool.element_size()
        disk_file = DiskFile.open(disk, slot_bytes) if disk is not None and host is not None else None
        store = cls(pool, host, disk_file, measured)
        store.probe()  # so that the router can price this worker's tiers before its first restore
        return store

    @property
    def num_host_blocks(self) -> int:
        return 0 if self.host is None else self.host.shape[0]

    @property
    def num_disk_blocks(self) -> int:
        return 0 if self.disk is None else self.disk.num_slots

    def drop_disk(self) -> None:
        if self.disk is not None:
            self.disk.close()
            self.disk = None

    def apply(self, moves: list[KVMove]) -> None:
        """Make ``moves`` (see the module docstring for the order)."""
        if not moves:
            return
        staged = self._disk_phase(moves)
        restored: dict[Medium, list[float]] = {"disk": [0, staged.seconds]}
        for (src, dst), run in groupby(moves, key=lambda move: (move.src, move.dst)):
            if dst == "disk":
                continue
            batch = list(run)
            started = time.perf_counter()
            self._copy(src, dst, batch, staged)
            if dst == "device":
                totals = restored.setdefault(src, [0, 0.0])
                totals[0] += len(batch) * self._block_bytes
                totals[1] += time.perf_counter() - started
        if not self.pool.is_cuda:  # on CUDA the copies are still queued: the probe measured them
            for medium, (num_bytes, seconds) in restored.items():
                self.measured.add_restore(medium, int(num_bytes), seconds)

    def probe(self) -> None:
        """Time a few restores from each tier (their blocks' bytes are not otherwise used)."""
        num = min(_PROBE_BLOCKS, self.pool.shape[2], self.num_host_blocks)
        if not num:
            return
        media: list[tuple[Medium, int]] = [("host", num)]
        if self.disk is not None:
            media.append(("disk", min(num, self.num_disk_blocks)))
        for medium, count in media:
            moves = [KVMove(medium, slot, "device", slot) for slot in range(count)]
            saved = self.pool[:, :, :num].clone()  # the probe writes pool blocks: give them back
            started = time.perf_counter()
            staged = self._disk_phase(moves)
            self._copy(medium, "device", moves, staged)
            if self.pool.is_cuda:
                torch.cuda.synchronize(self.pool.device)
            self.measured.add_restore(medium, len(moves) * self._block_bytes, time.perf_counter() - started)
            self.pool[:, :, :num] = saved

    @property
    def _block_bytes(self) -> int:
        return self.pool[:, :, 0].numel() * self.pool.element_size()

    def _disk_phase(self, moves: list[KVMove]) -> _Staged:
        """Every disk write, then every disk read into a staging tensor; ``KVTierError`` on failure."""
        writes = [move for move in moves if move.dst == "disk"]
        reads = [move for move in moves if move.src == "disk"]
        if not writes and not reads:
            return _Staged.empty()
        if self.disk is None or self.host is None:
            raise KVTierError("disk", "a plan moves blocks through a disk tier that is not there")
        try:
            for move in writes:
                self.disk.write(move.dst_slot, _bytes(self.host[move.src_slot]))
            started = time.perf_counter()
            staging = torch.empty((len(reads), *self.host.shape[1:]), dtype=self.pool.dtype)
            for move, block in zip(reads, staging, strict=True):
                self.disk.read_into(move.src_slot, _bytes(block))
        except OSError as error:
            self.drop_disk()
            raise KVTierError("disk", f"the KV disk tier failed: {error}") from error
        rows = {move.src_slot: row for row, move in enumerate(reads)}
        return _Staged(staging, rows, time.perf_counter() - started)

    def _copy(self, src: Medium, dst: Medium, moves: list[KVMove], staged: _Staged) -> None:
        host, pool = self.host, self.pool
        assert host is not None
        for move in moves:
            if src == "device" and dst == "host":
                # Queued on CUDA too: a restore from the slot follows it on the same stream, and the
                # slot reaches the disk in a later step only (pinned), after that step's sampling synced.
                host[move.dst_slot].copy_(pool[:, :, move.src_slot], non_blocking=pool.is_cuda)
            elif src == "host" and dst == "device":
                pool[:, :, move.dst_slot].copy_(host[move.src_slot], non_blocking=True)
            elif src == "disk" and dst == "device":
                pool[:, :, move.dst_slot].copy_(staged.blocks[staged.rows[move.src_slot]], non_blocking=True)
            else:
                raise ValueError(f"no KV move from {src} to {dst}")


@dataclass
class _Staged:
    """A step's disk reads: ``blocks`` one per row (a host slot's layout), the row of each disk
    slot, and the reads' time."""

    blocks: torch.Tensor
    rows: dict[int, int]
    seconds: float

    @classmethod
    def empty(cls) -> _Staged:
        return cls(torch.empty(0), {}, 0.0)


def _bytes(block: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, shared with it (a read into them fills the tensor)."""
    array: Any = block.view(torch.uint8).numpy()
    return memoryview(array).cast("B")
