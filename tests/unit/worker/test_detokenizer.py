"""Incremental detokenization and stop strings on a real byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
from support.tiny_models import train_tokenizer

from herd.api.prompt import PromptRenderer
from herd.worker.detokenizer import IncrementalDetokenizer

TEXT = "Paris is the capital of France. Berlin is the capital of Germany. héllo wörld ✓ end"


@pytest.fixture(scope="module")
def renderer() -> PromptRenderer:
    return PromptRenderer(train_tokenizer(), chat_template=None)


def stream(renderer: PromptRenderer, stop: tuple[str, ...], text: str = TEXT) -> tuple[list[str], bool]:
    prompt = renderer.encode("Question:")
    ids = renderer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(renderer, prompt, stop)
    deltas = []
    for index, token_id in enumerate(ids):
        deltas.append(detokenizer.add([token_id], is_last=index == len(ids) - 1))
        if detokenizer.is_stopped:
            break
    return deltas, detokenizer.is_stopped


def test_deltas_join_to_the_full_decode(renderer: PromptRenderer) -> None:
    deltas, stopped = stream(renderer, ())
    assert "".join(deltas) == renderer.decode(renderer.encode(TEXT, add_special_tokens=False))
    assert not stopped
    assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (("capital",), "Paris is the "),
        ((" of France", "Berlin"), "Paris is the capital"),
        (("Germany.", "France."), "Paris is the capital of "),
        (("wörld",), "Paris is the capital of France. Berlin is the capital of Germany. héllo "),
        (("absent",), TEXT),
    ],
    ids=["single", "first-of-two", "earliest-wins", "multibyte", "no-match"],
)
def test_stop_strings_cut_the_text_and_are_not_included(
    renderer: PromptRenderer, stop: tuple[str, ...], expected: str
) -> None:
    deltas, stopped = stream(renderer, stop)
    assert "".join(deltas) == expected
    assert stopped is (expected != TEXT)


def test_text_that_may_start_a_stop_string_is_held_back(renderer: PromptRenderer) -> None:
    detokenizer = IncrementalDetokenizer(renderer, [], ("France!",))
    ids = renderer.encode("capital of France", add_special_tokens=False)
    emitted = "".join(detokenizer.add([token_id]) for token_id in ids)
    assert emitted == "capital of "  # "France" could still become "France!": six characters wait
    assert (
        detokenizer.add(renderer.encode(".", add_special_tokens=False), is_last=True)
        == ("capital of France."[len(emitted) :])
    )


def test_stop_strings_wait_for_min_tokens(renderer: PromptRenderer) -> None:
    """Before ``min_tokens`` are out (``may_stop`` False) a stop string passes; afterwards it stops."""
    ids = renderer.encode("capital of France. capital of Spain", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(renderer, [], ("capital",))
    first_half = len(renderer.encode("capital of France.", add_special_tokens=False))
    emitted = "".join(detokenizer.add([token_id], may_stop=False) for token_id in ids[:first_half])
    emitted += "".join(detokenizer.add([token_id]) for token_id in ids[first_half:])
    assert detokenizer.is_stopped
    assert emitted == "capital of France. "
