"""Rotary frequencies agree with transformers' own initializers, llama3 scaling included."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from herd.worker.layers.rotary import RotaryEmbedding

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "rope", [LLAMA3, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}], ids=["llama3", "linear"]
)
def test_scaled_frequencies_match_transformers(rope: dict[str, object]) -> None:
    config = LlamaConfig(
        hidden_size=256, num_attention_heads=2, rope_parameters=rope, max_position_embeddings=131072
    )
    expected, _ = ROPE_INIT_FUNCTIONS[str(rope["rope_type"])](config, "cpu")
    rotary = RotaryEmbedding(128, float(str(rope["rope_theta"])), 64, rope)
    torch.testing.assert_close(rotary._inv_freq, expected.float())


def test_unknown_scaling_is_refused() -> None:
    with pytest.raises(ValueError, match="yarn"):
        RotaryEmbedding(64, 10000.0, 16, {"rope_type": "yarn", "factor": 2.0})
