"""Fault isolation in the engine: an injected fault fails its own request, or its own batch, only.

Faults are injected where they could arise (a logit edit, the draw, logprobs, the detokenizer, the
stop checks, the batched forward); everything else is the real engine on a tiny model. After each
fault the other requests' tokens equal a fault-free run's, every KV block is free again, and the
engine serves new requests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.engine import make_engine, random_prompts

from herd.worker import sampler as sampler_module
from herd.worker.detokenizer import IncrementalDetokenizer
from herd.worker.engine import EngineResetError, LLMEngine
from herd.worker.outputs import RequestOutput
from herd.worker.sampler import Sampler
from herd.worker.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

PROMPTS = random_prompts([9, 21, 14], vocab_size=384, seed=3)
GOOD = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BAD = SamplingParams(max_tokens=8, temperature=0.7, presence_penalty=0.5, logprobs=2, stop=("zq~",))
"""The faulty request: it edits its logits, samples, asks for logprobs and has a stop string, so
every injection below can single it out."""
MAX_STEPS = 200


class InjectedError(RuntimeError):
    pass


def _raise_for_bad(original: Callable[..., Any], is_bad: Callable[..., bool]) -> Callable[..., Any]:
    def faulty(*args: Any, **kwargs: Any) -> Any:
        if is_bad(*args, **kwargs):
            raise InjectedError("injected fault")
        return original(*args, **kwargs)

    return faulty


def _inject(stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    is_bad_seq = lambda seq: seq.request_id == "bad"  # noqa: E731
    match stage:
        case "logit-edits":
            patched = _raise_for_bad(sampler_module.edit_logits, lambda row, seq, eos: is_bad_seq(seq))
            monkeypatch.setattr(sampler_module, "edit_logits", patched)
        case "draw":  # the batched draw raises whenever the bad row is in it
            patched = _raise_for_bad(Sampler._choose, lambda self, logits, seqs: any(map(is_bad_seq, seqs)))
            monkeypatch.setattr(Sampler, "_choose", patched)
        case "logprobs":
            patched = _raise_for_bad(sampler_module._logprob, lambda raw, row, token, top: top == 2)
            monkeypatch.setattr(sampler_module, "_logprob", patched)
        case "detokenizer":
            patched = _raise_for_bad(IncrementalDetokenizer.add, lambda self, ids, **_: "zq~" in self.stop)
            monkeypatch.setattr(IncrementalDetokenizer, "add", patched)
        case "stop-checks":
            patched = _raise_for_bad(LLMEngine._finish_reason, lambda self, seq, token: is_bad_seq(seq))
            monkeypatch.setattr(LLMEngine, "_finish_reason", patched)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama, num_blocks=24, maxBatchSize=2)


@pytest.fixture(scope="module")
def expected(engine: LLMEngine) -> list[list[int]]:
    """The fault-free greedy tokens of ``PROMPTS``."""
    return [result.new_token_ids for result in engine.generate(PROMPTS, GOOD)]


def _run(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until every request finished; each request's last output, its tokens gathered."""
    results: dict[str, RequestOutput] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return results
        for output in engine.step():
            tokens = results[output.request_id].new_token_ids if output.request_id in results else []
            output.new_token_ids = tokens + output.new_token_ids
            results[output.request_id] = output
    raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")


def _assert_engine_sound(engine: LLMEngine, expected: list[list[int]]) -> None:
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert not engine._requests and not engine._held
    assert [result.new_token_ids for result in engine.generate(PROMPTS, GOOD)] == expected


@pytest.mark.parametrize(
    ("stage", "words"),
    [
        ("logit-edits", "during sampling"),
        ("draw", "during sampling"),
        ("logprobs", "during sampling"),
        ("detokenizer", "during stop checks and detokenization"),
        ("stop-checks", "during stop checks and detokenization"),
    ],
    ids=["logit-edits", "draw", "logprobs", "detokenizer", "stop-checks"],
)
def test_a_fault_in_one_request_fails_that_request_only(
    engine: LLMEngine,
    expected: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    stage: str,
    words: str,
) -> None:
    with monkeypatch.context() as patch:
        _inject(stage, patch)
        engine.add_request("good-0", PROMPTS[0], GOOD)
        engine.add_request("bad", PROMPTS[1], BAD)
        engine.add_request("good-2", PROMPTS[2], GOOD)
        results = _run(engine)
    bad = results["bad"]
    assert bad.finished and bad.finish_reason == "abort"
    assert bad.error is not None and words in bad.error and "InjectedError: injected fault" in bad.error
    assert [results["good-0"].new_token_ids, results["good-2"].new_token_ids] == [expected[0], expected[2]]
    assert results["good-0"].error is None and results["good-2"].error is None
    failures = [record for record in caplog.records if record.msg.startswith("request failed")]
    assert [getattr(record, "request_id", None) for record in failures] == ["bad"]
    _assert_engine_sound(engine, expected)


def test_a_failed_forward_fails_its_batch_and_the_engine_serves_on(
    engine: LLMEngine, expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    execute = engine.runner.execute
    calls = {"num": 0}

    def fails_on_third_step(chunks: Any) -> Any:
        calls["num"] += 1
        if calls["num"] == 3:
            raise InjectedError("injected forward fault")
        return execute(chunks)

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "execute", fails_on_third_step)
        for index, prompt in enumerate(PROMPTS):  # two run in the batch (maxBatchSize=2), one waits
            engine.add_request(f"r{index}", prompt, GOOD)
        results = _run(engine)
    failed = {request_id for request_id, output in results.items() if output.error is not None}
    assert failed == {"r0", "r1"}
    assert all("forward pass failed" in str(results[request_id].error) for request_id in failed)
    assert results["r2"].new_token_ids == expected[2]
    _assert_engine_sound(engine, expected)


def test_a_failed_forward_leaves_none_of_its_blocks_in_the_prefix_cache(
    engine: LLMEngine, expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's full blocks entered the cache when planned; its failure takes them out again."""
    [prompt] = random_prompts([3 * engine.block_manager.block_size + 5], vocab_size=384, seed=11)
    cached_before = set(engine.block_manager.cached)
    engine.drain_kv_events()

    def fails(chunks: Any) -> Any:
        raise InjectedError("injected forward fault")

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "execute", fails)
        engine.add_request("lost", prompt, GOOD)
        [output] = engine.step()
    assert output.error is not None
    assert set(engine.block_manager.cached) == cached_before
    stored, removed = engine.drain_kv_events()
    assert (stored.kind, removed.kind, len(stored.block_hashes)) == ("stored", "removed", 3)
    assert removed.block_hashes == stored.block_hashes
    _assert_engine_sound(engine, expected)


def test_a_reset_that_fails_raises_for_the_worker_to_exit(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(tiny_llama, num_blocks=8)

    def gone(*_: Any) -> None:
        raise InjectedError("device lost")

    monkeypatch.setattr(engine.runner, "execute", gone)
    monkeypatch.setattr(engine.runner, "check_health", gone)
    engine.add_request("r", PROMPTS[0], GOOD)
    with pytest.raises(EngineResetError, match="cannot go on after a failed batch: device lost"):
        engine.step()


def test_add_request_refuses_ids_outside_the_vocabulary(engine: LLMEngine) -> None:
    cases = [
        (PROMPTS[0] + [384], GOOD, "token id 384 in prompt"),
        (PROMPTS[0], SamplingParams(logit_bias={-1: 1.0}), "token id -1 in logit_bias"),
        (PROMPTS[0], SamplingParams(stop_token_ids=(400,), min_tokens=2), "token id 400 in stop_token_ids"),
        (PROMPTS[0], SamplingParams(top_k=385), "top_k 385 exceeds"),
    ]
    for prompt, params, words in cases:
        with pytest.raises(ValueError, match=words):
            engine.add_request("refused", prompt, params)
    assert not engine.has_unfinished_requests()
