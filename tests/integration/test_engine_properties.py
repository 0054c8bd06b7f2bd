"""Property tests: generated sampling settings straight against the engine on a tiny model.

Whatever the settings (within what the server accepts), no exception escapes a step, every request
finishes with ``stop`` or ``length`` after at most ``max_tokens`` and at least ``min_tokens`` tokens,
and every KV block is free again at the end. A small pool (preemption) and a batch limit make the
requests share steps in changing company.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.engine import make_engine

from herd.worker.engine import LLMEngine
from herd.worker.outputs import RequestOutput
from herd.worker.sampling_params import MAX_SEED, MIN_SEED, SamplingParams

pytestmark = pytest.mark.timeout(300)

VOCAB = 384
MAX_MODEL_LEN = 96
MAX_STEPS = 400

_token_ids = st.integers(min_value=0, max_value=VOCAB - 1)
_stop_strings = st.sampled_from(["e", " ", "t"]) | st.text(
    string.ascii_lowercase + " ", min_size=1, max_size=3
)
"""Single common characters stop often (the tiny model's text is random), longer ones rarely."""
_temperatures = st.one_of(st.just(0.0), st.floats(min_value=0.05, max_value=2.0))


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.integers(min_value=1, max_value=12))
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(min_value=0, max_value=max_tokens)),
        temperature=draw(_temperatures),
        top_p=draw(st.floats(min_value=0.01, max_value=1.0)),
        top_k=draw(st.integers(min_value=-1, max_value=VOCAB)),
        min_p=draw(st.floats(min_value=0.0, max_value=1.0)),
        seed=draw(st.none() | st.integers(min_value=MIN_SEED, max_value=MAX_SEED)),
        presence_penalty=draw(st.floats(min_value=-2.0, max_value=2.0)),
        frequency_penalty=draw(st.floats(min_value=-2.0, max_value=2.0)),
        repetition_penalty=draw(st.floats(min_value=0.01, max_value=10.0)),
        logit_bias=draw(
            st.dictionaries(_token_ids, st.floats(min_value=-100.0, max_value=100.0), max_size=6)
        ),
        stop=tuple(draw(st.lists(_stop_strings, max_size=2))),
        stop_token_ids=tuple(draw(st.lists(_token_ids, max_size=6))),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.none() | st.integers(min_value=0, max_value=5)),
    )


_requests = st.lists(
    st.tuples(st.lists(_token_ids, min_size=1, max_size=MAX_MODEL_LEN - 12), sampling_params()),
    min_size=1,
    max_size=4,
)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama, num_blocks=12, maxBatchSize=3, maxModelLen=MAX_MODEL_LEN)


def _run(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return outputs
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")


@settings(max_examples=40, deadline=None, database=None)
@given(requests=_requests)
def test_any_accepted_settings_finish_cleanly(
    engine: LLMEngine, requests: list[tuple[list[int], Any]]
) -> None:
    for index, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{index}", prompt, params)
    outputs = _run(engine)
    for index, (_, params) in enumerate(requests):
        steps = outputs[f"r{index}"]
        last = steps[-1]
        assert last.error is None, last.error
        assert last.finished and last.finish_reason in ("stop", "length")
        assert [step.finished for step in steps] == [False] * (len(steps) - 1) + [True]
        num_tokens = sum(len(step.new_token_ids) for step in steps)
        assert num_tokens == last.num_output_tokens
        assert params.min_tokens <= num_tokens <= params.max_tokens
        if params.logprobs is not None:
            assert all(len(step.logprobs or []) == len(step.new_token_ids) for step in steps)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert not engine.has_unfinished_requests()
