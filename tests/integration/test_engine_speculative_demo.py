"""SmolLM2-135M with speculative decoding: greedy tokens with n-gram and with draft speculation
(the model as its own draft) equal those without, on prompts that ask it to edit a given text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.engine import make_engine

from herd.api.prompt import PromptRenderer
from herd.worker.sampling_params import SamplingParams

TEXTS = [
    "Paged attention keeps every sequence's keys and values in fixed blocks, so memroy is not wasted.",
    "The scheduler runs the decoding sequences first and fills the rest of the step with prompt chunks.",
]
PARAMS = SamplingParams(max_tokens=32, temperature=0.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "ngram", "numTokens": 4},
        {"method": "draft", "draftModel": "<demo>", "numTokens": 3, "adaptive": False},
    ],
    ids=["ngram", "draft"],
)
def test_demo_model_speculation_keeps_the_greedy_tokens(
    demo_model: Path, speculative: dict[str, Any]
) -> None:
    if speculative["method"] == "draft":
        speculative = {**speculative, "draftModel": f"file://{demo_model}"}
    renderer = PromptRenderer.from_pretrained(demo_model)
    prompts = [
        renderer.encode_chat(
            [{"role": "user", "content": f"Fix the spelling and repeat the text:\n\n{text}"}]
        )
        for text in TEXTS
    ]
    plain = make_engine(demo_model, maxBatchTokens=64).generate(prompts, PARAMS)
    engine = make_engine(demo_model, maxBatchTokens=64, speculative=speculative)
    results = engine.generate(prompts, PARAMS)
    assert [r.new_token_ids for r in results] == [r.new_token_ids for r in plain]
    assert engine.stats.spec_num_accepted_tokens > 0
