"""``herd up`` of the shipped simulated example: one process serves its 16 simulated workers, the
gateway routes to them by their KV events, and a repeated prompt finds its prefix cached."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.herd_up import herd_up_of, shipped_example

pytestmark = pytest.mark.e2e

PROMPT = "You are the assistant of a large library. " * 6 + "Which shelf holds the atlases?"


def test_herd_up_serves_the_simulated_example(demo_model: Path, tmp_path: Path) -> None:
    manifest = shipped_example("smollm2-simulated.yaml", tmp_path, demo_model)
    with herd_up_of(manifest, tmp_path) as up:
        assert set(up.workers()) == {"smollm2-sim-workers"}, "one process for the pool"
        client = up.client()
        assert [model.id for model in client.models.list()] == ["smollm2-sim"]
        messages = [{"role": "user", "content": PROMPT}]
        answers = [
            client.chat.completions.create(model="smollm2-sim", messages=messages, max_tokens=6)  # type: ignore[arg-type]
            for _ in range(2)
        ]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    usage = [answer.usage for answer in answers]
    assert usage[0] is not None and usage[1] is not None
    cached = [u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0 for u in usage]
    assert cached[0] == 0 and cached[1] >= 16 * (usage[1].prompt_tokens // 16) - 16
