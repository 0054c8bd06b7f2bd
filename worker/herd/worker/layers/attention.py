"""The attention-backend interface and the per-step metadata every backend reads.

A step's tokens come flattened (``[num_tokens, heads, head_dim]``) from sequences at different
positions. Each backend stores the new keys and values into the paged pool at ``slot_mapping`` and
attends each query to its sequence's cached context through ``block_tables``. The reference
backend pads sequences into groups of similar shape (decodes of similar context length together;
each prefill chunk alone), so neither a long prefill nor a long context inflates the padding of a
batch of short decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["AttentionBackend", "AttentionGroup", "AttentionMetadata"]


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together as a padded batch of ``[batch, max_query_len]`` queries.

    ``token_index`` maps each padded query to its row in the flat step (padding maps to the extra
    row ``num_tokens``); ``attn_mask`` allows key ``j`` for a query at position ``p`` iff ``j <= p``
    (padding queries sit at position 0, so no row is fully masked).
    """

    token_index: torch.Tensor  # [batch * max_query_len]
    block_tables: torch.Tensor  # [batch, max_blocks]
    attn_mask: torch.Tensor  # [batch, 1, max_query_len, max_blocks * block_size]
    batch_size: int
    max_query_len: int


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: where each new token's K/V goes in the pool
    groups: tuple[AttentionGroup, ...]
    num_tokens: int


class AttentionBackend(Protocol):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attend ``query`` ``[T, H, D]`` after storing ``key``/``value`` ``[T, Hkv, D]`` into
        ``kv_cache`` ``[2, num_blocks, block_size, Hkv, D]``; returns ``[T, H, D]``."""
        ...
