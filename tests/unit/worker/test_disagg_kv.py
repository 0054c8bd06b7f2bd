"""Disaggregation's pure parts: block frames, layout checks, the lease table, block hold and import."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import torch
from conftest import MODEL_ID, make_seq

from herd.api.kv_hash import block_hashes
from herd.worker.block_manager import BlockManager
from herd.worker.kv_lease import LeaseTable
from herd.worker.kv_transfer import (
    KVLayout,
    KVLayoutError,
    KVTransferError,
    check_layout,
    decode_frame,
    encode_frame,
    lease_run,
    lent_blocks,
)

BS = 4
LAYOUT = KVLayout(model="m", dtype="float32", block_size=BS, num_layers=2, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"], ids=["fp32", "bf16", "fp16"])
def test_a_frame_round_trips_blocks_bit_for_bit(dtype: str) -> None:
    layout = dataclasses.replace(LAYOUT, dtype=dtype)
    kv = torch.randn(2, 2, 3, BS, 2, 8).to(getattr(torch, dtype))
    received, hashes, tensor = decode_frame(encode_frame(layout, [7, 8, 9], kv))
    assert received == layout and hashes == [7, 8, 9]
    assert tensor.dtype == kv.dtype and torch.equal(tensor, kv)


def test_a_frame_carries_raw_bytes_after_a_small_header() -> None:
    kv = torch.zeros(2, 2, 5, BS, 2, 8)
    frame = encode_frame(LAYOUT, [1, 2, 3, 4, 5], kv)
    assert len(frame) - kv.nbytes < 400


def _forged(raw: bytes, **header: object) -> bytes:
    """A frame of two blocks' worth of ``raw`` bytes whose header says ``header`` (over a true one's)."""
    true = {"layout": dataclasses.asdict(LAYOUT), "block_hashes": [1, 2], "shape": [2, 2, 2, BS, 2, 8]}
    encoded = json.dumps({**true, **header}).encode()
    return b"HKV1" + struct.pack("<I", len(encoded)) + encoded + raw


TWO_BLOCKS = bytes(2 * 2 * 2 * BS * 2 * 8 * 4)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"JSON{}",
        encode_frame(LAYOUT, [1], torch.zeros(2, 2, 1, BS, 2, 8))[:-4],
        _forged(TWO_BLOCKS, shape=[len(TWO_BLOCKS) // 4]),  # the bytes add up, the shape does not
        _forged(TWO_BLOCKS[: len(TWO_BLOCKS) // 2], shape=[2, 2, 1, BS, 2, 8]),  # one block for two
        _forged(TWO_BLOCKS, shape=[-2, 2, -2, BS, 2, 8]),
        _forged(b"", block_hashes=[], shape=[2, 2, 0, BS, 2, 8]),
        _forged(TWO_BLOCKS, layout={**dataclasses.asdict(LAYOUT), "x": 1, "dtype": 5}),
        _forged(TWO_BLOCKS, layout={"model": "m"}),
        _forged(TWO_BLOCKS, layout={**dataclasses.asdict(LAYOUT), "num_layers": -2}),
    ],
    ids=["empty", "bad-magic", "truncated-tensor", "flat-shape", "fewer-blocks-than-hashes",
         "negative-shape", "no-blocks", "dtype-not-a-name", "layout-missing-fields", "negative-layout"],
)  # fmt: skip
def test_a_malformed_frame_is_refused(payload: bytes) -> None:
    with pytest.raises(KVTransferError):
        decode_frame(payload)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", "other"),
        ("dtype", "bfloat16"),
        ("block_size", 16),
        ("num_layers", 3),
        ("num_kv_heads", 4),
        ("head_dim", 64),
    ],
    ids=["model", "dtype", "block-size", "layers", "kv-heads", "head-dim"],
)
def test_layout_mismatch_names_the_field(field: str, value: object) -> None:
    remote = dataclasses.replace(LAYOUT, **{field: value})
    with pytest.raises(KVLayoutError, match=field):
        check_layout(LAYOUT, remote, peer="the peer")
    check_layout(LAYOUT, LAYOUT, peer="the peer")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("missing", "num_lent", "asked", "brought"),
    [
        ([0, 1, 2], 3, 3, [0, 1, 2]),  # lacks the whole run, gets it
        ([2, 3], 4, 4, [2, 3]),  # holds the opening blocks, asks through them
        ([1, 3], 4, 4, [1, 3]),  # a hole: the blocks between come along and are not imported
        ([2, 3], 3, 4, [2]),  # the peer lent a shorter run than asked
        ([2, 3], 2, 4, []),  # it lent only blocks the puller holds: an empty pull
        ([2, 3], 0, 4, []),
    ],
    ids=["whole", "tail", "hole", "shorter", "only-held", "none"],
)
def test_a_pull_asks_for_the_leading_run_and_imports_what_it_lacked(
    missing: list[int], num_lent: int, asked: int, brought: list[int]
) -> None:
    hashes = [10, 11, 12, 13, 14]
    assert lease_run(hashes, missing) == hashes[:asked]
    assert lent_blocks(missing, num_lent) == brought


def test_leases_expire_at_their_deadline_and_only_then() -> None:
    clock = Clock()
    table = LeaseTable(clock)
    table.add("a", [3, 4], [30, 40], seconds=5)
    table.add("b", [5], [50], seconds=10)
    assert table.next_expiry() == 105
    clock.now = 104.9
    assert table.pop_expired() == [] and table.get("a") is not None
    clock.now = 105
    assert table.get("a") is None
    assert [lease.request_id for lease in table.pop_expired()] == ["a"]
    assert len(table) == 1 and table.pop("b") is not None and table.next_expiry() is None


def test_a_lease_maps_hashes_to_its_blocks() -> None:
    lease = LeaseTable(Clock()).add("a", [3, 4, 5], [30, 40, 50], seconds=1)
    assert lease.block_ids_for([40, 50]) == [4, 5]
    assert lease.block_ids_for([40, 60]) is None


def test_a_duplicate_lease_is_refused() -> None:
    table = LeaseTable(Clock())
    table.add("a", [1], [10], seconds=1)
    with pytest.raises(ValueError, match="unique"):
        table.add("a", [2], [20], seconds=1)


def prefilled(manager: BlockManager, tokens: list[int]) -> list[int]:
    """Run a prompt through the cache and free it, as a finished prefill does; its block hashes."""
    seq = make_seq(tokens)
    manager.allocate(seq, [], seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.commit(seq, seq.num_computed_tokens)
    manager.free(seq)
    return block_hashes(tokens, BS, model_id=MODEL_ID)


def test_held_blocks_survive_eviction_until_released() -> None:
    manager = BlockManager(4, BS)
    hashes = prefilled(manager, list(range(100, 108)))
    held = manager.hold_prefix(hashes)
    assert len(held) == 2 and manager.num_free_blocks == 2
    other = make_seq(list(range(200, 208)))
    manager.allocate(other, [], 8)  # takes the two free blocks, cannot evict the held ones
    assert all(block_hash in manager.cached for block_hash in hashes)
    manager.release(held)
    manager.free(other)
    assert manager.num_free_blocks == 4


def test_hold_stops_at_the_first_block_not_cached() -> None:
    manager = BlockManager(8, BS)
    hashes = prefilled(manager, list(range(100, 108)))
    assert manager.hold_prefix([hashes[0], 12345, hashes[1]]) == [manager.cached[hashes[0]]]


def test_imported_blocks_are_cache_hits_for_their_prompt() -> None:
    manager = BlockManager(8, BS)
    tokens = list(range(100, 109))
    hashes = block_hashes(tokens, BS, model_id=MODEL_ID)
    imported = [manager.import_block(h, tokens[i * BS : (i + 1) * BS]) for i, h in enumerate(hashes)]
    assert None not in imported
    assert manager.import_block(hashes[0], tokens[:BS]) is None  # already cached
    manager.release([block_id for block_id in imported if block_id is not None])
    assert manager.num_free_blocks == 8
    assert manager.computed_blocks(make_seq(tokens)) == imported
    assert [event.kind for event in manager.events.drain()] == ["stored", "stored"]
