"""A model's shape, read from a HF ``config.json`` into one typed value, or refused.

Each family has its parser; a setting herd does not implement (an unknown architecture, a rope
type it lacks, another activation, a quantized checkpoint) raises ``UnsupportedModelError`` naming
it and what herd supports, so a model that herd cannot run exactly never loads. Sliding windows
are resolved per layer the way ``transformers`` resolves them for each family: Mistral's window
covers every layer, Qwen2/Qwen3's ``use_sliding_window`` turns it on from layer
``max_window_layers`` (or as ``layer_types`` says), Qwen3-MoE's covers every layer, and Gemma
alternates local and global layers (``layer_types``, else Gemma 2's every other layer and Gemma 3's
``sliding_window_pattern``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["SUPPORTED_ARCHITECTURES", "MoEArgs", "ModelArgs", "Rope", "UnsupportedModelError"]

ROPE_TYPES = ("default", "linear", "llama3")
SLIDING, FULL = "sliding_attention", "full_attention"


class UnsupportedModelError(ValueError):
    """The checkpoint's config asks for something herd does not run exactly."""


@dataclass(frozen=True)
class Rope:
    theta: float
    scaling: dict[str, Any] | None  # None: the default rope; else its ``rope_type`` and factors


@dataclass(frozen=True)
class MoEArgs:
    """A sparse MLP: ``top_k`` of ``num_experts`` experts per token, on ``sparse_layers``."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool
    sparse_layers: frozenset[int]


@dataclass(frozen=True)
class ModelArgs:
    """What a decoder needs. Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms; Gemma its own
    attention scale, soft-capping and a separate rope for its sliding layers; MoE families ``moe``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: Rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    checkpoint_dtype: str | None
    layer_windows: tuple[int | None, ...]  # per layer: its sliding window, None for full attention
    attention_scale: float  # the query scale: head_dim ** -0.5 but in Gemma
    hidden_act: str
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_rope: Rope | None = None  # the sliding layers' rope where it differs (Gemma 3)
    moe: MoEArgs | None = None

    @property
    def window_sizes(self) -> frozenset[int]:
        """The distinct sliding windows of the model's layers (empty when every layer is global)."""
        return frozenset(window for window in self.layer_windows if window is not None)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArgs:
        architecture = (config.get("architectures") or ["LlamaForCausalLM"])[0]
        parse = _PARSERS.get(architecture)
        if parse is None:
            raise UnsupportedModelError(
                f"a {architecture}, which herd cannot run: herd runs {', '.join(sorted(_PARSERS))}"
            )
        if config.get("quantization_config"):
            raise UnsupportedModelError(
                f"a quantized {architecture}, which herd cannot run: it loads float16, bfloat16 or "
                "float32 weights"
            )
        return parse(config)


def _fail(config: dict[str, Any], setting: str, supported: str) -> UnsupportedModelError:
    architecture = (config.get("architectures") or ["LlamaForCausalLM"])[0]
    return UnsupportedModelError(f"a {architecture} with {setting}, which herd cannot run: {supported}")


def _rope(config: dict[str, Any], params: dict[str, Any] | None, default_theta: float) -> Rope:
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise _fail(config, f"rope type {kind!r}", f"herd supports the rope types {', '.join(ROPE_TYPES)}")
    theta = float(params.get("rope_theta", config.get("rope_theta", default_theta)))
    return Rope(theta, params if kind != "default" else None)


def _check_activation(config: dict[str, Any], key: str, supported: str) -> None:
    activation = config.get(key) or supported
    if activation != supported:
        raise _fail(config, f"{key} {activation!r}", f"herd runs this family with {supported}")


def _windows(config: dict[str, Any], default_types: list[str], window: int | None) -> tuple[int | None, ...]:
    """Each layer's window: ``layer_types`` where the config lists them, else ``default_types``."""
    types = config.get("layer_types") or default_types
    if len(types) != len(default_types) or not set(types) <= {SLIDING, FULL}:
        raise _fail(config, f"layer_types {types}", f"list {SLIDING} or {FULL} for each layer")
    if window is None and SLIDING in types:
        raise _fail(config, "sliding layers but no sliding_window", "set sliding_window")
    return tuple(window if kind == SLIDING else None for kind in types)


def _llama(config: dict[str, Any], activation: tuple[str, str] = ("hidden_act", "silu")) -> ModelArgs:
    """Llama 2/3, SmolLM: the base every family here starts from (no sliding window).
    ``activation`` is the config key of the MLP's activation and the one value herd runs."""
    num_heads = int(config["num_attention_heads"])
    num_layers = int(config["num_hidden_layers"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // num_heads)
    attention_bias = bool(config.get("attention_bias", False))
    _check_activation(config, *activation)
    return ModelArgs(
        architecture=(config.get("architectures") or ["LlamaForCausalLM"])[0],
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=_rope(config, config.get("rope_parameters") or config.get("rope_scaling"), 10000.0),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=False,
        checkpoint_dtype=config.get("dtype") or config.get("torch_dtype"),
        layer_windows=tuple(None for _ in range(num_layers)),
        attention_scale=head_dim**-0.5,
        hidden_act=activation[1],
    )


def _mistral(config: dict[str, Any]) -> ModelArgs:
    """Mistral: ``sliding_window`` (when set) on every layer; ``layer_types`` is ignored, as in
    ``transformers``."""
    window = config.get("sliding_window")
    args = _llama(config)
    return replace(args, layer_windows=tuple(window for _ in range(args.num_layers)))


def _qwen_window(config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Qwen2/Qwen3: with ``use_sliding_window``, the layers from ``max_window_layers`` on slide."""
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    first_sliding = int(config.get("max_window_layers", 28))
    default = [SLIDING if window is not None and i >= first_sliding else FULL for i in range(num_layers)]
    return _windows(config, default, window)


def _qwen2(config: dict[str, Any]) -> ModelArgs:
    args = _llama(config)
    return replace(args, qkv_bias=True, o_bias=False, layer_windows=_qwen_window(config, args.num_layers))


def _qwen3(config: dict[str, Any]) -> ModelArgs:
    args = _llama(config)
    return replace(args, qk_norm=True, layer_windows=_qwen_window(config, args.num_layers))


def _qwen3_moe(config: dict[str, Any]) -> ModelArgs:
    """Qwen3-MoE: Qwen3's attention (its window, when on, covers every layer) and a sparse MLP on the
    layers not in ``mlp_only_layers`` whose number is a multiple of ``decoder_sparse_step``."""
    args = _llama(config)
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    step = int(config.get("decoder_sparse_step", 1))
    dense = set(config.get("mlp_only_layers") or [])
    sparse = frozenset(
        i for i in range(args.num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0
    )
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    moe = MoEArgs(
        num_experts=num_experts,
        top_k=int(config["num_experts_per_tok"]),
        intermediate_size=int(config["moe_intermediate_size"]),
        normalize_top_k=bool(config.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )
    return replace(args, qk_norm=True, layer_windows=tuple(window for _ in range(args.num_layers)), moe=moe)


def _gemma(config: dict[str, Any], *, is_gemma3: bool) -> ModelArgs:
    """Gemma 2/3: ``query_pre_attn_scalar``, soft-capping, alternating local and global layers; Gemma 3
    adds q/k norms and its sliding layers' own rope (``rope_local_base_freq``)."""
    args = _llama(config, ("hidden_activation", "gelu_pytorch_tanh"))
    if config.get("use_bidirectional_attention"):
        raise _fail(config, "use_bidirectional_attention", "herd runs causal decoders only")
    attn_softcap = config.get("attn_logit_softcapping")
    if is_gemma3 and attn_softcap is not None:
        # transformers' Gemma 3 reads attn_logit_softcapping but never applies it: no reference to match.
        raise _fail(config, "attn_logit_softcapping", "Gemma 3 runs without attention soft-capping")
    pattern = int(config.get("sliding_window_pattern", 6)) if is_gemma3 else 2
    default = [SLIDING if (i + 1) % pattern else FULL for i in range(args.num_layers)]
    rope, sliding_rope = _gemma_ropes(config, is_gemma3=is_gemma3)
    return replace(
        args,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        qk_norm=is_gemma3,
        rope=rope,
        sliding_rope=sliding_rope,
        layer_windows=_windows(config, default, config.get("sliding_window")),
        attention_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=None if attn_softcap is None else float(attn_softcap),
        final_softcap=_optional_float(config.get("final_logit_softcapping")),
    )


def _gemma_ropes(config: dict[str, Any], *, is_gemma3: bool) -> tuple[Rope, Rope | None]:
    """The global layers' rope and, for Gemma 3, the sliding layers': from ``rope_parameters`` by layer
    type (transformers 5), else ``rope_theta`` / ``rope_scaling`` and ``rope_local_base_freq``."""
    params = config.get("rope_parameters") or {}
    if not is_gemma3:
        return _rope(config, params or config.get("rope_scaling"), 10000.0), None
    if FULL in params or SLIDING in params:
        return _rope(config, params.get(FULL), 1e6), _rope(config, params.get(SLIDING), 1e4)
    local = {"rope_theta": config.get("rope_local_base_freq", 1e4)}
    return _rope(config, params or config.get("rope_scaling"), 1e6), _rope(config, local, 1e4)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


_PARSERS: dict[str, Callable[[dict[str, Any]], ModelArgs]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Gemma2ForCausalLM": lambda config: _gemma(config, is_gemma3=False),
    "Gemma3ForCausalLM": lambda config: _gemma(config, is_gemma3=True),
}
SUPPORTED_ARCHITECTURES = frozenset(_PARSERS)
