"""The KV pool's measured shape: an output of the model runner, the input of the block manager."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from herd.worker.models import ModelArgs

__all__ = ["CacheGeometry", "bytes_per_block", "tier_blocks"]


@dataclass(frozen=True)
class CacheGeometry:
    """``holds_kv`` False: an encoder, whose blocks only count each step's tokens (no KV is kept
    across steps, so no prefix cache and no chunked prefill)."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    bytes_per_block: int
    num_host_blocks: int = 0
    """Blocks the host tier holds (0: no host tier)."""
    num_disk_blocks: int = 0
    """Blocks the disk tier holds (0: no disk tier)."""
    holds_kv: bool = True

    @property
    def shape(self) -> tuple[int, ...]:
        """``[layers, K and V, blocks, block_size, kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


def tier_blocks(gib: float, per_block: int) -> int:
    """How many blocks of ``per_block`` bytes ``gib`` GiB of a tier holds."""
    return int(gib * 2**30) // per_block


def bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * dtype.itemsize
