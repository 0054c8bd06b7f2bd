"""The disk tier written behind the step: a queued block reads back as queued, the newest write of a
slot wins, only a full queue waits, a failed write is raised by the next one and loses no block, and
the file's bytes are the blocks' bytes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from herd.api.crd import KVDiskSpec
from herd.worker.kv_store import DiskFile, WriteBehind

SLOT_BYTES = 64
WAIT = 10.0


class GatedFile:
    """Slots in memory whose writes wait for ``gate``: a disk as slow as the test wants it."""

    num_slots = 8
    slot_bytes = SLOT_BYTES

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.fail = False
        self.slots: dict[int, bytes] = {}
        self.writes: list[int] = []
        self.closed = threading.Event()

    def write(self, slot: int, data: memoryview) -> None:
        assert self.gate.wait(WAIT), "the test never opened the gate"
        if self.fail:
            raise OSError("no space left on the KV disk")
        self.slots[slot] = bytes(data)
        self.writes.append(slot)

    def read_into(self, slot: int, buffer: memoryview) -> None:
        buffer[:] = self.slots[slot]

    def close(self) -> None:
        self.closed.set()


def block(value: int) -> torch.Tensor:
    """One slot's bytes as a block of bfloat16 values (a block's layout is the caller's)."""
    return torch.full((SLOT_BYTES // 2,), value, dtype=torch.bfloat16)


def read(disk: WriteBehind, slot: int) -> torch.Tensor:
    out = torch.empty(SLOT_BYTES // 2, dtype=torch.bfloat16)
    disk.read_into(slot, out)
    return out


@pytest.fixture
def file() -> GatedFile:
    return GatedFile()


def test_a_queued_block_reads_back_before_and_after_it_is_written(file: GatedFile) -> None:
    disk = WriteBehind(file, depth=4)
    disk.write(3, block(7))
    assert disk.num_queued == 1 and not file.writes  # the caller did not wait for the disk
    assert torch.equal(read(disk, 3), block(7))
    file.gate.set()
    assert disk.wait_written(WAIT)
    assert file.writes == [3] and disk.num_queued == 0
    assert torch.equal(read(disk, 3), block(7))
    disk.close()
    assert file.closed.is_set()


def test_the_newest_write_of_a_slot_wins(file: GatedFile) -> None:
    disk = WriteBehind(file, depth=4)
    disk.write(1, block(1))
    disk.write(1, block(2))
    assert torch.equal(read(disk, 1), block(2))
    file.gate.set()
    assert disk.wait_written(WAIT)
    assert file.writes == [1, 1]
    assert torch.equal(read(disk, 1), block(2))
    disk.close()


def test_the_queued_bytes_are_a_copy(file: GatedFile) -> None:
    """The host slot a block came from may take another block in the same step."""
    disk = WriteBehind(file, depth=2)
    source = block(5)
    disk.write(0, source)
    source.fill_(9)
    assert torch.equal(read(disk, 0), block(5))
    file.gate.set()
    assert disk.wait_written(WAIT)
    assert torch.equal(read(disk, 0), block(5))
    disk.close()


def test_only_a_full_queue_waits(file: GatedFile) -> None:
    disk = WriteBehind(file, depth=2)
    disk.write(0, block(0))
    disk.write(1, block(1))
    third = threading.Thread(target=disk.write, args=(2, block(2)))
    third.start()
    third.join(0.2)
    assert third.is_alive()  # both rows are queued: it waits for the oldest write
    file.gate.set()
    third.join(WAIT)
    assert not third.is_alive()
    assert disk.wait_written(WAIT)
    assert file.writes == [0, 1, 2]
    disk.close()


def test_a_failed_write_is_raised_by_the_next_and_loses_no_block(file: GatedFile) -> None:
    disk = WriteBehind(file, depth=4)
    file.fail = True
    disk.write(0, block(3))
    disk.write(1, block(4))
    file.gate.set()
    assert disk.wait_written(WAIT)
    with pytest.raises(OSError, match="no space left"):
        disk.check()
    with pytest.raises(OSError, match="no space left"):
        disk.write(2, block(5))
    assert torch.equal(read(disk, 0), block(3))  # never on the disk: still answered from the queue
    assert torch.equal(read(disk, 1), block(4))
    disk.close()
    assert file.closed.is_set()


def test_close_drops_the_queue_and_ends_the_writer(file: GatedFile) -> None:
    disk = WriteBehind(file, depth=4)
    disk.write(0, block(0))
    disk.write(1, block(1))
    file.gate.set()
    disk.close()
    assert file.closed.is_set()
    assert set(file.writes) <= {0, 1}


def test_the_disk_file_holds_the_blocks_bytes(tmp_path: Path) -> None:
    spec = KVDiskSpec.model_validate({"path": str(tmp_path), "sizeGiB": 8 * SLOT_BYTES / 2**30})
    made = DiskFile.open(spec, SLOT_BYTES)
    assert made is not None and made.num_slots == 8
    disk = WriteBehind(made, depth=2)
    blocks = {slot: torch.randn(SLOT_BYTES // 2).to(torch.bfloat16) for slot in range(8)}
    for slot, data in blocks.items():
        disk.write(slot, data)
    assert disk.wait_written(WAIT)
    for slot, data in blocks.items():
        assert torch.equal(read(disk, slot), data)
    disk.close()
