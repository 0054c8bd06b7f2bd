"""The BERT encoder (``BertModel``: all-MiniLM, BGE, E5 and the other sentence-transformers BERTs).

Every token attends to every token of its own sequence (bidirectional), so a sequence runs whole
in one forward and keeps no KV cache across steps. The forward takes a step's sequences flattened
(``[num_tokens]``), so the linear layers run on exactly the real tokens; only attention lays them
out padded, one SDPA call per group with the padding masked off the keys.
Attention groups sequences of similar length (``EncoderBatch``), so one long input does not make a
step's short ones attend over its length. Module and parameter names follow ``transformers`` so checkpoints load by name (q/k/v stacked into
one ``Linear`` as in the decoders).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from herd.worker.layers.linear import Linear
from herd.worker.models.args import UnsupportedModelError

__all__ = ["ENCODER_ARCHITECTURES", "BertArgs", "BertModel", "EncoderBatch", "PaddedGroup"]

ENCODER_ARCHITECTURES = frozenset({"BertModel"})
"""The encoder architectures herd runs (as embedding models), by their ``config.json`` name."""

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": functional.gelu,
    "gelu_new": partial(functional.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(functional.gelu, approximate="tanh"),
    "relu": functional.relu,
}


@dataclass(frozen=True)
class BertArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    checkpoint_dtype: str | None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> BertArgs:
        """The encoder's shape; ``UnsupportedModelError`` for what herd cannot run exactly."""
        position = config.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise UnsupportedModelError(
                f"a BertModel with position_embedding_type {position!r}, which herd cannot run: "
                "it runs absolute position embeddings"
            )
        activation = config.get("hidden_act", "gelu")
        if activation not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"a BertModel with hidden_act {activation!r}, which herd cannot run: it runs "
                + ", ".join(sorted(_ACTIVATIONS))
            )
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=int(config["num_attention_heads"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 512)),
            type_vocab_size=int(config.get("type_vocab_size", 2)),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
            hidden_act=activation,
            checkpoint_dtype=config.get("dtype") or config.get("torch_dtype"),
        )


MIN_SPLIT_TOKENS = 16
"""Sequences whose lengths differ by fewer tokens share an attention group whatever the ratio."""


@dataclass(frozen=True)
class PaddedGroup:
    """Sequences of similar length attended together, padded to ``max_len``: ``padded_rows`` is the
    flat row of each slot (0 on padding), ``real_slots`` the slots of the real tokens, ``key_mask``
    ``[batch, 1, 1, max_len]`` True on real tokens."""

    padded_rows: torch.Tensor
    real_slots: torch.Tensor
    key_mask: torch.Tensor
    batch_size: int
    max_len: int


@dataclass(frozen=True)
class EncoderBatch:
    """A step's sequences, flat (``[num_tokens]`` rows, one sequence after another) for the linear
    layers, and in groups of similar length for attention (``groups``, shortest first): a group
    starts where a sequence is over twice as long as the group's shortest and at least
    ``MIN_SPLIT_TOKENS`` longer, so padding stays under half of each group's attention.
    ``order`` takes the groups' outputs, concatenated, back to the flat rows."""

    groups: tuple[PaddedGroup, ...]
    order: torch.Tensor

    @classmethod
    def of(cls, lengths: list[int], device: torch.device) -> EncoderBatch:
        offsets = [sum(lengths[:index]) for index in range(len(lengths))]
        groups: list[list[int]] = []
        for index in sorted(range(len(lengths)), key=lengths.__getitem__):
            shortest = lengths[groups[-1][0]] if groups else 0
            if not groups or (
                lengths[index] > 2 * shortest and lengths[index] - shortest >= MIN_SPLIT_TOKENS
            ):
                groups.append([])
            groups[-1].append(index)
        order = [0] * sum(lengths)
        position = 0
        for group in groups:
            for index in group:
                for token in range(lengths[index]):
                    order[offsets[index] + token] = position
                    position += 1
        padded = tuple(
            _padded([lengths[i] for i in group], [offsets[i] for i in group], device) for group in groups
        )
        return cls(padded, torch.tensor(order, device=device))


def _padded(lengths: list[int], offsets: list[int], device: torch.device) -> PaddedGroup:
    max_len = max(lengths)
    padded_rows: list[int] = []
    real_slots: list[int] = []
    for slot, (length, offset) in enumerate(zip(lengths, offsets, strict=True)):
        padded_rows.extend([*range(offset, offset + length), *[0] * (max_len - length)])
        real_slots.extend(range(slot * max_len, slot * max_len + length))
    key_mask = torch.arange(max_len).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return PaddedGroup(
        torch.tensor(padded_rows, device=device),
        torch.tensor(real_slots, device=device),
        key_mask.view(len(lengths), 1, 1, max_len).to(device),
        len(lengths),
        max_len,
    )


class BertSelfAttention(nn.Module):
    def __init__(self, args: BertArgs) -> None:
        super().__init__()
        self.num_heads, self.head_dim = args.num_heads, args.head_dim
        size = args.hidden_size
        self.qkv = Linear(size, {"query": size, "key": size, "value": size}, bias=True)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        qkv = self.qkv(x)
        attended = [self._attend(qkv[group.padded_rows], group) for group in batch.groups]
        return torch.cat(attended)[batch.order] if len(attended) > 1 else attended[0][batch.order]

    def _attend(self, padded: torch.Tensor, group: PaddedGroup) -> torch.Tensor:
        shape = (group.batch_size, group.max_len, self.num_heads, self.head_dim)
        query, key, value = (part.reshape(shape).transpose(1, 2) for part in padded.chunk(3, dim=-1))
        attended = functional.scaled_dot_product_attention(query, key, value, attn_mask=group.key_mask)
        return attended.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)[group.real_slots]


class BertSelfOutput(nn.Module):
    """``LayerNorm(residual + dense(x))``; the attention's and the MLP's output alike."""

    def __init__(self, in_features: int, args: BertArgs) -> None:
        super().__init__()
        self.dense = Linear(in_features, {"dense": args.hidden_size}, bias=True)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dense(x))  # type: ignore[no-any-return]


class BertAttention(nn.Module):
    def __init__(self, args: BertArgs) -> None:
        super().__init__()
        self.self = BertSelfAttention(args)
        self.output = BertSelfOutput(args.hidden_size, args)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        return self.output(self.self(x, batch), x)  # type: ignore[no-any-return]


class BertIntermediate(nn.Module):
    def __init__(self, args: BertArgs) -> None:
        super().__init__()
        self.dense = Linear(args.hidden_size, {"dense": args.intermediate_size}, bias=True)
        self.activation = _ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, args: BertArgs) -> None:
        super().__init__()
        self.attention = BertAttention(args)
        self.intermediate = BertIntermediate(args)
        self.output = BertSelfOutput(args.intermediate_size, args)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        return self.output(self.intermediate(x), x)  # type: ignore[no-any-return]


class BertEncoder(nn.Module):
    def __init__(self, args: BertArgs) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(args) for _ in range(args.num_layers))


class BertEmbeddings(nn.Module):
    def __init__(self, args: BertArgs) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.token_type_embeddings = nn.Embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Every token is of the first segment (type 0): an embedding input is one text.
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])  # type: ignore[no-any-return]


class BertModel(nn.Module):
    """``forward`` returns the last layer's hidden states ``[num_tokens, hidden]``."""

    IGNORED_TENSORS = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")
    """Checkpoint tensors an embedding model does not use (the position buffer, the NSP pooler)."""

    def __init__(self, args: BertArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = BertEmbeddings(args)
        self.encoder = BertEncoder(args)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x  # type: ignore[no-any-return]
