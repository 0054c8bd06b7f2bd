"""KV block hashing: the one definition shared by the worker's prefix cache and the router.

A prompt's token ids are cut into full blocks of ``block_size`` tokens; a trailing partial block
is never hashed (it can still grow, so it cannot be shared). Block ``i`` gets

    h_i = H(h_{i-1} || tokens_i)        with   h_{-1} = H(seed || model_id || cache_salt [|| lora_name])

where ``H`` is BLAKE2b truncated to 64 bits. Chaining makes a hash name the whole prefix up to and
including its block, so "the first k hashes match" means "the first k*block_size tokens match".
Cost: one BLAKE2b call over ``8 + 4*block_size`` bytes per block (about 1 us), linear in the prompt.
The model identity, ``cache_salt`` and the LoRA adapter (``lora_name``, the block's extra key: an
adapter changes every layer's keys and values) enter only through the root, so two tenants, two
models or two adapters never share a chain; a base-model prompt's root is the same as before
adapters existed.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

__all__ = ["BlockHash", "block_hashes", "hash_block", "root_hash"]

BlockHash = int
"""An unsigned 64-bit block hash."""

_SEED = b"herd.kv.v1"
_DIGEST_SIZE = 8


def _digest(payload: bytes) -> BlockHash:
    return int.from_bytes(hashlib.blake2b(payload, digest_size=_DIGEST_SIZE).digest(), "little")


def root_hash(model_id: str, cache_salt: str | None = None, lora_name: str | None = None) -> BlockHash:
    """The parent of a prompt's first block: the seed mixed with the model, the salt and the adapter."""
    salt = "" if cache_salt is None else cache_salt
    payload = _SEED + b"\x00" + model_id.encode() + b"\x00" + salt.encode()
    if lora_name is not None:
        payload += b"\x00lora\x00" + lora_name.encode()
    return _digest(payload)


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block, chained to its parent's hash."""
    return _digest(struct.pack("<Q", parent) + array("i", token_ids).tobytes())


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    model_id: str,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, in order; the partial tail is skipped."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = root_hash(model_id, cache_salt, lora_name)
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
