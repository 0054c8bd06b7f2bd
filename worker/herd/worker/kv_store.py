"""The bytes of the KV tiers below the device pool, and the copies a plan's ``KVMove``s make.

The host tier is one tensor of contiguous slots (``[slots, layers, 2, block_size, kv_heads,
head_dim]``: a slot is one block's bytes, so a copy is one strided-to-contiguous copy per block, about
8x faster on a CPU than an indexed gather over the pool's layout, and a disk write needs no staging),
pinned on CUDA so that a restore is a ``non_blocking`` copy queued ahead of the forward on the same
stream: the host goes on preparing the step's inputs while the copy runs, and the forward reads the
restored blocks after it, in stream order. The disk tier is one preallocated file (unlinked
at once, so it vanishes with the process) of one block per slot, written and read with ``pwrite`` /
``preadv``, written behind the step (``WriteBehind``): a step copies a block it demotes into a queue
and goes on, a thread writes the queue out. A step's moves run in three phases, which the pins of
``herd.worker.kv_tiers`` make equal to running them in order: every disk write queued, then every
disk read (into a staging tensor; a slot whose write is still queued is read from the queue), both
before anything else changed, so a failing disk raises ``KVTierError`` with nothing moved (a write
that failed behind an earlier step is raised by the next step that touches the disk, before it
reads a slot); then the device <-> host copies and the staged disk reads in plan order.

Restores are timed per tier (the router weighs a tier hit by it): a probe at start measures them, so
that the router can price a tier before its first restore; then, on the CPU, where each copy is
synchronous, every restore; on CUDA, where timing a copy would stall it, the probe alone.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any, Protocol

import torch

from herd.api.crd import KVDiskSpec
from herd.api.protocol import Medium
from herd.worker.kv_tiers import KVMove, KVTierError, disk_write_queue_depth
from herd.worker.runner import Measured

__all__ = ["DiskFile", "TierStore", "WriteBehind"]

log = logging.getLogger(__name__)

_PROBE_BLOCKS = 8
_CLOSE_SECONDS = 10.0
"""How long closing the disk tier waits for the write in progress (a hung disk is left behind)."""


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


class BlockFile(Protocol):
    """What ``WriteBehind`` writes to: ``num_slots`` slots of ``slot_bytes``."""

    num_slots: int
    slot_bytes: int

    def write(self, slot: int, data: memoryview) -> None: ...

    def read_into(self, slot: int, buffer: memoryview) -> None: ...

    def close(self) -> None: ...


class WriteBehind:
    """A ``BlockFile`` written on a thread of its own, so that a step never waits for the disk.

    ``write`` copies the block into one of ``depth`` rows and queues it; the thread writes the queue
    out in order. Until a slot's write is done, a read of the slot is answered from its row (the
    newest queued write of a slot, which is what the disk holds once the queue is out). Only a full
    queue makes ``write`` wait, for the oldest write. The first failed write stops the writing: it
    is raised by the next ``write`` or ``check``, and what was queued stays readable from its rows,
    so no read returns a slot the disk did not take. The thread closes the file when it ends.
    """

    def __init__(self, file: BlockFile, depth: int) -> None:
        self.file = file
        self.error: OSError | None = None
        self._rows = torch.empty((depth, file.slot_bytes), dtype=torch.uint8)
        self._free = list(range(depth))
        self._queue: deque[tuple[int, int]] = deque()  # (slot, row), oldest first
        self._newest: dict[int, int] = {}  # slot -> the row of its newest queued write
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="herd-kv-disk-writer", daemon=True)
        self._thread.start()

    @property
    def num_slots(self) -> int:
        return self.file.num_slots

    @property
    def num_queued(self) -> int:
        return len(self._newest)

    def check(self) -> None:
        """Raise the error a write behind an earlier step met, if one did."""
        if self.error is not None:
            raise self.error

    def write(self, slot: int, block: torch.Tensor) -> None:
        """Queue ``block`` (a contiguous CPU tensor of one slot's bytes) for ``slot``."""
        with self._changed:
            while not self._free and self.error is None:
                self._changed.wait()
            self.check()
            row = self._free.pop()
        self._rows[row].copy_(_flat(block))  # the row is this thread's until it is queued
        with self._changed:
            self._newest[slot] = row
            self._queue.append((slot, row))
            self._changed.notify_all()

    def read_into(self, slot: int, block: torch.Tensor) -> None:
        """Fill ``block`` with ``slot``'s bytes, from the queue while its write is in it."""
        with self._changed:
            row = self._newest.get(slot)
            if row is not None:
                _flat(block).copy_(self._rows[row])
                return
        self.file.read_into(slot, _bytes(block))  # no write of it is queued meanwhile: we queue them

    def wait_written(self, timeout: float) -> bool:
        """Wait until the queue is written out (or a write failed); whether it was within ``timeout``."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._newest or self.error is not None, timeout)

    def close(self) -> None:
        """Drop what is still queued (the file goes with the process) and end the thread."""
        with self._changed:
            self._closed = True
            self._queue.clear()
            self._changed.notify_all()
        self._thread.join(_CLOSE_SECONDS)
        if self._thread.is_alive():
            log.warning("KV disk tier: a write did not end in time; its file is left open")

    def _run(self) -> None:
        try:
            while (item := self._next()) is not None:
                slot, row = item
                try:
                    self.file.write(slot, _bytes(self._rows[row]))
                except OSError as error:
                    with self._changed:  # rows and queued slots are kept: reads answer from them
                        self.error = error
                        self._changed.notify_all()
                    continue
                with self._changed:
                    if self._newest.get(slot) == row:
                        del self._newest[slot]
                    self._free.append(row)
                    self._changed.notify_all()
        finally:
            self.file.close()  # here, not in ``close``: no write may reach a reused descriptor

    def _next(self) -> tuple[int, int] | None:
        """The oldest queued write, once the last is done; None once closed. After a failure the
        queue is dropped as it comes (``write`` refuses more)."""
        with self._changed:
            while True:
                if self._closed:
                    return None
                if self._queue and self.error is None:
                    return self._queue.popleft()
                self._queue.clear()
                self._changed.wait()


@dataclass
class TierStore:
    """The host tier's tensor and the disk tier's file beside a device ``pool``."""

    pool: torch.Tensor
    host: torch.Tensor | None
    disk: WriteBehind | None
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
        disk_tier = None
        if disk_file is not None:
            disk_tier = WriteBehind(disk_file, disk_write_queue_depth(disk_file.num_slots, slot_bytes))
        store = cls(pool, host, disk_tier, measured)
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

    def close(self) -> None:
        """Stop the disk tier's writer and close its file; the device and host tiers are tensors the
        runner's owner lets go of, with no thread or descriptor to end."""
        self.drop_disk()

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
            self.disk.check()
            for move in writes:
                self.disk.write(move.dst_slot, self.host[move.src_slot])
            started = time.perf_counter()
            staging = torch.empty((len(reads), *self.host.shape[1:]), dtype=self.pool.dtype)
            for move, block in zip(reads, staging, strict=True):
                self.disk.read_into(move.src_slot, block)
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


def _flat(block: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat ``uint8`` view of it."""
    return block.view(torch.uint8).view(-1)


def _bytes(block: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, shared with it (a read into them fills the tensor)."""
    array: Any = block.view(torch.uint8).numpy()
    return memoryview(array).cast("B")
