"""The reference attention backend: plain torch indexing and SDPA, on CPU and CUDA alike."""

from __future__ import annotations

import torch
from torch.nn import functional

from herd.worker.layers.attention import AttentionGroup, AttentionMetadata

__all__ = ["TorchAttentionBackend"]


class TorchAttentionBackend:
    """Store by slot mapping, gather each group's context by block tables, then SDPA with GQA."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        key_cache.view(-1, *key.shape[1:]).index_copy_(0, metadata.slot_mapping, key)
        value_cache.view(-1, *value.shape[1:]).index_copy_(0, metadata.slot_mapping, value)
        padded_query = torch.cat([query, query.new_zeros(1, *query.shape[1:])])
        output = torch.empty_like(padded_query)
        for group in metadata.groups:
            result = self._attend(padded_query, key_cache, value_cache, group, scale)
            output.index_copy_(0, group.token_index, result)
        return output[: metadata.num_tokens]

    @staticmethod
    def _attend(
        padded_query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        group: AttentionGroup,
        scale: float,
    ) -> torch.Tensor:
        num_heads, head_dim = padded_query.shape[1:]
        query = padded_query.index_select(0, group.token_index)
        query = query.view(group.batch_size, group.max_query_len, num_heads, head_dim)
        blocks = group.block_tables.flatten()
        context_shape = (group.batch_size, -1, *key_cache.shape[2:])
        keys = key_cache.index_select(0, blocks).view(context_shape)
        values = value_cache.index_select(0, blocks).view(context_shape)
        attended = functional.scaled_dot_product_attention(
            query.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=group.attn_mask,
            scale=scale,
            enable_gqa=True,
        )
        return attended.transpose(1, 2).reshape(-1, num_heads, head_dim)
