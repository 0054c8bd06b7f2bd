"""A model's shape, read from a HF ``config.json`` into one typed value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ModelArgs"]


@dataclass(frozen=True)
class ModelArgs:
    """What the Llama-family decoder needs; Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    checkpoint_dtype: str | None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArgs:
        architecture = (config.get("architectures") or ["LlamaForCausalLM"])[0]
        num_heads = int(config["num_attention_heads"])
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            checkpoint_dtype=config.get("dtype") or config.get("torch_dtype"),
        )
