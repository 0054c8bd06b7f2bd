"""Gemma 2 and Gemma 3 (text): the Llama decoder's attention and MLP with Gemma's differences.

As in ``transformers``: RMSNorm scales by ``1 + weight`` in float32; each layer norms before and
after both its attention and its MLP (four norms); the MLP is gated GeLU-tanh; embeddings are scaled
by ``sqrt(hidden_size)`` in the model's dtype; queries by ``query_pre_attn_scalar ** -0.5``; local
(sliding) and global layers alternate; Gemma 2 soft-caps attention scores and final logits, Gemma 3
norms queries and keys per head and rotates its local layers with their own base frequency.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from herd.worker.layers.attention import AttentionBackend, AttentionMetadata
from herd.worker.layers.rotary import RotaryEmbedding
from herd.worker.models.args import ModelArgs
from herd.worker.models.llama import DecoderModel, LlamaAttention, LlamaForCausalLM, LlamaMLP

__all__ = ["GemmaForCausalLM", "GemmaRMSNorm"]


class GemmaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, backend: AttentionBackend, layer_index: int) -> None:
        super().__init__()
        self.is_sliding = args.layer_windows[layer_index] is not None
        self.self_attn = LlamaAttention(args, backend, layer_index, norm=GemmaRMSNorm)
        self.mlp = LlamaMLP(args)
        (
            self.input_layernorm,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        ) = (GemmaRMSNorm(args.hidden_size, args.rms_norm_eps) for _ in range(4))

    def forward(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rotary, metadata))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))  # type: ignore[no-any-return]


class GemmaModel(DecoderModel):
    def __init__(self, args: ModelArgs, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.embed_scale = args.hidden_size**0.5
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(args, backend, index) for index in range(args.num_layers)
        )
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary = RotaryEmbedding(args.head_dim, args.rope.theta, max_positions, args.rope.scaling)
        local = args.sliding_rope
        self.sliding_rotary = (
            RotaryEmbedding(args.head_dim, local.theta, max_positions, local.scaling) if local else None
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rotary = self.rotary(positions, x.dtype)
        sliding = rotary if self.sliding_rotary is None else self.sliding_rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, sliding if layer.is_sliding else rotary, metadata)
        return self.norm(x)  # type: ignore[no-any-return]


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (``args`` tells them apart)."""

    def __init__(self, args: ModelArgs, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__(args, backend, max_positions, GemmaModel(args, backend, max_positions))
