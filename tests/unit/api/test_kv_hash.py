from __future__ import annotations

import pytest

from herd.api import block_hashes, hash_block, root_hash

TOKENS = list(range(100, 164))  # 64 tokens = 4 blocks of 16


def test_same_tokens_give_the_same_chain() -> None:
    assert block_hashes(TOKENS, 16, model_id="m") == block_hashes(list(TOKENS), 16, model_id="m")


def test_chain_links_each_block_to_its_parent() -> None:
    hashes = block_hashes(TOKENS, 16, model_id="m")
    parent = root_hash("m")
    for index, value in enumerate(hashes):
        parent = hash_block(parent, TOKENS[index * 16 : (index + 1) * 16])
        assert value == parent


@pytest.mark.parametrize(
    ("kwargs", "other"),
    [
        ({"model_id": "m"}, {"model_id": "other-model"}),
        ({"model_id": "m"}, {"model_id": "m", "cache_salt": "tenant-a"}),
        ({"model_id": "m", "cache_salt": "tenant-a"}, {"model_id": "m", "cache_salt": "tenant-b"}),
        ({"model_id": "m"}, {"model_id": "m", "lora_name": "support-bot"}),
        ({"model_id": "m", "lora_name": "a"}, {"model_id": "m", "lora_name": "b"}),
        ({"model_id": "m", "cache_salt": "x", "lora_name": "a"}, {"model_id": "m", "cache_salt": "xa"}),
    ],
    ids=["model-identity", "salt-vs-none", "salt-vs-salt", "lora-vs-base", "lora-vs-lora", "lora-vs-salt"],
)
def test_identity_and_salt_change_every_hash(kwargs: dict[str, str], other: dict[str, str]) -> None:
    first = block_hashes(TOKENS, 16, **kwargs)  # type: ignore[arg-type]
    second = block_hashes(TOKENS, 16, **other)  # type: ignore[arg-type]
    assert not set(first) & set(second)


def test_a_base_model_root_is_unchanged_by_adapters() -> None:
    """Adapters came later: a base-model prompt hashes as it did before (caches and peers agree)."""
    assert root_hash("m", "s", None) == root_hash("m", "s") == 0x2CD0AE418242AB67


@pytest.mark.parametrize(
    ("num_tokens", "num_blocks"),
    [(0, 0), (15, 0), (16, 1), (17, 1), (47, 2), (64, 4)],
    ids=lambda v: str(v),
)
def test_partial_blocks_are_not_hashed(num_tokens: int, num_blocks: int) -> None:
    assert len(block_hashes(TOKENS[:num_tokens], 16, model_id="m")) == num_blocks


def test_shared_prefix_shares_leading_hashes_only() -> None:
    changed = [*TOKENS[:40], 7, *TOKENS[41:]]
    a, b = block_hashes(TOKENS, 16, model_id="m"), block_hashes(changed, 16, model_id="m")
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]  # a change poisons every later block


def test_hashes_are_unsigned_64_bit() -> None:
    assert all(0 <= h < 2**64 for h in block_hashes(TOKENS, 16, model_id="m"))


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(TOKENS, 0, model_id="m")
