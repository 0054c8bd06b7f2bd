"""Embeddings on herd's engine: parity with sentence-transformers, batching by the scheduler, and
``/v1/embeddings`` through the openai SDK (in process, on the real engine)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
import torch
from sentence_transformers import SentenceTransformer
from support.tiny_models import make_tiny_bert
from support.worker_server import engine_config

from herd.worker.async_engine import AsyncEngine
from herd.worker.engine import LLMEngine
from herd.worker.model_runner import torch_engine
from herd.worker.models import UnsupportedModelError
from herd.worker.sampling_params import SamplingParams
from herd.worker.server import PublicOptions, build_public_app

pytestmark = [pytest.mark.timeout(300)]

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "a",
    "Embeddings map text to vectors; similar texts land near each other.",
    "Paris is the capital of France.",
    "Kubernetes runs pods on nodes, and an operator reconciles custom resources into objects.",
]
PARAMS = SamplingParams(max_tokens=1)


def embed(engine: LLMEngine, texts: list[str]) -> torch.Tensor:
    outputs = engine.generate([engine.renderer.encode(text) for text in texts], PARAMS)
    return torch.tensor([output.embedding for output in outputs])


def reference(path: Path, texts: list[str]) -> torch.Tensor:
    model = SentenceTransformer(str(path), device="cpu")
    return torch.as_tensor(model.encode(texts, convert_to_numpy=True))


def test_minilm_matches_sentence_transformers(minilm: Path) -> None:
    engine = torch_engine(engine_config(minilm))
    ours, theirs = embed(engine, TEXTS), reference(minilm, TEXTS)
    similarity = torch.nn.functional.cosine_similarity(ours, theirs)
    assert similarity.min().item() >= 0.9999, similarity.tolist()
    assert engine.info.embedding_size == 384 and engine.info.max_model_len == 256  # max_seq_length


@pytest.mark.parametrize(
    "variant",
    [{"pooling": "cls"}, {"pooling": "lasttoken"}, {"pooling": "mean", "normalize": False}],
    ids=["cls", "lasttoken", "mean-unnormalized"],
)
def test_tiny_berts_match_sentence_transformers(tmp_path: Path, variant: dict[str, Any]) -> None:
    path = make_tiny_bert(tmp_path, **variant)
    ours, theirs = embed(torch_engine(engine_config(path)), TEXTS), reference(path, TEXTS)
    assert torch.nn.functional.cosine_similarity(ours, theirs).min().item() >= 0.9999
    assert torch.allclose(ours.norm(dim=1), theirs.norm(dim=1), rtol=1e-4)


def test_one_step_embeds_a_whole_batch_and_a_small_budget_splits_it(tiny_bert: Path) -> None:
    """Embedding requests are batched by the scheduler: all of them in one step when the token
    budget holds them, else whole sequences over several steps, with the same vectors either way."""
    wide = torch_engine(engine_config(tiny_bert))
    alone = torch.cat([embed(wide, [text]) for text in TEXTS])
    steps_before = wide.stats.num_steps
    together = embed(wide, TEXTS)
    assert wide.stats.num_steps - steps_before == 1
    narrow = torch_engine(engine_config(tiny_bert, maxBatchTokens=32))
    split = embed(narrow, TEXTS)
    assert narrow.stats.num_steps > 1
    for batch in (together, split):
        assert torch.allclose(batch, alone, atol=1e-5)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[openai.AsyncOpenAI]:
    path = make_tiny_bert(tmp_path_factory.mktemp("matryoshka"), matryoshka_dimensions=[16, 32])
    front = AsyncEngine(lambda: torch_engine(engine_config(path)))
    front.start()
    await front.wait_loaded()
    app = build_public_app(front, PublicOptions("tiny", max_queue_len=8))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker/v1")
    yield openai.AsyncOpenAI(api_key="none", base_url="http://worker/v1", http_client=http, max_retries=0)
    await http.aclose()
    await front.stop()


@pytest.mark.asyncio(loop_scope="module")
async def test_the_sdk_embeds_text_and_ids_alike(client: openai.AsyncOpenAI) -> None:
    """The SDK asks for base64 and decodes it; floats, ids and text give the same vectors."""
    texts = ["hello world", "what is the capital of france?"]
    by_text = await client.embeddings.create(model="tiny", input=texts)
    assert [item.index for item in by_text.data] == [0, 1]
    assert all(len(item.embedding) == 64 for item in by_text.data)
    tokenized = await client.post("http://worker/tokenize", cast_to=httpx.Response, body={"prompt": texts[1]})
    ids = tokenized.json()["tokens"]
    by_ids = await client.embeddings.create(model="tiny", input=[ids], encoding_format="float")
    assert by_ids.data[0].embedding == pytest.approx(by_text.data[1].embedding, abs=1e-6)
    assert by_ids.usage.prompt_tokens == by_ids.usage.total_tokens == len(ids)
    assert by_text.usage.prompt_tokens > by_ids.usage.prompt_tokens


@pytest.mark.asyncio(loop_scope="module")
async def test_matryoshka_dimensions_cut_and_renormalize(client: openai.AsyncOpenAI) -> None:
    full = (await client.embeddings.create(model="tiny", input="paris")).data[0].embedding
    cut = (await client.embeddings.create(model="tiny", input="paris", dimensions=16)).data[0].embedding
    expected = torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0)
    assert cut == pytest.approx(expected.tolist(), abs=1e-6)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": "paris", "dimensions": 20}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": [[1, 2], [999]]}, "input"),
        ({"input": "word " * 70}, "input"),
        ({"input": "paris", "encoding_format": "int8"}, "encoding_format"),
        ({"input": ["paris"] * 9}, "input"),  # more than the engine ever queues: a 429 would never pass
    ],
    ids=["unlisted-dimensions", "empty", "id-past-vocab", "too-long", "bad-format", "more-than-the-queue"],
)
async def test_bad_requests_name_the_field(
    client: openai.AsyncOpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.post("/embeddings", cast_to=httpx.Response, body={"model": "tiny", **fields})
    assert caught.value.body["param"] == param  # type: ignore[index]


@pytest.mark.asyncio(loop_scope="module")
async def test_an_embedding_model_refuses_completions(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="answers /v1/embeddings only"):
        await client.completions.create(model="tiny", prompt="hello", max_tokens=2)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_generation_model_refuses_embeddings(tiny_llama: Path) -> None:
    front = AsyncEngine(lambda: torch_engine(engine_config(tiny_llama)))
    front.start()
    await front.wait_loaded()
    try:
        app = build_public_app(front, PublicOptions("tiny"))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://worker"
        ) as http:
            response = await http.post("/v1/embeddings", json={"model": "tiny", "input": "hello"})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "model"
    finally:
        await front.stop()


@pytest.mark.parametrize(("model", "task"), [("tiny_bert", "generate"), ("tiny_llama", "embed")])
def test_a_task_the_checkpoint_cannot_serve_is_refused_by_name(
    model: str, task: str, request: pytest.FixtureRequest
) -> None:
    with pytest.raises(UnsupportedModelError, match=f"engine.task is {task} but"):
        torch_engine(engine_config(request.getfixturevalue(model), task=task))
