"""The demo model: `herd model prepare smollm2` yields a checkpoint transformers loads and that knows Paris."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from herd.api import PromptRenderer

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_checkpoint_is_a_plain_safetensors_llama(demo_model: Path) -> None:
    config = json.loads((demo_model / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert "quantization_config" not in config
    assert (demo_model / "model.safetensors").exists()
    assert (demo_model / "tokenizer.json").exists()


def test_transformers_answers_paris_greedily(demo_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    model = AutoModelForCausalLM.from_pretrained(demo_model)
    ids = PromptRenderer.from_pretrained(demo_model).encode_chat(QUESTION)
    with torch.no_grad():
        output = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(output[0, len(ids) :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_renderer_matches_transformers_chat_template(demo_model: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(demo_model)
    expected = reference.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    renderer = PromptRenderer.from_pretrained(demo_model)
    assert renderer.render_chat(QUESTION) == expected
    assert renderer.encode_chat(QUESTION) == reference(expected, add_special_tokens=False)["input_ids"]


def test_prepare_is_idempotent(demo_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from herd.cli.model import prepare_smollm2

    before = (demo_model / "model.safetensors").stat().st_mtime_ns
    prepare_smollm2(demo_model)
    assert (demo_model / "model.safetensors").stat().st_mtime_ns == before
    assert "already prepared" in capsys.readouterr().err
