"""A prefill for a remote decode holds its prompt blocks in the step that finishes it, until released."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engine import make_engine, random_prompts

from herd.worker.engine import LLMEngine
from herd.worker.sampling_params import SamplingParams

HOLD = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, hold_prompt_blocks=True)
PROMPT_LEN = 16 * 5 + 3


@pytest.fixture
def engine(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama, num_blocks=32)


def finish(engine: LLMEngine, request_id: str, params: SamplingParams) -> list[int] | None:
    prompt = random_prompts([PROMPT_LEN], vocab_size=200)[0]
    engine.add_request(request_id, prompt, params)
    outputs = [output for _ in range(8) for output in engine.step() if output.request_id == request_id]
    assert outputs[-1].finished
    return outputs[-1].held_block_ids


def test_the_prompt_blocks_stay_held_until_released(engine: LLMEngine) -> None:
    total = engine.block_manager.num_total_blocks
    held = finish(engine, "a", HOLD)
    assert held is not None and len(held) == PROMPT_LEN // 16
    assert engine.block_manager.num_free_blocks == total - len(held)
    assert engine.release_held("a") == len(held)
    assert engine.block_manager.num_free_blocks == total
    assert engine.release_held("a") == 0


def test_an_abort_after_the_finish_frees_the_held_blocks(engine: LLMEngine) -> None:
    finish(engine, "b", HOLD)
    engine.abort_request("b")  # the caller hung up before it read the last output
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_an_ordinary_request_holds_nothing(engine: LLMEngine) -> None:
    assert finish(engine, "c", SamplingParams(max_tokens=1, temperature=0.0)) is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
