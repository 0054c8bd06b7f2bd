"""The attention-backend interface and the per-step metadata every backend reads.

A step's tokens come flattened (``[num_tokens, heads, head_dim]``) from sequences at different
positions, laid out group by group: decodes of similar context length together, each prefill chunk
alone, so neither a long prefill nor a long context inflates the padding of a batch of short
decodes, and no query is padded. Each backend stores all the step's new keys and values into the
paged pool at ``slot_mapping`` before any query attends (the scheduler relies on it: a sequence
may attend to blocks that another sequence of the same step fills), then attends each query to its
sequence's cached context through ``block_tables``.

A layer with a sliding window attends only to the keys within the window of each query's own
position; every block stays in the pool (prefix caching and chunked prefill see the same blocks
as for a global layer), and the layer gathers only the blocks its queries' windows reach.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["AttentionBackend", "AttentionGroup", "AttentionMetadata", "WindowView"]


@dataclass(frozen=True)
class WindowView:
    """What a sliding layer with window ``w`` reads of a group: each sequence's blocks from the one
    holding its first query's position ``- w + 1`` (``block_tables``), and ``attn_mask`` over them,
    allowing key ``j`` for a query at ``p`` iff ``p - w < j <= p`` (the query and the ``w - 1`` keys
    before it, as ``transformers`` masks a sliding layer)."""

    block_tables: torch.Tensor  # [batch, window_blocks]
    attn_mask: torch.Tensor  # [batch, 1, query_len, window_blocks * block_size]


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together as a batch of ``[batch, query_len]`` queries: decodes
    (``query_len`` 1) or a single prefill chunk (``batch`` 1), at the flat step's rows
    ``first_row`` to ``first_row + num_tokens``; ``attn_mask`` allows key ``j`` for a query at
    position ``p`` iff ``j <= p`` (it also masks the padding of shorter contexts' block tables);
    ``windows`` holds a ``WindowView`` for each sliding window of the model.
    """

    first_row: int
    block_tables: torch.Tensor  # [batch, max_blocks]
    attn_mask: torch.Tensor  # [batch, 1, query_len, max_blocks * block_size]
    batch_size: int
    query_len: int
    windows: Mapping[int, WindowView] = field(default_factory=dict)

    def view(self, sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block tables and mask of a layer with that window (``None``: a global layer)."""
        if sliding_window is None:
            return self.block_tables, self.attn_mask
        window = self.windows[sliding_window]
        return window.block_tables, window.attn_mask

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.query_len


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
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attend ``query`` ``[T, H, D]`` after storing ``key``/``value`` ``[T, Hkv, D]`` into
        ``kv_cache`` ``[2, num_blocks, block_size, Hkv, D]``; returns ``[T, H, D]``. A layer with a
        ``sliding_window`` attends through ``AttentionGroup.view(sliding_window)``; ``softcap``
        caps the scaled scores at ``softcap * tanh(score / softcap)`` before the mask (Gemma 2)."""
        ...
