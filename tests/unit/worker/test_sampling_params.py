"""SamplingParams refuses what no sampler can use, naming the field; what it accepts is usable."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from herd.worker.sampling_params import InvalidParamError, SamplingParams

_any_float = st.floats(allow_nan=True, allow_infinity=True)
_any_int = st.integers(min_value=-(2**70), max_value=2**70)


@settings(max_examples=300, deadline=None, database=None)
@given(
    temperature=_any_float,
    top_p=_any_float,
    min_p=_any_float,
    presence_penalty=_any_float,
    repetition_penalty=_any_float,
    seed=st.none() | _any_int,
    top_k=_any_int,
    max_tokens=_any_int,
    min_tokens=_any_int,
    bias=_any_float,
)
def test_accepted_settings_are_usable_and_refusals_name_their_field(**fields: Any) -> None:
    bias = fields.pop("bias")
    try:
        params = SamplingParams(logit_bias={1: bias}, **fields)
    except InvalidParamError as error:
        refusal = error
    else:
        refusal = None
    if refusal is not None:
        assert refusal.param in {*fields, "logit_bias"}
        assert refusal.param in str(refusal)
        return
    floats = (
        params.temperature,
        params.top_p,
        params.min_p,
        params.presence_penalty,
        params.repetition_penalty,
    )
    assert all(math.isfinite(value) for value in (*floats, bias))
    assert params.temperature >= 0 and 0 < params.top_p <= 1 and 0 <= params.min_p <= 1
    assert params.repetition_penalty > 0 and params.top_k >= -1
    assert 0 <= params.min_tokens <= params.max_tokens
    if params.seed is not None:
        torch.Generator().manual_seed(params.seed)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {5: 1.0}, "top_k": 11}, "top_k"),
        ({"logit_bias": {10: 1.0}}, "logit_bias"),
        ({"stop_token_ids": (3, 10)}, "stop_token_ids"),
        ({"logprobs": 11}, "logprobs"),
    ],
    ids=["top-k", "bias-id", "stop-id", "logprobs"],
)
def test_check_vocab_names_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParamError) as caught:
        SamplingParams(**fields).check_vocab(10)
    assert caught.value.param == param
