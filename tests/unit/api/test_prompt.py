from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
from support.tiny_models import train_tokenizer

from herd.api import PromptError, PromptRenderer
from herd.api.openai import ChatCompletionRequest, CompletionRequest, LengthError
from herd.api.prompt import MAX_NICENESS, PREPARE_NICENESS, PromptThreads, prompt_count

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


def _chat(content: str, **fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": content}], **fields}
    )


def test_a_prompt_that_leaves_no_room_is_refused_on_its_count(tiny_llama: Path) -> None:
    renderer = PromptRenderer.from_pretrained(tiny_llama)
    request = _chat("word " * 50)
    num_tokens = len(renderer.chat_request_ids(request))
    assert renderer.chat_request_ids(request, max_model_len=num_tokens + 1) == renderer.chat_request_ids(
        request
    )
    with pytest.raises(LengthError, match=f"the prompt has {num_tokens} tokens") as refused:
        renderer.chat_request_ids(request, max_model_len=num_tokens)
    assert refused.value.param == "messages"
    completion = CompletionRequest.model_validate({"model": "m", "prompt": ["short", "word " * 50]})
    with pytest.raises(LengthError) as refused:
        renderer.completion_request_ids(completion, max_model_len=20)
    assert refused.value.param == "prompt"


def test_text_that_is_not_unicode_is_a_prompt_error(tiny_llama: Path) -> None:
    renderer = PromptRenderer.from_pretrained(tiny_llama)
    with pytest.raises(PromptError, match="not valid Unicode"):
        renderer.encode("a\ud800b")


@pytest.mark.parametrize(
    ("fields", "num_prompt_tokens", "expected"),
    [
        ({}, 10, 90),
        ({"max_tokens": 5}, 10, 5),
        ({"max_tokens": 90}, 10, 90),
        ({"max_tokens": 91}, 10, ("max_tokens", "ask for at most 90 tokens")),
        ({"max_tokens": 5, "max_completion_tokens": 95}, 10, ("max_completion_tokens", "at most 90")),
        ({}, 99, 1),
        ({}, 100, ("messages", "the prompt has 100 tokens but this model's maxModelLen is 100")),
    ],
    ids=[
        "all-the-room",
        "asked",
        "exactly-the-room",
        "one-too-many",
        "newer-field-wins",
        "one-left",
        "none-left",
    ],
)
def test_the_output_budget_is_one_rule(
    fields: dict[str, int], num_prompt_tokens: int, expected: int | tuple[str, str]
) -> None:
    request = _chat("x", **fields)
    if isinstance(expected, int):
        assert request.output_budget(num_prompt_tokens, 100, prompt_param="messages") == expected
        return
    with pytest.raises(LengthError, match=expected[1]) as refused:
        request.output_budget(num_prompt_tokens, 100, prompt_param="messages")
    assert refused.value.param == expected[0]


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="threads have their own priority on Linux only"
)
async def test_prompt_threads_run_below_the_serving_threads() -> None:
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    threads = PromptThreads("test-prompt", 1)
    serving = niceness()
    try:
        assert await threads.run(niceness) == min(MAX_NICENESS, serving + PREPARE_NICENESS)
        assert await threads.run(sum, [1, 2, 3]) == 6
    finally:
        threads.close()
    assert niceness() == serving


@pytest.mark.parametrize(("size", "is_inline"), [(0, True), (99, True), (100, False), (10**6, False)])
async def test_small_bodies_are_prepared_inline_and_large_ones_on_the_prompt_threads(
    size: int, is_inline: bool
) -> None:
    threads = PromptThreads("test-sized", 1, inline_bytes=100)
    try:
        where = await threads.run_sized(size, threading.current_thread)
    finally:
        threads.close()
    assert (where is threading.current_thread()) == is_inline


@pytest.mark.parametrize(
    ("template", "kwargs", "words"),
    [
        ("{% for tool in tools %}{{ tool.name }}{% endfor %}", {"tools": 5}, "TypeError"),
        ("{{ 10 // budget }}", {"budget": 0}, "ZeroDivisionError"),
        ("{{ name + 1 }}", {"name": "a"}, "TypeError"),
        ("{{ range(n) | list }}", {"n": 10**9}, "OverflowError"),  # the sandbox's own limit
    ],
    ids=["a-number-looped-over", "divided-by-zero", "a-string-added-to", "a-range-past-the-sandbox"],
)
def test_a_template_failing_on_the_requests_values_is_a_prompt_error(
    template: str, kwargs: dict[str, object], words: str
) -> None:
    renderer = PromptRenderer(train_tokenizer(), chat_template=template)
    with pytest.raises(PromptError, match=f"chat_template_kwargs \\({words}"):
        renderer.render_chat([{"role": "user", "content": "hi"}], template_kwargs=kwargs)


@pytest.mark.parametrize(
    ("prompt", "count"),
    [
        ("one text", 1),
        ([5, 6, 7], 1),
        (["a", "b", "c"], 3),
        ([[5], [6, 7]], 2),
        (["a", [5]], 2),
    ],
)
def test_prompt_count_is_how_many_lists_prompt_ids_returns(
    tiny_llama: Path, prompt: str | list[str] | list[int] | list[list[int]], count: int
) -> None:
    renderer = PromptRenderer.from_pretrained(tiny_llama)
    assert prompt_count(prompt) == count == len(renderer.prompt_ids(prompt, param="prompt"))
