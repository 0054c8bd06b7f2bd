"""vLLM's KV events translated into herd's: re-hashed with herd's chained hash, mapped back on removal."""

from __future__ import annotations

import pytest

from herd.api.kv_hash import block_hashes, hash_block, root_hash
from herd.sidecar._translate import KVTranslator, Translated
from herd.sidecar._wire import AllBlocksCleared, BlockRemoved, BlockStored, VLLMEvent

MODEL = "m"
BS = 4
PROMPT = list(range(100, 112))  # three blocks of 4
H = block_hashes(PROMPT, BS, model_id=MODEL)  # herd's hashes of those blocks, as the gateway computes them
SALTED = block_hashes(PROMPT, BS, model_id=MODEL, cache_salt="tenant-a")
OTHER_TAIL = hash_block(H[0], [7, 7, 7, 7])


def stored(
    hashes: list[int | bytes], parent: int | bytes | None, tokens: list[int], **fields: object
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, **fields
    )  # type: ignore[arg-type]


CASES: list[tuple[str, list[VLLMEvent], list[Translated | None], list[int]]] = [
    (
        "a-prompt-in-one-event",
        [stored([1, 2, 3], None, PROMPT)],
        [("stored", H)],
        H,
    ),
    (
        "chained-over-events-bytes-hashes",
        [stored([b"\x01", b"\x02"], None, PROMPT[:8]), stored([b"\x03"], b"\x02", PROMPT[8:])],
        [("stored", H[:2]), ("stored", H[2:])],
        H,
    ),
    (
        "a-reused-block-reported-again-is-not-stored-twice",
        [stored([1, 2], None, PROMPT[:8]), stored([1, 2, 3], None, PROMPT)],
        [("stored", H[:2]), ("stored", H[2:])],
        H,
    ),
    (
        "unknown-parent-is-skipped",
        [stored([3], 99, PROMPT[8:])],
        [("stored", [])],
        [],
    ),
    (
        "another-block-size-is-skipped",
        [BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=PROMPT[:8], block_size=8)],
        [("stored", [])],
        [],
    ),
    (
        "removed-maps-back-unknown-ignored",
        [stored([1, 2, 3], None, PROMPT), BlockRemoved(block_hashes=[3, 42])],
        [("stored", H), ("removed", [H[2]])],
        H[:2],
    ),
    (
        "a-branch-shares-its-parent",
        [stored([1, 2], None, PROMPT[:8]), stored([4], 1, [7, 7, 7, 7]), BlockRemoved(block_hashes=[2])],
        [("stored", H[:2]), ("stored", [OTHER_TAIL]), ("removed", [H[1]])],
        [H[0], OTHER_TAIL],
    ),
    (
        "two-vllm-blocks-one-herd-hash-removed-with-the-last",
        [stored([1], None, PROMPT[:4]), stored([5], None, PROMPT[:4], extra_keys=[[["image-1", 0]]]),
         BlockRemoved(block_hashes=[1]), BlockRemoved(block_hashes=[5])],
        [("stored", H[:1]), ("stored", []), ("removed", []), ("removed", H[:1])],
        [],
    ),
    (
        "cache-salt-from-the-first-blocks-extra-keys",
        [stored([1, 2], None, PROMPT[:8], extra_keys=[["tenant-a"], None])],
        [("stored", SALTED[:2])],
        SALTED[:2],
    ),
    (
        "salt-after-the-lora-name",
        [stored([1], None, PROMPT[:4], lora_name="ad", extra_keys=[["ad", "tenant-a"]])],
        [("stored", [hash_block(root_hash(MODEL, "tenant-a", "ad"), PROMPT[:4])])],
        [hash_block(root_hash(MODEL, "tenant-a", "ad"), PROMPT[:4])],
    ),
    (
        "cleared-forgets-everything",
        [stored([1, 2, 3], None, PROMPT), AllBlocksCleared(), BlockRemoved(block_hashes=[1])],
        [("stored", H), ("cleared", []), ("removed", [])],
        [],
    ),
    (
        "cpu-offload-is-the-host-tier",
        [stored([1, 2], None, PROMPT[:8], medium="GPU"), stored([1, 2], None, [], medium="CPU"),
         BlockRemoved(block_hashes=[1, 2], medium="GPU"), BlockRemoved(block_hashes=[2], medium="CPU")],
        [("stored", H[:2]), ("stored", H[:2], "host"), ("removed", H[:2]), ("removed", H[1:2], "host")],
        [],
    ),
    (
        "an-unnamed-offload-is-skipped-unknown-media-ignored",
        [stored([9], None, [], medium="CPU"), stored([1], None, PROMPT[:4], medium="NVME")],
        [("stored", [], "host"), None],
        [],
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("events", "expected", "held"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_translation(events: list[VLLMEvent], expected: list[Translated | None], held: list[int]) -> None:
    translator = KVTranslator(MODEL, BS)
    assert [translator.translate(event) for event in events] == expected
    assert sorted(translator.block_hashes) == sorted(held)


def test_the_host_tier_is_in_the_snapshot() -> None:
    translator = KVTranslator(MODEL, BS)
    translator.translate(stored([1, 2, 3], None, PROMPT))
    translator.translate(stored([1, 3], None, [], medium="CPU"))
    assert {medium: sorted(held) for medium, held in translator.tier_block_hashes.items()} == {
        "host": sorted([H[0], H[2]])
    }


def test_skipped_blocks_are_counted() -> None:
    translator = KVTranslator(MODEL, BS)
    translator.translate(stored([3, 4], 99, PROMPT[4:12]))
    assert translator.num_skipped_blocks == 2
