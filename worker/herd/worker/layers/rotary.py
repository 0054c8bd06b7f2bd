"""Rotary position embeddings (the HF "rotate half" layout), with linear and llama3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "apply_rotary"]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths slowed by ``factor``, short kept, a smooth band between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low_freq_factor, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= original / high_freq_factor) & (wavelen <= original / low_freq_factor)
    return torch.where(is_medium, smoothed, scaled)


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    )
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported: herd supports default, linear and llama3")


class RotaryEmbedding(nn.Module):
    """Computes ``(cos, sin)`` for a step's positions from a table built once per device."""

    def __init__(
        self, head_dim: int, theta: float, max_positions: int, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self._inv_freq = _inv_freq(head_dim, theta, scaling)
        self._table: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._get_table(positions.device)
        cos, sin = table[positions].chunk(2, dim=-1)
        return cos.to(dtype), sin.to(dtype)

    def _get_table(self, device: torch.device) -> torch.Tensor:
        if self._table is None or self._table.device != device:
            steps = torch.arange(self.max_positions, dtype=torch.int64, device=device).float()
            freqs = torch.outer(steps, self._inv_freq.to(device))
            angles = torch.cat([freqs, freqs], dim=-1)
            self._table = torch.cat([angles.cos(), angles.sin()], dim=-1)
        return self._table


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by per-token ``cos``/``sin`` ``[T, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
