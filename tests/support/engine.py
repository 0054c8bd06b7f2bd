"""Helpers for engine tests: engines on small KV pools, prompts, and transformers as the reference."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.model_runner import torch_engine
from herd.worker.outputs import RequestOutput
from herd.worker.sampling_params import SamplingParams

LOGPROB_ATOL = 1e-3
"""Parity tolerance on the sampled token's log-probability, in float32. The engine computes the same
math as transformers in a different order (paged gather, batched SDPA, fused RMSNorm, experts
grouped), so values agree to ~1e-5 on the tiny models and ~1e-4 on SmolLM2's 30 layers; 1e-3 leaves
room for that drift and is still far below any gap that flips a greedy choice in these tests."""

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
REFERENCE_GREEDY = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0, logprobs=0)
"""What ``hf_greedy`` computes: 32 tokens, EOS masked (``min_new_tokens``), with logprobs."""


def assert_matches_reference(path: Path, prompts: list[list[int]], results: list[RequestOutput]) -> None:
    """Each result (``REFERENCE_GREEDY``) has transformers' greedy tokens and their log-probabilities."""
    for prompt, result in zip(prompts, results, strict=True):
        tokens, logprobs = hf_greedy(path, prompt, 32)
        assert result.new_token_ids == tokens
        assert result.logprobs is not None
        ours = [lp.logprob for lp in result.logprobs]
        theirs = logprobs.gather(1, logprobs.new_tensor(tokens).long().unsqueeze(1)).squeeze(1).tolist()
        assert ours == pytest.approx(theirs, abs=LOGPROB_ATOL)


def make_engine(path: Path, *, num_blocks: int | None = None, **engine: Any) -> LLMEngine:
    """An engine on ``path``; ``num_blocks`` sizes the KV pool exactly (default: 64 MiB)."""
    return torch_engine(make_config(path, num_blocks=num_blocks, **engine))


def generate_with_adapters(
    engine: LLMEngine, requests: list[tuple[list[int], str | None]], params: SamplingParams
) -> list[list[int]]:
    """Add every request (a prompt and its LoRA adapter, or None) at once, as one batch, and step to
    the end; each request's tokens."""
    for index, (prompt, lora) in enumerate(requests):
        engine.add_request(f"r{index}", prompt, params, lora_name=lora)
    tokens: dict[str, list[int]] = {f"r{index}": [] for index in range(len(requests))}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    return [tokens[f"r{index}"] for index in range(len(requests))]


def make_config(path: Path, *, num_blocks: int | None = None, **engine: Any) -> EngineConfig:
    """The CPU engine configuration ``make_engine`` runs."""
    kv_cache = dict(engine.pop("kvCache", {}))
    if num_blocks is not None:
        kv_cache["memoryGiB"] = num_blocks * _bytes_per_block(path, kv_cache.get("blockSize", 16)) / 2**30
    kv_cache.setdefault("memoryGiB", 1 / 16)
    spec = {"device": "cpu", "kvCache": kv_cache, **engine}
    return EngineConfig(model_path=path, served_name="test-model", engine=spec)  # type: ignore[arg-type]


def tier_gib(path: Path, num_blocks: int) -> float:
    """The GiB of ``num_blocks`` blocks of 16 tokens of ``path``'s KV (a tier's size in blocks)."""
    return num_blocks * _bytes_per_block(path, 16) / 2**30


def _bytes_per_block(path: Path, block_size: int) -> int:
    from herd.worker.loader import read_model_args

    args = read_model_args(path)
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * 4


def random_prompts(lengths: list[int], *, vocab_size: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab_size) for _ in range(n)] for n in lengths]


@functools.cache
def _hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path, prompt: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of ``prompt`` and its per-step log-softmax ``[steps, vocab]``.

    ``min_new_tokens`` keeps EOS out of the choice, as ``SamplingParams.min_tokens`` does in herd.
    """
    return _hf_greedy(path, tuple(prompt), num_tokens)


@functools.cache
def _hf_greedy(path: Path, prompt: tuple[int, ...], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    model = _hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt)]),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    logprobs = torch.cat([step.float() for step in out.logits]).log_softmax(dim=-1)
    return out.sequences[0, len(prompt) :].tolist(), logprobs


WINDOW = 20
"""The tiny sliding-window variants' window: over a block (16) and under the parity prompts (70)."""


def make_tiny_variant(folder: Path, base: Path, arch: str) -> Path:
    """A tiny random checkpoint of ``arch`` (a key of ``_variants``), with ``base``'s tokenizer."""
    import shutil

    torch.manual_seed(1)
    model = _variants()[arch]()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() >= 2 else 1.0)
            if param.dim() == 1 and arch.startswith(("qwen2", "gemma")):
                # nonzero q/k/v biases (Qwen2) and norm weights (Gemma's are zeros), so a missing
                # bias or a norm without its ``1 +`` would show
                param.add_(0.1)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, folder / name)
    return folder


def _variants() -> dict[str, Callable[[], Any]]:
    """Each variant's random model: the families and settings herd runs beside Llama."""
    import transformers as hf

    common: dict[str, Any] = {
        "vocab_size": 384,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    # Qwen's window from layer 1 on (max_window_layers) of 3; Gemma 3's pattern 3 of 4 layers:
    # local, local, global, local, the global layers' rope linearly scaled, the local ones' own base.
    qwen_window = {
        "num_hidden_layers": 3,
        "use_sliding_window": True,
        "sliding_window": WINDOW,
        "max_window_layers": 1,
    }
    gemma = {**common, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": WINDOW}
    gemma3_rope = {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    moe = {**common, "num_hidden_layers": 3, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8}
    return {
        "qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**common, tie_word_embeddings=True)),
        "mistral": lambda: hf.MistralForCausalLM(hf.MistralConfig(**common, sliding_window=None)),
        "llama3-rope": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**common, rope_parameters=llama3)),
        "mistral-window": lambda: hf.MistralForCausalLM(hf.MistralConfig(**common, sliding_window=WINDOW)),
        "qwen2-window": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**{**common, **qwen_window})),
        "qwen3-window": lambda: hf.Qwen3ForCausalLM(hf.Qwen3Config(**{**common, **qwen_window}, head_dim=16)),
        "gemma2": lambda: hf.Gemma2ForCausalLM(
            hf.Gemma2Config(**gemma, attn_logit_softcapping=5.0, final_logit_softcapping=8.0)
        ),
        "gemma3": lambda: hf.Gemma3ForCausalLM(
            hf.Gemma3TextConfig(
                **{**gemma, "num_hidden_layers": 4}, sliding_window_pattern=3, rope_parameters=gemma3_rope
            )
        ),
        "qwen3-moe": lambda: hf.Qwen3MoeForCausalLM(
            hf.Qwen3MoeConfig(**moe, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
        ),
        "qwen3-moe-window": lambda: hf.Qwen3MoeForCausalLM(
            hf.Qwen3MoeConfig(
                **moe,
                num_experts_per_tok=3,
                use_sliding_window=True,
                sliding_window=WINDOW,
                decoder_sparse_step=2,
            )
        ),
    }
