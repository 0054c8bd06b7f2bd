"""The reference attention backend: plain torch indexing and SDPA, on CPU and CUDA alike.

SDPA has no soft-capping, so a soft-capped layer (Gemma 2) computes its scores, caps, masks and
softmaxes them (in float32, as ``transformers``' eager attention does) in plain torch instead.
"""

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
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        key_cache.view(-1, *key.shape[1:]).index_copy_(0, metadata.slot_mapping, key)
        value_cache.view(-1, *value.shape[1:]).index_copy_(0, metadata.slot_mapping, value)
        results = [
            self._attend(
                query[group.first_row : group.first_row + group.num_tokens],
                key_cache,
                value_cache,
                group,
                *group.view(sliding_window),
                scale,
                softcap,
            )
            for group in metadata.groups
        ]
        return results[0] if len(results) == 1 else torch.cat(results)

    @staticmethod
    def _attend(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        group: AttentionGroup,
        block_tables: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        num_heads, head_dim = query.shape[1:]
        batch, query_len, num_kv_heads = group.batch_size, group.query_len, key_cache.shape[2]
        per_kv = num_heads // num_kv_heads
        # GQA without copying K/V per query head: the query heads that share a KV head become extra
        # query rows of that head, [B, Hkv, per_kv * q, D]; the mask repeats for each of them (a
        # decode's single row broadcasts instead).
        query = query.view(batch, query_len, num_kv_heads, per_kv, head_dim).permute(0, 2, 3, 1, 4)
        blocks = block_tables.flatten()
        context_shape = (batch, -1, *key_cache.shape[2:])
        keys = key_cache.index_select(0, blocks).view(context_shape).transpose(1, 2)
        values = value_cache.index_select(0, blocks).view(context_shape).transpose(1, 2)
        mask = mask if query_len == 1 else mask.repeat(1, 1, per_kv, 1)
        query = query.reshape(batch, num_kv_heads, per_kv * query_len, head_dim)
        if softcap is None:
            attended = functional.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale
            )
        else:
            attended = _softcapped_attention(query, keys, values, mask, scale, softcap)
        attended = attended.view(batch, num_kv_heads, per_kv, query_len, head_dim).permute(0, 3, 1, 2, 4)
        return attended.reshape(-1, num_heads, head_dim)


def _softcapped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    scores = torch.tanh(query @ keys.transpose(-1, -2) * scale / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype) @ values
