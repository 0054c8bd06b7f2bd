"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM) over a paged KV cache.

Module and parameter names follow ``transformers`` so checkpoints load by name. The forward takes
one step's tokens flattened across sequences (``[num_tokens]``), so a whole batch is one call.
The attention, MLP and causal-LM head here serve the other families too (``gemma``, ``qwen3_moe``):
each layer reads its sliding window, scale and soft-cap from ``ModelArgs``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.nn import functional

from herd.worker.layers.attention import AttentionBackend, AttentionMetadata
from herd.worker.layers.linear import Linear
from herd.worker.layers.rotary import RotaryEmbedding, apply_rotary
from herd.worker.models.args import ModelArgs
from herd.worker.parallel import TensorParallel

SINGLE = TensorParallel(0, 1)
"""One rank: every layer whole."""

__all__ = ["ACTIVATIONS", "DecoderModel", "LlamaAttention", "LlamaForCausalLM", "LlamaMLP", "RMSNorm"]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": functional.silu,
    "gelu_pytorch_tanh": partial(functional.gelu, approximate="tanh"),
}
"""The MLP activations by their ``config.json`` name (``ModelArgs.hidden_act``)."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed


def local_heads(args: ModelArgs, parallel: TensorParallel) -> tuple[int, int, int, int]:
    """This rank's heads, in whole KV groups: ``(first query head, query heads, first KV head, KV heads)``."""
    kv_first, num_kv_heads = parallel.part(args.num_kv_heads)
    per_kv = args.num_heads // args.num_kv_heads
    return kv_first * per_kv, num_kv_heads * per_kv, kv_first, num_kv_heads


class LlamaAttention(nn.Module):
    """Layer ``layer_index``'s attention (this rank's heads under tensor parallelism); ``norm`` builds
    the q/k norms of the families that have them."""

    def __init__(
        self,
        args: ModelArgs,
        backend: AttentionBackend,
        layer_index: int,
        norm: Callable[[int, float], nn.Module] = RMSNorm,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        q_first, self.num_heads, kv_first, self.num_kv_heads = local_heads(args, parallel)
        self.head_dim = head_dim = args.head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        rows = {"q_proj": q_first * head_dim, "k_proj": kv_first * head_dim, "v_proj": kv_first * head_dim}
        self.qkv_proj = Linear(
            args.hidden_size,
            {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size},
            bias=args.qkv_bias,
            rows=rows if parallel.size > 1 else None,
        )
        self.o_proj = Linear(
            self.q_size,
            {"o_proj": args.hidden_size},
            bias=args.o_bias,
            columns=(q_first * head_dim, self.q_size) if parallel.size > 1 else None,
            reduce=parallel.all_reduce if parallel.size > 1 else None,
        )
        self.q_norm = norm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = norm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.backend = backend
        self.scale = args.attention_scale
        self.sliding_window = args.layer_windows[layer_index]
        self.softcap = args.attn_softcap
        self.kv_cache = torch.empty(0)

    def forward(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata
    ) -> torch.Tensor:
        query, key, value = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.view(-1, self.num_heads, self.head_dim)
        key = key.view(-1, self.num_kv_heads, self.head_dim)
        value = value.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = apply_rotary(query, *rotary), apply_rotary(key, *rotary)
        attended = self.backend.forward(
            query,
            key,
            value,
            self.kv_cache,
            metadata,
            self.scale,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
        )
        return self.o_proj(attended.flatten(1))  # type: ignore[no-any-return]


class LlamaMLP(nn.Module):
    """The gated MLP (this rank's columns of it under tensor parallelism)."""

    def __init__(self, args: ModelArgs, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        first, self.intermediate_size = parallel.part(args.intermediate_size)
        is_split = parallel.size > 1
        self.gate_up_proj = Linear(
            args.hidden_size,
            {"gate_proj": self.intermediate_size, "up_proj": self.intermediate_size},
            bias=args.mlp_bias,
            rows={"gate_proj": first, "up_proj": first} if is_split else None,
        )
        self.down_proj = Linear(
            self.intermediate_size,
            {"down_proj": args.hidden_size},
            bias=args.mlp_bias,
            columns=(first, self.intermediate_size) if is_split else None,
            reduce=parallel.all_reduce if is_split else None,
        )
        self.activation = ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.activation(gate) * up)  # type: ignore[no-any-return]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, args: ModelArgs, backend: AttentionBackend, layer_index: int, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, backend, layer_index, parallel=parallel)
        self.mlp = LlamaMLP(args, parallel)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))  # type: ignore[no-any-return]


class DecoderModel(nn.Module):
    """What the causal-LM head needs of a family's decoder: its embeddings (a tied ``lm_head``
    shares their weight) and its layers, each attending through ``layer.self_attn``."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList


class LlamaModel(DecoderModel):
    def __init__(
        self,
        args: ModelArgs,
        backend: AttentionBackend,
        max_positions: int,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(args, backend, index, parallel) for index in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary = RotaryEmbedding(args.head_dim, args.rope.theta, max_positions, args.rope.scaling)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rotary = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rotary, metadata)
        return self.norm(x)  # type: ignore[no-any-return]


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states; ``compute_logits`` projects only the rows sampled
    (and soft-caps them where the family does). Another family passes its own decoder ``model``."""

    def __init__(
        self,
        args: ModelArgs,
        backend: AttentionBackend,
        max_positions: int,
        model: DecoderModel | None = None,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.args = args
        self.model = model or LlamaModel(args, backend, max_positions, parallel)
        self.lm_head = Linear(args.hidden_size, {"lm_head": args.vocab_size}, bias=False)

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Give layer ``i`` its slice ``kv_cache[i]`` of the pool ``[layers, 2, blocks, bs, Hkv, D]``."""
        for index, layer in enumerate(self.model.layers):
            assert isinstance(layer.self_attn, LlamaAttention)
            layer.self_attn.kv_cache = kv_cache[index]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        cap = self.args.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
