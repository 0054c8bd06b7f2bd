"""Builders for engine unit tests: sequences and block managers without any model."""

from __future__ import annotations

import pytest

from herd.api.kv_hash import root_hash
from herd.worker.sampling_params import SamplingParams
from herd.worker.sequence import Sequence

MODEL_ID = "unit-model"


def make_seq(
    tokens: list[int], *, request_id: str = "r", salt: str | None = None, params: SamplingParams | None = None
) -> Sequence:
    return Sequence(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        params=params or SamplingParams(max_tokens=64),
        root_hash=root_hash(MODEL_ID, salt),
    )


@pytest.fixture
def seq_factory() -> type[Sequence]:
    return Sequence
