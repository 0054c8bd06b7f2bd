"""examples/chat-and-embeddings.yaml under `herd up`: one gateway serves SmolLM2's chat and
all-MiniLM-L6-v2's embeddings to the openai SDK, each model on its own workers."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import openai
import pytest
import torch
from sentence_transformers import SentenceTransformer
from support.herd_up import herd_up_of, shipped_example

from herd.api.prompt import PromptRenderer
from herd.api.protocol import WORKER_HEADER

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
TEXTS = ["What is the capital of France?", "Paris is the capital of France.", "Cats sleep a lot."]


def test_one_gateway_serves_chat_and_embeddings(tmp_path: Path, demo_model: Path, minilm: Path) -> None:
    manifest = shipped_example("chat-and-embeddings.yaml", tmp_path, demo_model, embedding_model=minilm)
    with herd_up_of(manifest, tmp_path) as up:
        client = up.client()
        assert sorted(model.id for model in client.models.list()) == ["all-minilm-l6-v2", "smollm2"]
        answer = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": TEXTS[0]}], max_tokens=24, temperature=0
        )
        assert "Paris" in (answer.choices[0].message.content or "")
        embedded = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS)
        workers = Counter(
            client.embeddings.with_raw_response.create(model="all-minilm-l6-v2", input=text).headers[
                WORKER_HEADER
            ]
            for text in TEXTS * 2
        )
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model="smollm2", input="hello")
    ours = torch.tensor([item.embedding for item in embedded.data])
    theirs = torch.as_tensor(SentenceTransformer(str(minilm), device="cpu").encode(TEXTS))
    assert torch.nn.functional.cosine_similarity(ours, theirs).min().item() >= 0.9999
    assert embedded.usage.prompt_tokens == sum(len(ids) for ids in _ids(minilm, TEXTS))
    assert all(worker.startswith("minilm-") for worker in workers)  # the embedding model's own workers
    assert refused.value.body["param"] == "model"  # type: ignore[index]


def _ids(model: Path, texts: list[str]) -> list[list[int]]:
    renderer = PromptRenderer.from_pretrained(model)
    return [renderer.encode(text) for text in texts]
