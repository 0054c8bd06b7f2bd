"""``/v1/embeddings`` validation without an engine: dimensions, inputs and encodings."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
from support.tiny_models import make_tiny_bert

from herd.api.errors import HttpError
from herd.api.openai import EmbeddingRequest
from herd.api.prompt import PromptRenderer
from herd.api.protocol import WorkerInfo
from herd.worker.server._embeddings import check_dimensions, check_generates, embedding_inputs, encode_vector

GEOMETRY: dict[str, Any] = {"role": "unified", "block_size": 16, "epoch": "e", "dtype": "float32"}
SHAPE: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 16, "vocab_size": 384}


def info(**fields: Any) -> WorkerInfo:
    return WorkerInfo(model="emb", max_model_len=8, **GEOMETRY, **SHAPE, **fields)


PLAIN = info(embedding_size=64, is_normalized=True)
ANY_SIZE = info(embedding_size=64, is_matryoshka=True)
LISTED = info(embedding_size=64, is_matryoshka=True, matryoshka_dimensions=[16, 32])


@pytest.mark.parametrize(
    ("dimensions", "model", "expected"),
    [(None, PLAIN, None), (64, PLAIN, None), (20, ANY_SIZE, 20), (32, LISTED, 32), (64, LISTED, None)],
    ids=["unset", "own-size", "any-size", "listed", "own-size-listed"],
)
def test_dimensions_allowed(dimensions: int | None, model: WorkerInfo, expected: int | None) -> None:
    assert check_dimensions(dimensions, model) == expected


@pytest.mark.parametrize(
    ("dimensions", "model", "message"),
    [
        (32, PLAIN, "not trained to be cut short"),
        (65, ANY_SIZE, "ask for 1 to 64"),
        (20, LISTED, "ask for 16, 32"),
    ],
    ids=["not-matryoshka", "above-size", "not-listed"],
)
def test_dimensions_refused(dimensions: int, model: WorkerInfo, message: str) -> None:
    with pytest.raises(HttpError, match=message) as caught:
        check_dimensions(dimensions, model)
    assert (caught.value.status, caught.value.param) == (400, "dimensions")


def test_the_model_must_fit_the_route() -> None:
    with pytest.raises(HttpError, match="generation model") as caught:
        check_dimensions(None, info())
    assert caught.value.param == "model"
    with pytest.raises(HttpError, match="embedding model") as caught:
        check_generates(PLAIN)
    assert caught.value.param == "model"
    check_generates(info())


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> PromptRenderer:
    return PromptRenderer.from_pretrained(make_tiny_bert(tmp_path_factory.mktemp("bert")))


def request(value: Any) -> EmbeddingRequest:
    return EmbeddingRequest(model="emb", input=value)


def test_every_input_form_becomes_token_lists(renderer: PromptRenderer) -> None:
    text_ids = renderer.encode("hello world")
    assert text_ids[0] == renderer.tokenizer.token_to_id("[CLS]")
    assert embedding_inputs(renderer, request("hello world"), PLAIN) == [text_ids]
    assert embedding_inputs(renderer, request(["hello world", "paris"]), PLAIN)[0] == text_ids
    assert embedding_inputs(renderer, request([5, 6, 7]), PLAIN) == [[5, 6, 7]]
    assert embedding_inputs(renderer, request([[5], [6, 7]]), PLAIN) == [[5], [6, 7]]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([5, 384], "outside the vocabulary"),
        ([[5], [-1]], "outside the vocabulary"),
        ("the quick brown fox jumps over the lazy dog", "at most 8"),
        ([[5], list(range(9))], r"input\[1\] has 9 tokens"),
    ],
    ids=["id-past-vocab", "negative-id", "text-too-long", "second-too-long"],
)
def test_inputs_refused_naming_the_field(renderer: PromptRenderer, value: Any, message: str) -> None:
    with pytest.raises(HttpError, match=message) as caught:
        embedding_inputs(renderer, request(value), PLAIN)
    assert (caught.value.status, caught.value.param) == (400, "input")


def test_base64_is_little_endian_float32() -> None:
    vector = [0.5, -1.25, 3.0]
    assert encode_vector(vector, "float") == vector
    encoded = encode_vector(vector, "base64")
    assert isinstance(encoded, str)
    assert np.frombuffer(base64.b64decode(encoded), dtype="<f4").tolist() == vector
