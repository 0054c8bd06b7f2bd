"""Helpers for engine tests: engines on small KV pools, prompts, and transformers as the reference."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import torch

from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.model_runner import torch_engine
from herd.worker.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
REFERENCE_GREEDY = SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0, logprobs=0)
"""What ``hf_greedy`` computes: 32 tokens, EOS masked (``min_new_tokens``), with logprobs."""


def make_engine(path: Path, *, num_blocks: int | None = None, **engine: Any) -> LLMEngine:
    """An engine on ``path``; ``num_blocks`` sizes the KV pool exactly (default: 64 MiB)."""
    return torch_engine(make_config(path, num_blocks=num_blocks, **engine))


def make_config(path: Path, *, num_blocks: int | None = None, **engine: Any) -> EngineConfig:
    """The CPU engine configuration ``make_engine`` runs."""
    kv_cache = dict(engine.pop("kvCache", {}))
    if num_blocks is not None:
        kv_cache["memoryGiB"] = num_blocks * _bytes_per_block(path, kv_cache.get("blockSize", 16)) / 2**30
    kv_cache.setdefault("memoryGiB", 1 / 16)
    spec = {"device": "cpu", "kvCache": kv_cache, **engine}
    return EngineConfig(model_path=path, served_name="test-model", engine=spec)  # type: ignore[arg-type]


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


def make_tiny_variant(folder: Path, base: Path, arch: str) -> Path:
    """A tiny random checkpoint of ``arch`` ('qwen2', 'mistral', 'llama3-rope'), with ``base``'s tokenizer."""
    import shutil

    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

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
    builders = {
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)),
        "mistral": lambda: MistralForCausalLM(MistralConfig(**common, sliding_window=None)),
        "llama3-rope": lambda: LlamaForCausalLM(LlamaConfig(**common, rope_parameters=llama3)),
    }
    torch.manual_seed(1)
    model = builders[arch]()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() >= 2 else 1.0)
            if param.dim() == 1 and arch == "qwen2":
                param.add_(0.1)  # nonzero q/k/v biases, so a missing bias would show
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, folder / name)
    return folder
