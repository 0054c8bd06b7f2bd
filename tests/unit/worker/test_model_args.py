"""ModelArgs from config.json: each family's per-layer windows, ropes and experts, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from herd.worker.loader import read_model_args
from herd.worker.models import MODEL_CLASSES, SUPPORTED_ARCHITECTURES, ModelArgs, UnsupportedModelError
from herd.worker.models.args import Rope

W = 512


def config(architecture: str, **overrides: Any) -> dict[str, Any]:
    base = {
        "architectures": [architecture],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return {**base, **overrides}


def windows(architecture: str, **overrides: Any) -> tuple[int | None, ...]:
    return ModelArgs.from_hf_config(config(architecture, **overrides)).layer_windows


@pytest.mark.parametrize(
    ("architecture", "overrides", "expected"),
    [
        ("LlamaForCausalLM", {}, (None,) * 4),
        ("MistralForCausalLM", {"sliding_window": W}, (W,) * 4),
        ("MistralForCausalLM", {"sliding_window": None}, (None,) * 4),
        # transformers' Mistral ignores layer_types: the window covers every layer
        ("MistralForCausalLM", {"sliding_window": W, "layer_types": ["full_attention"] * 4}, (W,) * 4),
        # Qwen2.5's shipped configs: a window and max_window_layers, but use_sliding_window off
        (
            "Qwen2ForCausalLM",
            {"use_sliding_window": False, "sliding_window": W, "max_window_layers": 2},
            (None,) * 4,
        ),
        (
            "Qwen2ForCausalLM",
            {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 1},
            (None, W, W, W),
        ),
        (
            "Qwen3ForCausalLM",
            {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 3},
            (None,) * 3 + (W,),
        ),
        (
            "Qwen2ForCausalLM",
            {
                "use_sliding_window": True,
                "sliding_window": W,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
            },
            (W, None, W, None),
        ),
        # Qwen3-MoE's window, when on, covers every layer (max_window_layers is not read)
        (
            "Qwen3MoeForCausalLM",
            {
                "use_sliding_window": True,
                "sliding_window": W,
                "max_window_layers": 2,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 8,
            },
            (W,) * 4,
        ),
        ("Gemma2ForCausalLM", {"sliding_window": W}, (W, None, W, None)),
        ("Gemma3ForCausalLM", {"sliding_window": W, "sliding_window_pattern": 3}, (W, W, None, W)),
        ("Gemma3ForCausalLM", {"sliding_window": W, "num_hidden_layers": 7}, (W,) * 5 + (None, W)),
    ],
    ids=lambda value: None if isinstance(value, (dict, tuple)) else str(value),
)
def test_each_family_places_its_window_on_the_layers_transformers_does(
    architecture: str, overrides: dict[str, Any], expected: tuple[int | None, ...]
) -> None:
    assert windows(architecture, **overrides) == expected


def test_gemma3_ropes_in_the_shipped_and_the_transformers_5_spelling() -> None:
    linear = {"rope_type": "linear", "factor": 8.0}
    shipped = config(
        "Gemma3ForCausalLM", rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=linear, sliding_window=W
    )
    current = config(
        "Gemma3ForCausalLM",
        sliding_window=W,
        rope_parameters={
            "full_attention": {**linear, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    for hf_config in (shipped, current):
        args = ModelArgs.from_hf_config(hf_config)
        assert args.rope.theta == 1e6 and args.rope.scaling is not None and args.rope.scaling["factor"] == 8.0
        assert args.sliding_rope == Rope(1e4, None)


def test_gemma_scale_softcaps_and_activation() -> None:
    args = ModelArgs.from_hf_config(
        config(
            "Gemma2ForCausalLM",
            sliding_window=W,
            query_pre_attn_scalar=144,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            hidden_act="gelu",  # Gemma reads hidden_activation; transformers ignores hidden_act too
        )
    )
    assert (args.attention_scale, args.attn_softcap, args.final_softcap) == (144**-0.5, 50.0, 30.0)
    assert (args.hidden_act, args.tie_word_embeddings, args.qk_norm) == ("gelu_pytorch_tanh", True, False)


@pytest.mark.parametrize(
    ("overrides", "sparse"),
    [
        ({}, {0, 1, 2, 3}),
        ({"mlp_only_layers": [0, 2]}, {1, 3}),
        ({"decoder_sparse_step": 2}, {1, 3}),
        ({"num_experts": 0}, set()),
    ],
)
def test_qwen3_moe_sparse_layers(overrides: dict[str, Any], sparse: set[int]) -> None:
    moe_config = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, **overrides}
    args = ModelArgs.from_hf_config(config("Qwen3MoeForCausalLM", **moe_config))
    assert args.moe is not None and args.moe.sparse_layers == sparse
    assert (args.moe.top_k, args.moe.intermediate_size, args.moe.normalize_top_k, args.qk_norm) == (
        2,
        16,
        False,
        True,
    )


@pytest.mark.parametrize(
    ("architecture", "overrides", "named"),
    [
        ("Phi3ForCausalLM", {}, ["Phi3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"]),
        ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, ["'yarn'", "llama3"]),
        (
            "Qwen2ForCausalLM",
            {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
            ["Qwen2ForCausalLM", "'dynamic'"],
        ),
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, ["hidden_act 'gelu'", "silu"]),
        (
            "Gemma2ForCausalLM",
            {"hidden_activation": "gelu"},
            ["hidden_activation 'gelu'", "gelu_pytorch_tanh"],
        ),
        (
            "LlamaForCausalLM",
            {"quantization_config": {"quant_method": "awq"}},
            ["quantized LlamaForCausalLM"],
        ),
        ("Gemma3ForCausalLM", {"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping"]),
        ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, ["use_bidirectional_attention"]),
        ("Gemma2ForCausalLM", {"sliding_window": None}, ["no sliding_window"]),
        ("Qwen2ForCausalLM", {"layer_types": ["full_attention"] * 3}, ["layer_types"]),
        (
            "Gemma3ForCausalLM",
            {"sliding_window": W, "layer_types": ["chunked_attention"] * 4},
            ["chunked_attention"],
        ),
    ],
    ids=lambda value: None if isinstance(value, (dict, list)) else str(value),
)
def test_a_model_herd_cannot_run_exactly_is_refused_by_name(
    tmp_path: Path, architecture: str, overrides: dict[str, Any], named: list[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config(architecture, **overrides)))
    with pytest.raises(UnsupportedModelError) as raised:
        read_model_args(tmp_path)
    message = str(raised.value)
    assert message.startswith(f"{tmp_path} holds ") and "which herd cannot run" in message
    assert all(part in message for part in [architecture, *named]), message


def test_every_parsed_architecture_has_a_model() -> None:
    assert set(MODEL_CLASSES) == SUPPORTED_ARCHITECTURES
