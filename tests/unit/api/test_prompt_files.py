"""``PromptRenderer.from_files`` (what the orchestrator builds from a worker's files) equals
``from_pretrained`` (what the worker builds from its folder) token for token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from herd.api.prompt import TOKENIZER_FILES, PromptError, PromptRenderer, read_tokenizer_files

MESSAGES: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse. " * 5},
        {"role": "user", "content": "Héllo, wörld! 你好 🙂"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again"},
    ],
]
TEXTS = ["Once upon a time", "  spaces\tand\nnewlines <|im_end|> 123456"]


def assert_same(folder: Path) -> None:
    local = PromptRenderer.from_pretrained(folder)
    remote = PromptRenderer.from_files(json.loads(json.dumps(read_tokenizer_files(folder))))
    assert (remote.bos_token, remote.eos_token, remote.eos_token_ids) == (
        local.bos_token,
        local.eos_token,
        local.eos_token_ids,
    )
    assert remote.eos_token_ids and remote.has_chat_template == local.has_chat_template
    for messages in MESSAGES:
        assert remote.encode_chat(messages) == local.encode_chat(messages)
    for text in TEXTS:
        assert remote.encode(text) == local.encode(text)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"], ids=["tiny-llama", "tiny-qwen3"])
def test_from_files_equals_from_pretrained(model: str, request: pytest.FixtureRequest) -> None:
    assert_same(request.getfixturevalue(model))


@pytest.mark.slow
def test_from_files_equals_from_pretrained_on_the_demo_model(demo_model: Path) -> None:
    assert_same(demo_model)


def test_the_renderer_keeps_the_files_it_was_built_from(tiny_llama: Path) -> None:
    files = PromptRenderer.from_pretrained(tiny_llama).files
    assert dict(files) == read_tokenizer_files(tiny_llama)
    assert set(files) <= set(TOKENIZER_FILES) and "tokenizer.json" in files


def test_model_configs_are_cut_to_their_eos_ids(tmp_path: Path, tiny_llama: Path) -> None:
    (tmp_path / "tokenizer.json").write_text((tiny_llama / "tokenizer.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [5, 7], "hidden_size": 64}))
    (tmp_path / "model.safetensors").write_text("not read")
    files = read_tokenizer_files(tmp_path)
    assert set(files) == {"tokenizer.json", "config.json"}
    assert json.loads(files["config.json"]) == {"eos_token_id": [5, 7]}
    assert PromptRenderer.from_files(files).eos_token_ids == {5, 7}


def test_files_without_a_tokenizer_are_refused() -> None:
    with pytest.raises(PromptError, match=r"tokenizer\.json"):
        PromptRenderer.from_files({"tokenizer_config.json": "{}"})
