from __future__ import annotations

from pathlib import Path

import pytest

from herd.api import PromptError, PromptRenderer

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_tokens_match_transformers(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_llama)
    expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    renderer = PromptRenderer.from_pretrained(tiny_llama)
    assert renderer.render_chat(MESSAGES) == expected
    assert renderer.encode_chat(MESSAGES) == reference(expected, add_special_tokens=False)["input_ids"]


def test_round_trip_and_eos(tiny_llama: Path) -> None:
    renderer = PromptRenderer.from_pretrained(tiny_llama)
    ids = renderer.encode("Paris is the capital of France.")
    assert renderer.decode(ids) == "Paris is the capital of France."
    assert renderer.tokenizer.token_to_id("<|im_end|>") in renderer.eos_token_ids


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PromptError, match=r"no tokenizer\.json"):
        PromptRenderer.from_pretrained(tmp_path)
