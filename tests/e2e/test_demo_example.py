"""What `make run` serves: `herd up examples/smollm2.yaml` (2 SmolLM2 workers behind the gateway)
answers the openai SDK in English, streaming and not, and reports prefix-cache hits."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.herd_up import herd_up_of, shipped_example

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_the_demo_example_answers_the_openai_sdk(tmp_path: Path, demo_model: Path) -> None:
    with herd_up_of(shipped_example("smollm2.yaml", tmp_path, demo_model), tmp_path) as up:
        client = up.client()
        assert [model.id for model in client.models.list()] == ["smollm2"]
        answer = client.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=24, temperature=0
        )
        assert "Paris" in (answer.choices[0].message.content or "")
        stream = client.chat.completions.create(
            model="smollm2",
            messages=QUESTION,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        assert "Paris" in text
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        # The same prompt again: kv_cache_aware routing sends it to the worker that cached it.
        assert usage.prompt_tokens_details.cached_tokens >= 16
