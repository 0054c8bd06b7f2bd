"""LoRA in the engine against peft + transformers (the reference: the adapter merged into the
weights): greedy tokens alone and mixed in one batch with other adapters and the base model; the
adapter in the KV block hash; slots, unloading and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engine import REFERENCE_GREEDY, hf_greedy, make_config, random_prompts
from support.lora import make_peft_adapter, merged_checkpoint

from herd.worker.engine import LLMEngine, UnknownLoraError
from herd.worker.model_runner import torch_engine
from herd.worker.sampling_params import SamplingParams

Adapters = dict[str, tuple[Path, Path]]  # name -> (adapter folder, merged reference checkpoint)


def _adapters(base: Path, root: Path, specs: dict[str, tuple[int, int, tuple[str, ...] | None]]) -> Adapters:
    made: Adapters = {}
    for name, (rank, seed, targets) in specs.items():
        extra = {} if targets is None else {"targets": targets}
        adapter = make_peft_adapter(base, root / name, rank=rank, seed=seed, **extra)  # type: ignore[arg-type]
        made[name] = (adapter, merged_checkpoint(base, adapter, root / f"{name}-merged"))
    return made


@pytest.fixture(scope="module")
def tiny_adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    """Rank 8 on every projection, rank 16 on some (the fused layers' other shards stay zero)."""
    specs = {"r8": (8, 1, None), "r16": (16, 2, ("q_proj", "v_proj", "down_proj"))}
    return _adapters(tiny_llama, tmp_path_factory.mktemp("tiny-loras"), specs)


def lora_engine(base: Path, adapters: Adapters, **engine: object) -> LLMEngine:
    config = make_config(base, **engine).model_copy(
        update={"lora_modules": {name: adapter for name, (adapter, _) in adapters.items()}}
    )
    return torch_engine(config)


def run(
    engine: LLMEngine, requests: list[tuple[list[int], str | None]], params: SamplingParams
) -> list[list[int]]:
    """Add every request at once (one batch), step to the end; each request's tokens."""
    for index, (prompt, lora) in enumerate(requests):
        engine.add_request(f"r{index}", prompt, params, lora_name=lora)
    tokens: dict[str, list[int]] = {f"r{index}": [] for index in range(len(requests))}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    return [tokens[f"r{index}"] for index in range(len(requests))]


def assert_matches_merged(
    base: Path, adapters: Adapters, requests: list[tuple[list[int], str | None]], outputs: list[list[int]]
) -> None:
    for (prompt, lora), tokens in zip(requests, outputs, strict=True):
        reference = base if lora is None else adapters[lora][1]
        expected, _ = hf_greedy(reference, prompt, REFERENCE_GREEDY.max_tokens)
        assert tokens == expected, f"adapter {lora}"
        if lora is not None:
            assert (
                tokens != hf_greedy(base, prompt, REFERENCE_GREEDY.max_tokens)[0]
            )  # the adapter did something


def test_tiny_adapters_alone_match_transformers_merged(tiny_llama: Path, tiny_adapters: Adapters) -> None:
    engine = lora_engine(tiny_llama, tiny_adapters)
    [prompt] = random_prompts([23], vocab_size=384)
    for name in tiny_adapters:
        assert_matches_merged(
            tiny_llama, tiny_adapters, [(prompt, name)], run(engine, [(prompt, name)], REFERENCE_GREEDY)
        )


def test_tiny_adapters_mixed_with_the_base_in_one_batch(tiny_llama: Path, tiny_adapters: Adapters) -> None:
    """Prefills and decodes of both adapters and the base model share every step; chunked prefill
    (budget 32) splits the long prompts across steps."""
    prompts = random_prompts([19, 3, 40, 7, 25, 11, 64], vocab_size=384)
    loras = [None, "r8", "r16", "r8", None, "r16", "r8"]
    requests = list(zip(prompts, loras, strict=True))
    outputs = run(lora_engine(tiny_llama, tiny_adapters, maxBatchTokens=32), requests, REFERENCE_GREEDY)
    assert_matches_merged(tiny_llama, tiny_adapters, requests, outputs)


def test_one_slot_runs_adapters_in_turn(tiny_llama: Path, tiny_adapters: Adapters) -> None:
    """maxLoras 1: the two adapters never share a step (the slot is reloaded between them), the
    base model runs beside either, and every answer is still its adapter's."""
    prompts = random_prompts([12, 9, 15], vocab_size=384)
    requests = list(zip(prompts, ["r8", "r16", None], strict=True))
    engine = lora_engine(tiny_llama, tiny_adapters, maxLoras=1)
    outputs = run(engine, requests, REFERENCE_GREEDY)
    assert_matches_merged(tiny_llama, tiny_adapters, requests, outputs)


def test_the_adapter_is_in_the_block_hash(tiny_llama: Path, tiny_adapters: Adapters) -> None:
    """The same prompt under another adapter (or none) hits no cached block; under its own it does."""
    engine = lora_engine(tiny_llama, tiny_adapters)
    [prompt] = random_prompts([48], vocab_size=384)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    run(engine, [(prompt, "r8")], params)
    cached: dict[str | None, int] = {}
    for index, lora in enumerate([None, "r16", "r8"]):
        engine.add_request(f"again-{index}", prompt, params, lora_name=lora)
        cached[lora] = engine.step()[0].num_cached_tokens
        engine.abort_request(f"again-{index}")
    assert cached == {None: 0, "r16": 0, "r8": 32}


def test_unloading_forgets_the_adapters_blocks_and_refuses_its_requests(
    tiny_llama: Path, tiny_adapters: Adapters
) -> None:
    engine = lora_engine(tiny_llama, tiny_adapters)
    [prompt] = random_prompts([48], vocab_size=384)
    run(engine, [(prompt, "r8"), (prompt, None)], SamplingParams(max_tokens=1))
    num_cached = len(engine.block_manager.cached)
    engine.drain_kv_events()
    engine.unload_lora("r8")
    assert len(engine.block_manager.cached) == num_cached - 3  # the base model's blocks stay
    assert [event.kind for event in engine.drain_kv_events()] == ["removed"]
    with pytest.raises(UnknownLoraError, match="'r8' is not loaded"):
        engine.add_request("late", prompt, SamplingParams(max_tokens=1), lora_name="r8")
    engine.load_lora("r8", tiny_adapters["r8"][0])
    assert run(engine, [(prompt, "r8")], REFERENCE_GREEDY) == [
        hf_greedy(tiny_adapters["r8"][1], prompt, 32)[0]
    ]


def test_loading_refusals(tiny_llama: Path, tiny_adapters: Adapters, tmp_path: Path) -> None:
    adapter = tiny_adapters["r16"][0]
    with pytest.raises(ValueError, match="maxLoras above 0"):
        torch_engine(make_config(tiny_llama)).load_lora("x", adapter)
    engine = lora_engine(tiny_llama, {}, maxLoras=2, maxLoraRank=8)
    with pytest.raises(ValueError, match=r"rank 16, above engine\.maxLoraRank 8"):
        engine.load_lora("x", adapter)
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        engine.load_lora("x", tmp_path)
    with pytest.raises(ValueError, match="taken"):
        engine.load_lora("test-model", tiny_adapters["r8"][0])
    with pytest.raises(UnknownLoraError):
        engine.unload_lora("never-loaded")
    engine.add_request("busy", [5, 6, 7], SamplingParams(max_tokens=4), lora_name=None)
    engine.load_lora("r8", tiny_adapters["r8"][0])
    engine.add_request("busy-r8", [5, 6, 7], SamplingParams(max_tokens=4), lora_name="r8")
    with pytest.raises(ValueError, match="serves 1 requests"):
        engine.unload_lora("r8")


@pytest.mark.slow
def test_demo_model_adapters_match_transformers_merged(
    demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The acceptance: two peft adapters on SmolLM2-135M (random weights, rank 8 and 16), alone and
    mixed in one batch with base-model requests, give transformers' greedy tokens with the adapter merged."""
    from herd.api.prompt import PromptRenderer

    adapters = _adapters(
        demo_model, tmp_path_factory.mktemp("demo-loras"), {"r8": (8, 1, None), "r16": (16, 2, None)}
    )
    renderer = PromptRenderer.from_pretrained(demo_model)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Kubernetes pods are"]
    prompts = [renderer.encode(text) for text in texts]
    engine = lora_engine(demo_model, adapters, maxBatchTokens=16)
    for name in adapters:
        alone = run(engine, [(prompts[0], name)], REFERENCE_GREEDY)
        assert_matches_merged(demo_model, adapters, [(prompts[0], name)], alone)
    mixed = [*zip(prompts, ["r8", None, "r16", "r8"], strict=True), (prompts[1], "r16"), (prompts[2], None)]
    assert_matches_merged(demo_model, adapters, mixed, run(engine, mixed, REFERENCE_GREEDY))
